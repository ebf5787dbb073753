"""The Tinker verbs behind the routes: wire requests in, local-backend calls out.

Each handler receives an already-validated SDK request type, checks what the local backend cannot
honour (answered 400 naming the field), and either answers at once (sessions, info, samplers) or
returns an `UntypedAPIFuture` whose result `/retrieve_future` serves later.

Protocol facts this module relies on (tinker 0.38):
- `create_model` and create-via-`load_weights` (`session_id` + `model_seq_id`, no `model_id`)
  make a training model; the SDK then calls `get_info` for it and uses the model id it derived,
  `"{session}:train:{model_seq_id}"`. Its later requests carry seq_id 1, 2, ...
- `save_weights_for_sampler` without `path` is the ephemeral save behind
  `save_weights_and_get_sampling_client(kind=...)`: it carries `sampling_session_seq_id` and its
  result is `SaveWeightsForSamplerResponseInternal{sampling_session_id}`; with `path` it is a
  named save whose result has the `tinker://` path.
- `asample` must be acknowledged with `sample_sequence_ids` (one per sample); the SDK overwrites
  the sequences' ids with them. Ours are `make_sequence_id(<sampler id>, <version>, seq_id * 1024
  + i)`. A fixed-weights sampler (snapshot, checkpoint path, base model) is acknowledged as soon
  as the sample is submitted, with its version at creation, which is exact (checked again on the
  result); the SDK's `/retrieve_future` long poll then runs while the sample does and returns
  the moment it is ready. An `inflight` sampler's ack waits up to `sample_ack_wait_s` for the
  result so its ids carry the version the sample ran on (else the version at creation, a lower
  bound).
- `compute_logprobs` is an `asample` with `prompt_logprobs` and optional
  `prompt_logprobs_last_n`; the last-n cut is applied here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pydantic
from tinker import types

from oneloop.backends.megatron_local.sampling_client import STABILITY_INFO_REFUSAL
from oneloop.backends.megatron_local.serve.codec.fast_scan import ScannedForwardBackward
from oneloop.backends.megatron_local.serve.codec.forward_backward_encoder import (
    encode_forward_backward_output,
)
from oneloop.backends.megatron_local.serve.codec.reference import DecodedForwardBackward
from oneloop.backends.megatron_local.serve.codec.sample_encoder import encode_sample_response
from oneloop.backends.megatron_local.serve.codec.sample_versions import (
    check_fixed_version,
    sampled_versions,
)
from oneloop.backends.megatron_local.serve.lifecycle import LifecycleLimits, TrainerReleaser
from oneloop.backends.megatron_local.serve.request_store import (
    FutureStore,
    Job,
    ModelSequencer,
    Outcome,
    SeenIds,
    await_backend,
    digest,
)
from oneloop.backends.megatron_local.serve.state import (
    CheckpointStore,
    ModelSlot,
    Registry,
    SamplerSlot,
)
from oneloop.backends.megatron_local.serve.wire import (
    failed_future_body,
    sampling_session_id,
    session_of,
    training_model_id,
)
from oneloop.backends.sequence_ids import make_sequence_id
from oneloop.errors import CheckpointNotFoundError, RequestError, WireError

logger = logging.getLogger(__name__)
PROTO = "application/x-protobuf"
MAX_SAMPLES_PER_REQUEST = 1024
INLINE_SUBMIT_BUDGET_S = 0.1
"""Longest a sample submit on the event loop may take (a non-blocking one takes 0.2-2 ms on a
loaded 2-core machine; 100 ms stalls every open request). `INLINE_SUBMIT_STRIKES` overruns move
that sampler's submits to a worker thread for good: more than one, as a thread preempted on a
busy machine overruns without the submit having waited on anything."""
INLINE_SUBMIT_STRIKES = 3


@dataclass(frozen=True)
class Limits:
    """Timeouts (seconds) of the service's awaits."""

    submit_timeout_s: float
    result_timeout_s: float
    long_poll_s: float
    sample_ack_wait_s: float


def json_outcome(model: pydantic.BaseModel) -> Outcome:
    return Outcome(model.model_dump_json(exclude_none=True).encode(), "application/json")


def backend_error(error: Exception) -> WireError:
    """A backend exception raised while answering synchronously, as the HTTP error it means."""
    if isinstance(error, WireError):
        return error
    if isinstance(error, CheckpointNotFoundError):
        return WireError(str(error), 404)
    if isinstance(error, RequestError | ValueError):
        return WireError(f"{type(error).__name__}: {error}")
    return WireError(f"backend error: {type(error).__name__}: {error}", 500)


