"""Wire models of the Tinker HTTP protocol (JSON side) and their conversion at the boundary.

Request bodies are validated with the SDK's own request types wherever it has one: they are
`tinker._models.StrictBase` (pydantic, `extra="forbid"`, frozen), i.e. exactly the wire contract
of SDK 0.38, and they reject unknown keys. The few bodies the SDK posts as plain dicts
(`sessions/{id}/finish`, `weights_info`, `cancel_future`) and the one nested type the SDK leaves
lenient (`SamplingParams`, `extra="ignore"`) get strict models here. `parse_json` turns any
validation failure into a `WireError` (HTTP 400) whose message names the field.

Protocol facts (read from the SDK source, tinker 0.38):
- The SDK posts `model_dump(request, exclude_none=True, mode="json")`; every body carries a
  `type` literal. `OptimStepRequest` serialises Adam parameters under `adam_params`.
- A body status 400 with an empty body is treated by the SDK as a proxy hiccup and retried, so
  every error response here carries a JSON body `{"detail": ...}`.
- 408, 409, 429 and 5xx are retried by the SDK's HTTP layer unless the response says
  `x-should-retry: false`; a seq_id conflict (409) sets it, since a retry cannot succeed.
- Identifiers the SDK derives itself: a training model created in session `s` with
  `model_seq_id` n is `"{s}:train:{n}"`; a sampling session is `"{s}:sample:{n}"`.
- `tinker://` paths are `tinker://<training_run_id>/<weights|sampler_weights>/<name>`
  (`ParsedCheckpointTinkerPath`); checkpoint ids are `<weights|sampler_weights>/<name>`. Each
  component must pass the local backend's `checkpoints.check_component` (no separators, no `..`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from oneloop.backends.megatron_local.checkpoints import check_component
from oneloop.errors import RequestError, WireError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FinishReason(_Strict):
    type: Literal["success", "errored", "interrupted"]


class FinishSessionRequest(_Strict):
    """Body of `POST /api/v1/sessions/{id}/finish` (`ServiceClient.close`)."""

    reason: FinishReason
    detail: str | None = Field(default=None, max_length=4096)


class WeightsInfoRequest(_Strict):
    """Body of `POST /api/v1/weights_info` (`RestClient.get_weights_info_by_tinker_path`)."""

    tinker_path: str = Field(max_length=1024)


class CancelFutureRequest(_Strict):
    """Body of `POST /api/v1/cancel_future` (sent when a sampling future is abandoned)."""

    request_id: str = Field(max_length=256)


class StrictSamplingParams(_Strict):
    """`tinker.types.SamplingParams` with unknown keys rejected and ranges checked."""

    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_k: int = Field(default=-1, ge=-1)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)

    def to_tinker(self) -> types.SamplingParams:
        return types.SamplingParams(**self.model_dump())


def parse_json[M: pydantic.BaseModel](cls: type[M], body: bytes | dict[str, Any]) -> M:
    """Validate a JSON body against `cls`; a failure is a `WireError` naming the field."""
    try:
        if isinstance(body, bytes | bytearray):
            return cls.model_validate_json(body)
        return cls.model_validate(body)
    except pydantic.ValidationError as e:
        raise WireError(describe_validation_error(e)) from e
    except (ValueError, TypeError) as e:
        raise WireError(f"body: {e}") from e


def describe_validation_error(error: pydantic.ValidationError) -> str:
    """One line per problem: `field.path: message` (at most five)."""
    parts = []
    for item in error.errors()[:5]:
        loc = ".".join(str(x) for x in item.get("loc", ())) or "body"
        parts.append(f"{loc}: {item.get('msg', 'invalid')}")
    more = len(error.errors()) - 5
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def parse_sample_request(body: bytes) -> types.SampleRequest:
    """A `SampleRequest` whose `sampling_params` are checked strictly (the SDK type ignores
    unknown keys there, so they are checked on the raw JSON first)."""
    try:
        raw = json.loads(body)
    except ValueError as e:
        raise WireError(f"body: not JSON ({e})") from e
    if not isinstance(raw, dict):
        raise WireError("body: must be a JSON object")
    params = raw.get("sampling_params")
    strict = None
    if isinstance(params, dict):
        try:
            strict = StrictSamplingParams.model_validate(params)
        except pydantic.ValidationError as e:
            raise WireError("sampling_params." + describe_validation_error(e)) from e
    req = parse_json(types.SampleRequest, raw)
    if strict is None:
        return req
    return req.model_copy(update={"sampling_params": strict.to_tinker()})


CHECKPOINT_KINDS = ("weights", "sampler_weights")


def _component(value: str, field: str) -> str:
    try:
        return check_component(value, field)
    except RequestError as e:
        raise WireError(f"{field}: {e}") from e


def check_run_id(run_id: str, field: str) -> str:
    """A training run id (or wire model id) that is one safe path component."""
    return _component(run_id, field)


def check_checkpoint_id(checkpoint_id: str, field: str) -> tuple[str, str]:
    """`weights/<name>` or `sampler_weights/<name>` -> (kind segment, name)."""
    kind, _, name = checkpoint_id.partition("/")
    if kind not in CHECKPOINT_KINDS:
        raise WireError(f"{field}: must be weights/<name> or sampler_weights/<name>")
    return kind, _component(name, field)


def training_model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id(session_id: str, seq_id: int) -> str:
    return f"{session_id}:sample:{seq_id}"


def session_of(model_or_sampler_id: str) -> str:
    """The session id a `{session}:train:{n}` / `{session}:sample:{n}` id belongs to."""
    return model_or_sampler_id.rsplit(":", 2)[0]


def error_body(message: str) -> dict[str, str]:
    return {"detail": message}


def failed_future_body(message: str, category: types.RequestErrorCategory) -> dict[str, str]:
    """The JSON `/retrieve_future` returns for a failed request (`RequestFailedResponse`)."""
    return types.RequestFailedResponse(error=message, category=category).model_dump(mode="json")


def try_again_body(request_id: str) -> dict[str, str]:
    """The JSON of a 408 from `/retrieve_future` while the request is still running."""
    return TryAgainResponse(request_id=request_id, queue_state="active").model_dump(mode="json")


def client_config(*, compress_fwdbwd: bool, use_pyqwest: bool) -> types.ClientConfigResponse:
    """Feature flags for the SDK: API-key auth, our chunking limits, no server-side extras."""
    return types.ClientConfigResponse(
        pjwt_auth_enabled=False,
        credential_default_source="api_key",
        parallel_fwdbwd_chunks=True,
        proto_compress_fwdbwd=compress_fwdbwd,
        sample_use_retrieve_futures=False,
        custom_loss_server_side=False,
        sample_join_sampling_session=False,
        use_pyqwest_transport=use_pyqwest,
    )
