"""Wire models of the gateway: OpenAI request bodies, validated, and OpenAI-shaped errors.

This module owns what crosses the HTTP edge: `ChatRequest` and `CompletionRequest` (pydantic,
unknown keys rejected, each field checked), `parse_body` (bytes → a request model, or a
`GatewayHttpError` whose OpenAI-shaped body names the offending field, `param`), and the error
type itself. A field OpenAI defines but the gateway cannot honour (`frequency_penalty` other
than 0, a `tool_choice` naming a function, ...) is a 400 naming it, never silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from oneloop.errors import OneloopError

MAX_STOP_STRINGS = 4  # OpenAI's own limit on `stop`
MAX_N = 16  # completions per request


class GatewayHttpError(OneloopError):
    """A request the gateway answers with an OpenAI-shaped error body and `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class _Echoed(BaseModel):
    """Parts of a message a client echoes back: extra keys it adds are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class ToolCallFunction(_Echoed):
    name: str = Field(min_length=1)
    arguments: str  # a JSON object, as text (OpenAI's form)


class ToolCallIn(_Echoed):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message. Extra keys OpenAI clients echo back (`refusal`, `annotations`,
    `audio`, `function_call` as null) are accepted and ignored: they carry no tokens."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    return_token_ids: bool = False
    """vLLM's extension: each choice also carries `token_ids` (the sampled ids)."""

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalties(cls, value: float | None) -> float | None:
        if value not in (None, 0, 0.0):
            raise ValueError("the gateway samples without penalties; send 0 or leave it out")
        return value


class ChatRequest(_SamplingFields):
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if isinstance(value, dict):
            raise ValueError(
                'forcing a named function is not supported; use "auto" or "none"'
            )
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=0)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _ids(cls, value: str | list[int]) -> str | list[int]:
        if isinstance(value, list) and any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


def parse_body[M: BaseModel](raw: bytes, model: type[M]) -> M:
    """`raw` (a JSON object) as `model`; a 400 naming the first bad field otherwise."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GatewayHttpError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise GatewayHttpError(400, f"request body: expected a JSON object, got {kind}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        raise GatewayHttpError(
            400, f"{param or 'body'}: {first['msg']}", param=param, code="invalid_value"
        ) from None