def _settle(target: asyncio.Future[Any], source: asyncio.Future[Any] | Any) -> None:
    if target.done():
        return
    if source.cancelled():
        target.set_exception(RuntimeError("cancelled"))
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


def _quiet(future: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """Mark a future's exception as observed (it is reported through the request instead)."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


class ServeService:
    """State and handlers of one `oneloop serve` process; use from its event loop only."""

    def __init__(self, backend: Any, limits: Limits, *, result_ttl_s: float = 3600.0,
                 lifecycle: LifecycleLimits | None = None) -> None:
        self.backend = backend
        self.limits = limits
        self.store = FutureStore(
            result_ttl_s=result_ttl_s,
            failure_body=lambda m, c: json.dumps(failed_future_body(m, c)).encode(),
        )
        self.registry = Registry()
        self.trainers = TrainerReleaser(backend, self.registry, lifecycle or LifecycleLimits(),
                                        pending=self.store.pending)
        self.checkpoints = CheckpointStore(backend.run_dir)
        self.internal_errors = 0
        """Requests answered 500 (a bug: the SDK retries 5xx silently, so tests check this)."""

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a backend method off the event loop and await what it returns."""
        async with asyncio.timeout(self.limits.submit_timeout_s):
            submitted = await asyncio.to_thread(fn, *args, **kwargs)
        return await await_backend(submitted, self.limits.result_timeout_s)

    # -- sessions --------------------------------------------------------------------------------

    def create_session(self, req: types.CreateSessionRequest) -> types.CreateSessionResponse:
        session_id = self.registry.new_session(req.sdk_version, req.user_metadata or {}, req.tags)
        return types.CreateSessionResponse(session_id=session_id)

    def heartbeat(self, req: types.SessionHeartbeatRequest) -> types.SessionHeartbeatResponse:
        session = self.registry.sessions.get(req.session_id)
        if session is None:
            raise WireError(f"session_id: unknown session {req.session_id!r}", 404)
        if session.finished is not None:
            raise WireError(f"session_id: session {req.session_id} is finished", 410)
        session.last_heartbeat = time.monotonic()
        return types.SessionHeartbeatResponse()

    def finish(self, session_id: str, reason: str, detail: str | None) -> None:
        session = self.registry.sessions.get(session_id)
        if session is None:
            raise WireError(f"session_id: unknown session {session_id!r}", 404)
        if session.finished is None:  # first reason wins
            session.finished, session.detail = reason, detail
        self.trainers.release_session(session_id, f"session {session_id} finished")

    # -- training models -------------------------------------------------------------------------

    def _new_model(
        self, model_id: str, session_id: str, request: pydantic.BaseModel, request_type: str,
        create: Callable[[], Any], encode: Callable[[Any], Outcome], user_metadata: Any,
        base_model: str | None,
    ) -> types.UntypedAPIFuture:
        payload = digest(request.model_dump_json())
        existing = self.registry.models.get(model_id)
        if existing is not None:
            if existing.creation_digest != payload:
                raise WireError(f"model_seq_id: model {model_id} already exists", 409, retry=False)
            return types.UntypedAPIFuture(
                request_id=existing.creation_request_id, model_id=model_id
            )
        self.trainers.check_capacity(request_type)
        request_id = self.store.new(request_type)
        client: asyncio.Future[Any] = _quiet(asyncio.get_running_loop().create_future())
        sequencer = ModelSequencer(
            model_id, self.store, client,
            submit_timeout_s=self.limits.submit_timeout_s,
            result_timeout_s=self.limits.result_timeout_s,
        )
        slot = ModelSlot(
            model_id, session_id, payload, request_id, client, sequencer, base_model, user_metadata
        )
        self.registry.models[model_id] = slot
        # The idle clock (`trainer_idle_s`) starts when the trainer is ready, not while it starts.
        client.add_done_callback(lambda _: setattr(slot, "last_request", time.time()))
        work = _quiet(asyncio.ensure_future(self._call(create)))
        work.add_done_callback(lambda done: _settle(client, done))
        self.store.start(request_id, work, encode)
        return types.UntypedAPIFuture(request_id=request_id, model_id=model_id)

    def create_model(self, req: types.CreateModelRequest) -> types.UntypedAPIFuture:
        self.registry.session(req.session_id)
        if req.model_seq_id < 0:
            raise WireError("model_seq_id: must be >= 0")
        if not isinstance(req.optimizer_config, types.AdamOptimizerConfig):
            raise WireError("optimizer_config.type: the local backend implements adamw only")
        lora = req.lora_config
        if lora is not None and lora.rank < 1:
            raise WireError(f"lora_config.rank: must be >= 1, got {lora.rank}")
        if lora is not None and not (lora.train_mlp or lora.train_attn or lora.train_unembed):
            raise WireError("lora_config: one of train_mlp, train_attn, train_unembed must be true")
        model_id = training_model_id(req.session_id, req.model_seq_id)
        lora = lora or types.LoraConfig(rank=0)  # no LoRA config: full fine-tuning (rank 0)

        def create() -> Any:
            return self.backend.create_lora_training_client(
                req.base_model, rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp,
                train_attn=lora.train_attn, train_unembed=lora.train_unembed,
                user_metadata=req.user_metadata, optimizer=req.optimizer_config,
            )

        return self._new_model(
            model_id, req.session_id, req, "CreateModel", create,
            lambda _: json_outcome(types.CreateModelResponse(model_id=model_id)),
            req.user_metadata, req.base_model,
        )

    def load_weights(self, req: types.LoadWeightsRequest) -> types.UntypedAPIFuture:
        path = self.checkpoints.parse(req.path, "path")
        if path.kind != "weights":
            raise WireError(f"path: {req.path} is a sampler checkpoint; load needs .../weights/...")
        if req.optimizer and req.optimizer_config is not None:
            raise WireError("optimizer_config: cannot be combined with optimizer=true")
        if req.optimizer_config is not None and not isinstance(
            req.optimizer_config, types.AdamOptimizerConfig
        ):
            raise WireError("optimizer_config.type: the local backend implements adamw only")
        if req.session_id is None:  # legacy addressing: load onto an existing model
            if req.model_id is None or req.seq_id is None:
                raise WireError("model_id, seq_id: required unless session_id is set")
            load = "load_state_with_optimizer" if req.optimizer else "load_state"
            model_id = req.model_id
            return self._ordered(
                model_id, req.seq_id, "LoadWeights", req.model_dump_json(),
                lambda client: getattr(client, load)(req.path),
                lambda _: json_outcome(types.LoadWeightsResponse(path=req.path, model_id=model_id)),
            )
        if req.model_id is not None or req.seq_id is not None or req.model_seq_id is None:
            raise WireError("model_seq_id: required with session_id (and model_id, seq_id unset)")
        self.registry.session(req.session_id)
        model_id = training_model_id(req.session_id, req.model_seq_id)
        make = (
            self.backend.create_training_client_from_state_with_optimizer
            if req.optimizer
            else self.backend.create_training_client_from_state
        )
        return self._new_model(
            model_id, req.session_id, req, "LoadWeights", lambda: make(req.path),
            lambda _: json_outcome(types.LoadWeightsResponse(path=req.path, model_id=model_id)),
            req.user_metadata, req.base_model,
        )

    async def get_info(self, req: types.GetInfoRequest) -> types.GetInfoResponse:
        slot = self.registry.model(req.model_id)
        try:
            async with asyncio.timeout(self.limits.result_timeout_s):
                client = await asyncio.shield(slot.client)
        except TimeoutError as e:
            raise WireError(f"model_id: model {req.model_id} is still being created", 503) from e
        except Exception as e:
            raise WireError(f"model_id: model {req.model_id} could not be created: {e}") from e
        info = client.get_info()
        return info.model_copy(update={"model_id": req.model_id})

    def _ordered(
        self, model_id: str, seq_id: int | None, request_type: str, payload: bytes | str,
        submit: Callable[[Any], Any], encode: Callable[[Any], Outcome],
        on_admit: Callable[[], None] | None = None,
    ) -> types.UntypedAPIFuture:
        """Admit one ordered request of `model_id` (see `ModelSequencer`)."""
        if seq_id is None or seq_id < 1:
            raise WireError(f"seq_id: required and >= 1 for {request_type}, got {seq_id}")
        slot = self.registry.model(model_id)

        def make_job(request_id: str) -> Job:
            if on_admit is not None:
                on_admit()
            return Job(request_id, submit, encode)

        request_id = slot.sequencer.offer(seq_id, digest(payload), request_type, make_job)
        slot.requests.append(request_id)  # a model with one running is not idle
        return types.UntypedAPIFuture(request_id=request_id, model_id=model_id)

    def forward_backward(self, req: DecodedForwardBackward | ScannedForwardBackward,
                         raw: bytes) -> types.UntypedAPIFuture:
        def encode(out: types.ForwardBackwardOutput) -> Outcome:
            return Outcome(encode_forward_backward_output(out), PROTO)

        return self._ordered(
            req.model_id, req.seq_id, "Forward" if req.forward_only else "ForwardBackward", raw,
            req.submit, encode,
        )

    def optim_step(self, req: types.OptimStepRequest) -> types.UntypedAPIFuture:
        params = req.optim_params
        if not isinstance(params, types.AdamParams):
            raise WireError("optimizer_params: the local backend implements adamw only")
        for name, value in params.model_dump().items():
            if not np.isfinite(value) or value < 0:
                raise WireError(f"adam_params.{name}: must be a finite number >= 0, got {value}")
        return self._ordered(
            req.model_id, req.seq_id, "OptimStep", req.model_dump_json(),
            lambda client: client.optim_step(params), json_outcome,
        )

    def save_weights(self, req: types.SaveWeightsRequest) -> types.UntypedAPIFuture:
        if req.path is None:
            raise WireError("path: a checkpoint name is required")
        self._check_name(req.path)
        return self._ordered(
            req.model_id, req.seq_id, "SaveWeights", req.model_dump_json(),
            lambda client: client.save_state(req.path, req.ttl_seconds, req.overwrite,
                                             req.user_metadata),
            json_outcome,
        )

    def _check_name(self, name: str) -> None:
        self.checkpoints.parse(f"tinker://run/weights/{name}", "path")

    def save_weights_for_sampler(
        self, req: types.SaveWeightsForSamplerRequest
    ) -> types.UntypedAPIFuture:
        if req.path is not None:
            self._check_name(req.path)
            return self._ordered(
                req.model_id, req.seq_id, "SaveWeightsForSampler", req.model_dump_json(),
                lambda client: client.save_weights_for_sampler(req.path, req.ttl_seconds,
                                                               req.user_metadata),
                lambda r: json_outcome(types.SaveWeightsForSamplerResponseInternal(path=r.path)),
            )
        if req.sampling_session_seq_id is None:
            raise WireError("path, sampling_session_seq_id: one of them is required")
        session_id = session_of(req.model_id)
        sampler_id = sampling_session_id(session_id, req.sampling_session_seq_id)
        loop = asyncio.get_running_loop()
        client: asyncio.Future[Any] = _quiet(loop.create_future())
        payload = digest(req.model_dump_json())
        if sampler_id in self.registry.samplers and (
            self.registry.samplers[sampler_id].creation_digest != payload
        ):
            raise WireError(f"sampling_session_seq_id: {sampler_id} already exists", 409,
                            retry=False)

        def admit() -> None:
            self.registry.samplers[sampler_id] = SamplerSlot(
                sampler_id, session_id, payload, client, None, None, SeenIds(sampler_id),
                fixed_weights=req.kind != "inflight",
            )

        def submit(training_client: Any) -> Any:
            try:
                future = training_client.save_weights_and_get_sampling_client(kind=req.kind)
            except Exception as e:
                error = e
                loop.call_soon_threadsafe(lambda: client.done() or client.set_exception(error))
                raise
            future.future().add_done_callback(
                lambda f: loop.call_soon_threadsafe(_settle, client, f)
            )
            return future

        return self._ordered(
            req.model_id, req.seq_id, "SaveWeightsForSampler", req.model_dump_json(), submit,
            lambda _: json_outcome(
                types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id)
            ),
            on_admit=admit,
        )

    # -- sampling --------------------------------------------------------------------------------

    async def create_sampling_session(
        self, req: types.CreateSamplingSessionRequest
    ) -> types.CreateSamplingSessionResponse:
        self.registry.session(req.session_id)
        if req.model_path is None and req.base_model is None:
            raise WireError("model_path, base_model: one of them is required")
        if req.model_path is not None:
            path = self.checkpoints.parse(req.model_path, "model_path")
            if path.kind != "sampler_weights":
                raise WireError("model_path: sample from a sampler checkpoint "
                                "(tinker://<run>/sampler_weights/<name>)")
        sampler_id = sampling_session_id(req.session_id, req.sampling_session_seq_id)
        payload = digest(req.model_dump_json())
        slot = self.registry.samplers.get(sampler_id)
        if slot is not None and slot.creation_digest != payload:
            raise WireError(f"sampling_session_seq_id: {sampler_id} already exists", 409,
                            retry=False)
        if slot is None:
            client = _quiet(asyncio.ensure_future(self._call(
                self.backend.create_sampling_client, model_path=req.model_path,
                base_model=req.base_model,
            )))
            slot = SamplerSlot(sampler_id, req.session_id, payload, client, req.base_model,
                               req.model_path, SeenIds(sampler_id))
            self.registry.samplers[sampler_id] = slot
        try:
            await self._sampling_client(slot)
        except WireError:
            self.registry.samplers.pop(sampler_id, None)  # a retry may create it afresh
            raise
        return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)

    async def _sampling_client(self, slot: SamplerSlot) -> Any:
        if slot.client.done() and not slot.client.cancelled() and not slot.client.exception():
            return slot.client.result()  # the common case: no shield, no timer
        try:
            async with asyncio.timeout(self.limits.result_timeout_s):
                return await asyncio.shield(slot.client)
        except Exception as e:
            raise backend_error(e) from e

    async def get_sampler(self, sampler_id: str) -> types.GetSamplerResponse:
        slot = self.registry.sampler(sampler_id)
        client = await self._sampling_client(slot)
        return types.GetSamplerResponse(
            sampler_id=sampler_id,
            base_model=str(getattr(client, "base_model", slot.base_model)),
            model_path=slot.model_path or getattr(client, "model_path", None),
        )

    async def asample(self, req: types.SampleRequest, body: bytes) -> types.UntypedAPIFuture:
        """Admit a sample request; `body` is its JSON as sent (its digest tells an SDK retry,
        which resends the same bytes, from a different request reusing the seq_id)."""
        if req.sampling_session_id is None or req.seq_id is None:
            raise WireError("sampling_session_id, seq_id: required (sample through a sampling "
                            "session from create_sampling_session)")
        if req.record_stability_info:
            raise WireError(STABILITY_INFO_REFUSAL)
        for name in ("topk_sample_logprobs", "prompt_alt_tokens_k", "target_prompt_logprobs",
                     "topk_prompt_logprobs"):
            if getattr(req, name):
                raise WireError(f"{name}: not supported by the local backend's samplers")
        if not 1 <= req.num_samples <= MAX_SAMPLES_PER_REQUEST:
            raise WireError(f"num_samples: must be in [1, {MAX_SAMPLES_PER_REQUEST}]")
        if not all(isinstance(c, types.EncodedTextChunk) for c in req.prompt.chunks):
            raise WireError("prompt: only token (encoded_text) chunks are supported")
        prompt_len = req.prompt.length
        last_n = req.prompt_logprobs_last_n
        if last_n is not None and (not req.prompt_logprobs or not 1 <= last_n <= prompt_len - 1):
            raise WireError("prompt_logprobs_last_n: needs prompt_logprobs and must be in "
                            f"[1, {prompt_len - 1}]")
        params = req.sampling_params
        slot = self.registry.sampler(req.sampling_session_id)
        self.registry.session(slot.session_id, "sampling_session_id")
        payload = digest(body)  # hashing the bytes: re-serializing cost ~1 ms per 8k tokens
        ack = slot.seen.lookup(req.seq_id, payload)
        if ack is not None:
            return await asyncio.wait_for(asyncio.shield(ack), self.limits.submit_timeout_s)
        ack = _quiet(asyncio.get_running_loop().create_future())
        slot.seen.add(req.seq_id, payload, ack)
        try:
            result = await self._submit_sample(slot, req, params, last_n)
        except BaseException as e:
            slot.seen.remove(req.seq_id)
            ack.set_exception(e if isinstance(e, Exception) else RuntimeError("cancelled"))
            raise
        ack.set_result(result)
        return result

    async def _submit_to_sampler(
        self, slot: SamplerSlot, client: Any, req: types.SampleRequest,
        params: types.SamplingParams,
    ) -> Any:
        """`client.sample(...)`: on the event loop if the client says a submit of this size never
        waits (`nonblocking_submit_max_tokens`), else in a worker thread under
        `submit_timeout_s`. `INLINE_SUBMIT_STRIKES` inline submits slower than
        `INLINE_SUBMIT_BUDGET_S` (the contract broken) send the sampler's later submits to the
        thread."""
        def submit() -> Any:
            return client.sample(req.prompt, req.num_samples, params,
                                 include_prompt_logprobs=bool(req.prompt_logprobs))

        if slot.inline_overruns < INLINE_SUBMIT_STRIKES and req.prompt.length <= getattr(
            client, "nonblocking_submit_max_tokens", 0
        ):
            start = time.perf_counter()
            try:
                return submit()
            finally:
                took = time.perf_counter() - start
                if took > INLINE_SUBMIT_BUDGET_S:
                    slot.inline_overruns += 1
                    logger.warning("sampler %s: a submit on the event loop took %.0f ms (budget "
                                   "%.0f ms; %d of %d overruns before its submits move to a "
                                   "worker thread)", slot.sampler_id, took * 1e3,
                                   INLINE_SUBMIT_BUDGET_S * 1e3, slot.inline_overruns,
                                   INLINE_SUBMIT_STRIKES)
        async with asyncio.timeout(self.limits.submit_timeout_s):
            return await asyncio.to_thread(submit)

    async def _submit_sample(
        self, slot: SamplerSlot, req: types.SampleRequest, params: types.SamplingParams,
        last_n: int | None,
    ) -> types.UntypedAPIFuture:
        client = await self._sampling_client(slot)
        request_id = self.store.new("Sample")
        try:
            submitted = await self._submit_to_sampler(slot, client, req, params)
        except Exception as e:
            self.store.discard(request_id)
            raise backend_error(e) from e
        result = await_backend(submitted, self.limits.result_timeout_s)
        created_version = getattr(client, "version", 0)

        def encode(resp: types.SampleResponse) -> Outcome:
            if slot.fixed_weights:
                check_fixed_version(resp, created_version, slot.sampler_id)
            if last_n is not None and resp.prompt_logprobs is not None:
                values = list(resp.prompt_logprobs)
                cut = len(values) - last_n
                values[:cut] = [None] * cut
                resp = types.SampleResponse(sequences=resp.sequences,
                                            _prompt_logprobs_list=values)
            return Outcome(encode_sample_response(resp), PROTO)

        versions = [created_version] * req.num_samples
        if slot.fixed_weights:
            # Acked at once (the SDK's long poll then overlaps the sampling): its version is exact.
            self.store.start(request_id, result, encode)
        else:
            # An inflight sample may start on newer weights than the client's: wait (briefly) so
            # the ids carry the version it ran on. A failure here is the request's result,
            # reported through /retrieve_future like any other.
            task = asyncio.ensure_future(result)  # awaited here and by the store
            self.store.start(request_id, task, encode)
            await asyncio.wait({task}, timeout=self.limits.sample_ack_wait_s)
            if task.done() and not task.cancelled() and task.exception() is None:
                done = sampled_versions(task.result())  # the batch's one version
                versions = [v if d is None else d for v, d in zip(versions, done, strict=False)]
        base = req.seq_id * MAX_SAMPLES_PER_REQUEST
        ids = [make_sequence_id(slot.sampler_id, v, base + i) for i, v in enumerate(versions)]
        return types.UntypedAPIFuture(request_id=request_id, sample_sequence_ids=ids)

    # -- futures ---------------------------------------------------------------------------------

    async def retrieve(self, req: types.FutureRetrieveRequest) -> Outcome | None:
        return await self.store.wait(req.request_id, self.limits.long_poll_s)

    def unload_model(self, req: types.UnloadModelRequest) -> types.UntypedAPIFuture:
        """Release a model's trainer now; the result (`UnloadModelResponse`) is ready once it
        has stopped. Its later requests get a 410."""
        slot = self.registry.model(req.model_id)
        self.trainers.release(slot, f"unloaded by request ({req.model_id})")
        request_id = self.store.new("UnloadModel")
        self.store.start(request_id, asyncio.ensure_future(self.trainers.wait_released(slot)),
                         lambda _: json_outcome(types.UnloadModelResponse(model_id=req.model_id,
                                                                          type="unload_model")))
        return types.UntypedAPIFuture(request_id=request_id, model_id=req.model_id)

    def sweep(self, gap_timeout_s: float) -> None:
        self.trainers.sweep()
        self.store.sweep()
        for slot in self.registry.models.values():
            slot.sequencer.fail_stale_gaps(gap_timeout_s)

    async def close(self) -> None:
        await self.trainers.close(timeout_s=5.0)
        for slot in self.registry.models.values():
            await slot.sequencer.close()
        await self.store.close(timeout_s=5.0)
