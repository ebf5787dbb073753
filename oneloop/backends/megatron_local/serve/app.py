"""HTTP routes of `oneloop serve`: the Tinker `/api/v1/...` protocol as the tinker 0.38 SDK uses it.

Routes (method, path -> body type -> answer):
- POST client/config, client/dynamic_config -> feature flags (API-key auth, plain polling,
  no custom losses, optional zstd of forward_backward bodies).
- POST create_session, session_heartbeat (410 once finished), telemetry (accepted, dropped),
  sessions/{id}/finish; GET healthz, get_server_capabilities.
- POST create_model, load_weights, forward_backward (protobuf, optionally `Content-Encoding:
  zstd`; `forward_only` selects `forward`), optim_step, save_weights, save_weights_for_sampler,
  asample, unload_model (releases the model's trainer) -> `UntypedAPIFuture`; POST get_info,
  weights_info, create_sampling_session and GET samplers/{id} answer directly.
- POST retrieve_future: long poll (`long_poll_s`), 408 + `TryAgainResponse` while running,
  then the result (protobuf for Sample/ForwardBackward) or `{error, category}`;
  POST cancel_future.
- GET training_runs, training_runs/{id}, training_runs/{id}/checkpoints, checkpoints;
  DELETE training_runs/{id}/checkpoints/{weights|sampler_weights}/{name}.

Bodies are read raw and validated in `wire`/`codec` (never by FastAPI), so a malformed body is a
400 naming the field, never a 422 or 5xx. Auth and size limits run first, in `security`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
from collections.abc import AsyncIterator
from typing import Any

import pydantic
import zstandard
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from tinker import types

from oneloop.backends.megatron_local.serve.codec.fast_scan import (
    ScannedForwardBackward,
    decode_request,
)
from oneloop.backends.megatron_local.serve.codec.reference import DecodedForwardBackward
from oneloop.backends.megatron_local.serve.hot_routes import HotRoutes
from oneloop.backends.megatron_local.serve.service import ServeService
from oneloop.backends.megatron_local.serve.wire import (
    CancelFutureRequest,
    FinishSessionRequest,
    WeightsInfoRequest,
    check_checkpoint_id,
    check_run_id,
    client_config,
    parse_json,
    parse_sample_request,
    try_again_body,
)
from oneloop.errors import WireError

logger = logging.getLogger(__name__)
SWEEP_INTERVAL_S = 10.0
"""Default period of the sweeper (expired results, stale gaps, session expiry, idle trainers);
shorter when the lifecycle bounds are short (`LifecycleLimits.sweep_interval_s`)."""


def _json(model: pydantic.BaseModel | dict[str, Any] | None, status: int = 200) -> Response:
    if isinstance(model, pydantic.BaseModel):
        body = model.model_dump_json(exclude_none=True)
        return Response(body, status, media_type="application/json")
    return JSONResponse(model, status)


def _decompress(body: bytes, limit: int) -> bytes:
    out, total = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            while chunk := reader.read(1 << 20):
                total += len(chunk)
                if total > limit:
                    raise WireError(f"body: decompresses to more than {limit} bytes", 413)
                out.append(chunk)
    except zstandard.ZstdError as e:
        raise WireError(f"body: not valid zstd ({e})") from e
    return b"".join(out)


def _int_param(request: Request, name: str, default: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError as e:
        raise WireError(f"{name}: not an integer: {raw[:40]!r}") from e
    if not 0 <= value <= high:
        raise WireError(f"{name}: must be in [0, {high}]")
    return value


def build_app(
    service: ServeService,
    *,
    compress_fwdbwd: bool,
    use_pyqwest: bool,
    max_decompressed_bytes: int,
    gap_timeout_s: float,
) -> HotRoutes:
    """The app over `service`: FastAPI, behind `HotRoutes` for the two requests of every sample
    call (auth and size limits are wrapped around it by the caller)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        interval_s = service.trainers.limits.sweep_interval_s(SWEEP_INTERVAL_S)

        async def sweep() -> None:
            while True:
                await asyncio.sleep(interval_s)
                service.sweep(gap_timeout_s)

        task = asyncio.create_task(sweep(), name="serve:sweeper")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, timeout=5.0)
            await service.close()

    # redirect_slashes off: an id that decodes to "/" (`/training_runs/%2F`) must be a 404, not a
    # 307 to a listing route; the SDK never relies on slash redirects.
    app = FastAPI(title="oneloop serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False)
    app.state.service = service
    v1 = "/api/v1"

    def error_response(method: str, path: str, error: Exception) -> Response:
        if isinstance(error, WireError):
            headers = {"x-should-retry": "false"} if error.retry is False else None
            return JSONResponse({"detail": str(error)}, error.status, headers=headers)
        service.internal_errors += 1
        logger.error("%s %s failed: %s: %s", method, path, type(error).__name__, error)
        return JSONResponse({"detail": f"internal error: {type(error).__name__}"}, 500)

    @app.exception_handler(WireError)
    async def wire_error(request: Request, error: WireError) -> Response:
        return error_response(request.method, request.url.path, error)

    @app.exception_handler(Exception)  # Starlette's outermost handler: re-raised after the answer
    async def internal_error(request: Request, error: Exception) -> Response:
        return error_response(request.method, request.url.path, error)

    # -- sessions and service --------------------------------------------------------------------

    @app.get(f"{v1}/healthz")
    async def healthz() -> Response:
        return _json(types.HealthResponse(status="ok"))

    @app.post(f"{v1}/client/config")
    async def config(request: Request) -> Response:
        parse_json(types.ClientConfigRequest, await request.body())
        return _json(client_config(compress_fwdbwd=compress_fwdbwd, use_pyqwest=use_pyqwest))

    @app.post(f"{v1}/client/dynamic_config")
    async def dynamic_config(request: Request) -> Response:
        parse_json(types.ClientConfigRequest, await request.body())
        return _json(types.ClientDynamicConfigResponse(sample_cancel_enabled=True))

    @app.get(f"{v1}/get_server_capabilities")
    async def capabilities() -> Response:
        return _json(service.backend.get_server_capabilities())

    @app.post(f"{v1}/create_session")
    async def create_session(request: Request) -> Response:
        req = parse_json(types.CreateSessionRequest, await request.body())
        return _json(service.create_session(req))

    @app.post(f"{v1}/session_heartbeat")
    async def heartbeat(request: Request) -> Response:
        req = parse_json(types.SessionHeartbeatRequest, await request.body())
        return _json(service.heartbeat(req))

    @app.post(f"{v1}/sessions/{{session_id}}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        req = parse_json(FinishSessionRequest, await request.body())
        service.finish(session_id, req.reason.type, req.detail)
        return _json(None)

    @app.post(f"{v1}/telemetry")
    async def telemetry(request: Request) -> Response:
        parse_json(types.TelemetrySendRequest, await request.body())
        return _json(types.TelemetryResponse(status="accepted"))

    # -- training --------------------------------------------------------------------------------

    @app.post(f"{v1}/create_model")
    async def create_model(request: Request) -> Response:
        return _json(service.create_model(parse_json(types.CreateModelRequest,
                                                     await request.body())))

    @app.post(f"{v1}/unload_model")
    async def unload_model(request: Request) -> Response:
        return _json(service.unload_model(parse_json(types.UnloadModelRequest,
                                                     await request.body())))

    @app.post(f"{v1}/get_info")
    async def get_info(request: Request) -> Response:
        return _json(await service.get_info(parse_json(types.GetInfoRequest,
                                                       await request.body())))

    @app.post(f"{v1}/load_weights")
    async def load_weights(request: Request) -> Response:
        return _json(service.load_weights(parse_json(types.LoadWeightsRequest,
                                                     await request.body())))

    @app.post(f"{v1}/forward_backward")
    async def forward_backward(request: Request) -> Response:
        if "application/x-protobuf" not in request.headers.get("content-type", ""):
            raise WireError("content-type: forward_backward takes application/x-protobuf", 415)
        encoding = request.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity", "zstd"):
            raise WireError(f"content-encoding: unsupported {encoding[:40]!r} (use zstd)", 415)
        body = await request.body()

        def decode() -> tuple[DecodedForwardBackward | ScannedForwardBackward, bytes]:
            raw = _decompress(body, max_decompressed_bytes) if encoding == "zstd" else body
            return decode_request(raw), raw

        decoded, raw = await asyncio.to_thread(decode)
        return _json(service.forward_backward(decoded, raw))

    @app.post(f"{v1}/optim_step")
    async def optim_step(request: Request) -> Response:
        return _json(service.optim_step(parse_json(types.OptimStepRequest, await request.body())))

    @app.post(f"{v1}/save_weights")
    async def save_weights(request: Request) -> Response:
        return _json(service.save_weights(parse_json(types.SaveWeightsRequest,
                                                     await request.body())))

    @app.post(f"{v1}/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> Response:
        req = parse_json(types.SaveWeightsForSamplerRequest, await request.body())
        return _json(service.save_weights_for_sampler(req))

    @app.post(f"{v1}/weights_info")
    async def weights_info(request: Request) -> Response:
        req = parse_json(WeightsInfoRequest, await request.body())
        return _json(service.checkpoints.weights_info(req.tinker_path))

    # -- sampling --------------------------------------------------------------------------------

    @app.post(f"{v1}/create_sampling_session")
    async def create_sampling_session(request: Request) -> Response:
        req = parse_json(types.CreateSamplingSessionRequest, await request.body())
        return _json(await service.create_sampling_session(req))

    @app.get(f"{v1}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str) -> Response:
        return _json(await service.get_sampler(sampler_id))

    async def asample_body(body: bytes) -> Response:
        return _json(await service.asample(parse_sample_request(body), body))

    @app.post(f"{v1}/asample")
    async def asample(request: Request) -> Response:
        return await asample_body(await request.body())

    # -- futures ---------------------------------------------------------------------------------

    async def retrieve_body(body: bytes) -> Response:
        req = parse_json(types.FutureRetrieveRequest, body)
        outcome = await service.retrieve(req)
        if outcome is None:
            return JSONResponse(try_again_body(req.request_id), 408)
        return Response(outcome.body, 200, media_type=outcome.content_type)

    @app.post(f"{v1}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        return await retrieve_body(await request.body())

    @app.post(f"{v1}/cancel_future")
    async def cancel_future(request: Request) -> Response:
        req = parse_json(CancelFutureRequest, await request.body())
        service.store.cancel(req.request_id)
        return _json(None)

    # -- training runs and checkpoints -----------------------------------------------------------

    @app.get(f"{v1}/training_runs")
    async def training_runs(request: Request) -> Response:
        limit = _int_param(request, "limit", 20, 1000)
        offset = _int_param(request, "offset", 0, 1 << 30)
        run_ids = sorted({*service.checkpoints.run_ids(), *(
            s.backend.run_id for s in service.registry.models.values() if s.backend is not None
        )})
        page = run_ids[offset:offset + limit]
        runs = []
        for run_id in page:
            with contextlib.suppress(WireError):  # a run whose checkpoints were all deleted
                runs.append(service.checkpoints.training_run(
                    run_id, service.registry.slot_of_run(run_id)))
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(run_ids))
        return _json(types.TrainingRunsResponse(training_runs=runs, cursor=cursor))

    @app.get(f"{v1}/training_runs/{{run_id}}")
    async def training_run(run_id: str) -> Response:
        run_id = service.registry.run_id_of(check_run_id(run_id, "training_run_id"))
        slot = service.registry.slot_of_run(run_id)
        return _json(service.checkpoints.training_run(run_id, slot))

    @app.get(f"{v1}/training_runs/{{run_id}}/checkpoints")
    async def run_checkpoints(run_id: str) -> Response:
        run_id = service.registry.run_id_of(check_run_id(run_id, "training_run_id"))
        checkpoints = service.checkpoints.checkpoints(run_id)
        if not checkpoints and service.registry.slot_of_run(run_id) is None:
            # As `training_runs/{id}`: a run neither live nor saved is unknown, not empty.
            raise WireError(f"training_run_id: unknown training run {run_id!r}", 404)
        return _json(types.CheckpointsListResponse(checkpoints=checkpoints))

    @app.delete(f"{v1}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str) -> Response:
        run_id = service.registry.run_id_of(check_run_id(run_id, "training_run_id"))
        kind, name = check_checkpoint_id(checkpoint_id, "checkpoint_id")
        service.checkpoints.delete(run_id, kind, name)
        return _json(None)

    @app.get(f"{v1}/checkpoints")
    async def all_checkpoints(request: Request) -> Response:
        limit = _int_param(request, "limit", 100, 10000)
        offset = _int_param(request, "offset", 0, 1 << 30)
        store = service.checkpoints
        every = [c for r in store.run_ids() for c in store.checkpoints(r)]
        cursor = types.Cursor(offset=offset, limit=limit, total_count=len(every))
        return _json(types.CheckpointsListResponse(checkpoints=every[offset:offset + limit],
                                                   cursor=cursor))

    hot = {f"{v1}/asample": asample_body, f"{v1}/retrieve_future": retrieve_body}
    return HotRoutes(app, hot, error_response)
