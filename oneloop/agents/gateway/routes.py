"""HTTP routes of the gateway: OpenAI's chat and completions endpoints, per session.

This module owns the FastAPI app (`make_app`): `POST /v1/chat/completions` and
`POST /v1/completions` (session from the `X-Oneloop-Session` header, else `default`), the same
under `/s/{session}/v1/...` (the per-session base URL the trial runner hands an agent),
`GET .../v1/models`, `GET|DELETE /sessions/{id}` (a session's TITO segments and counters; DELETE
closes it) and `GET /health`. Bodies are parsed by `wire.parse_body`; every error is OpenAI's
shape (`{"error": {"message", "type", "param", "code"}}`), 4xx for the client's mistakes. Replies
are sampled once, then sent whole or as server-sent-event chunks (`stream: true`), so streamed
and whole answers carry the same tokens.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from oneloop.agents.gateway.sessions import Sampled, Session, SessionStore
from oneloop.agents.gateway.wire import ChatRequest, CompletionRequest, GatewayHttpError, parse_body
from oneloop.agents.renderer import RendererError
from oneloop.agents.tito import TitoError

SESSION_HEADER = "x-oneloop-session"
DEFAULT_SESSION = "default"
SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
STREAM_CHARS = 32  # characters of content per streamed chunk


def _error(exc: GatewayHttpError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _session_id(request: Request, session: str | None) -> str:
    value = session or request.headers.get(SESSION_HEADER) or DEFAULT_SESSION
    if not SESSION_ID.match(value):
        raise GatewayHttpError(
            400, f"session: {value[:64]!r} is not a session id ([A-Za-z0-9_.:-], 1-128 chars)",
            param="session",
        )  # fmt: skip
    return value


def make_app(store: SessionStore, *, model_name: str, max_body_bytes: int) -> FastAPI:
    """The gateway's ASGI app over `store`."""
    app = FastAPI(title="oneloop gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(GatewayHttpError)
    async def gateway_error(_: Request, exc: GatewayHttpError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(GatewayHttpError(exc.status_code, str(exc.detail), kind=kind))

    async def body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise GatewayHttpError(413, f"request body over {max_body_bytes} bytes")
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise GatewayHttpError(413, f"request body over {max_body_bytes} bytes")
        return raw

    def check_model(name: str) -> None:
        if name not in (model_name, f"openai/{model_name}"):
            raise GatewayHttpError(
                404, f"model: {name!r} is not served here; this gateway serves {model_name!r}",
                param="model", kind="not_found_error", code="model_not_found",
            )  # fmt: skip

    async def chat(request: Request, session: str | None) -> Response:
        parsed = parse_body(await body(request), ChatRequest)
        check_model(parsed.model)
        state = store.get(_session_id(request, session))
        async with state.lock:
            try:
                base, continued = state.plan_chat(parsed)
            except (RendererError, TemplateError, TitoError) as exc:
                raise GatewayHttpError(400, f"messages: {exc}", param="messages") from None
            tools = bool(parsed.tools) and parsed.tool_choice != "none"
            sampled = await state.sample(parsed, base, continued, tools_offered=tools)
        payload = _chat_payload(parsed, sampled, state, model_name)
        if parsed.stream:
            return _sse(_chat_chunks(payload, parsed))
        return JSONResponse(payload)

    async def completions(request: Request, session: str | None) -> Response:
        parsed = parse_body(await body(request), CompletionRequest)
        check_model(parsed.model)
        state = store.get(_session_id(request, session))
        async with state.lock:
            try:
                base, continued = state.plan_completion(parsed)
            except (RendererError, TitoError) as exc:
                raise GatewayHttpError(400, f"prompt: {exc}", param="prompt") from None
            sampled = await state.sample(parsed, base, continued, tools_offered=False)
        payload = _completion_payload(parsed, sampled, model_name)
        if parsed.stream:
            return _sse(_completion_chunks(payload, parsed))
        return JSONResponse(payload)

    def models() -> dict[str, Any]:
        entry = {"id": model_name, "object": "model", "created": 0, "owned_by": "oneloop"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    async def chat_default(request: Request) -> Response:
        return await chat(request, None)

    @app.post("/s/{session}/v1/chat/completions")
    async def chat_session(request: Request, session: str) -> Response:
        return await chat(request, session)

    @app.post("/v1/completions")
    async def completions_default(request: Request) -> Response:
        return await completions(request, None)

    @app.post("/s/{session}/v1/completions")
    async def completions_session(request: Request, session: str) -> Response:
        return await completions(request, session)

    @app.get("/v1/models")
    async def models_default() -> dict[str, Any]:
        return models()

    @app.get("/s/{session}/v1/models")
    async def models_session(session: str) -> dict[str, Any]:
        return models()

    def describe(state: Session) -> dict[str, Any]:
        return {
            "session": state.session_id,
            "counters": state.counters(),
            "segments": [t.to_json() for t in state.trajectories()],
        }

    @app.get("/sessions/{session}")
    async def show(session: str) -> dict[str, Any]:
        state = store.sessions.get(session)
        if state is None:
            raise GatewayHttpError(404, f"session {session!r} is not live", param="session")
        return describe(state)

    @app.delete("/sessions/{session}")
    async def close(session: str) -> dict[str, Any]:
        state = store.close(session)
        if state is None:
            raise GatewayHttpError(404, f"session {session!r} is not live", param="session")
        return describe(state)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "sessions": len(store.sessions), **store.counts}

    return app


def _usage(sampled: Sampled) -> dict[str, int]:
    completion = sum(len(c.trajectory.segments[-1].tokens) for c in sampled.choices)
    return {
        "prompt_tokens": sampled.prompt_length,
        "completion_tokens": completion,
        "total_tokens": sampled.prompt_length + completion,
    }


def _logprobs(state: Session, tokens: tuple[int, ...], logprobs: tuple[float, ...]) -> dict:
    renderer = state.renderer
    content = []
    for token, logprob in zip(tokens, logprobs, strict=True):
        text = renderer.decode([token])
        content.append({"token": text, "logprob": logprob,
                        "bytes": list(text.encode()), "top_logprobs": []})  # fmt: skip
    return {"content": content}


def _chat_payload(
    request: ChatRequest, sampled: Sampled, state: Session, model_name: str
) -> dict[str, Any]:
    choices = []
    for index, choice in enumerate(sampled.choices):
        segment = choice.trajectory.segments[-1]
        item: dict[str, Any] = {
            "index": index,
            "message": choice.reply.message,
            "finish_reason": choice.reply.finish_reason,
            "logprobs": (
                _logprobs(state, segment.tokens, segment.logprobs or ())
                if request.logprobs else None
            ),
        }
        if request.return_token_ids:
            item["token_ids"] = list(segment.tokens)
        choices.append(item)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": _usage(sampled),
    }


def _completion_payload(
    request: CompletionRequest, sampled: Sampled, model_name: str
) -> dict[str, Any]:
    choices = []
    for index, choice in enumerate(sampled.choices):
        item: dict[str, Any] = {
            "index": index,
            "text": choice.reply.text,
            "finish_reason": choice.reply.finish_reason,
            "logprobs": None,
        }
        if request.return_token_ids:
            item["token_ids"] = list(choice.trajectory.segments[-1].tokens)
        choices.append(item)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": _usage(sampled),
    }


def _pieces(text: str) -> list[str]:
    return [text[i : i + STREAM_CHARS] for i in range(0, len(text), STREAM_CHARS)]


def _chat_chunks(payload: dict[str, Any], request: ChatRequest) -> Iterator[dict[str, Any]]:
    head = {k: payload[k] for k in ("id", "created", "model")} | {
        "object": "chat.completion.chunk"
    }
    for choice in payload["choices"]:
        index, message = choice["index"], choice["message"]

        def chunk(
            delta: dict[str, Any], finish: str | None = None, index: int = index, **extra: Any
        ) -> dict:
            entry = {"index": index, "delta": delta, "finish_reason": finish, **extra}
            return head | {"choices": [entry]}

        yield chunk({"role": "assistant", "content": ""})
        for piece in _pieces(message.get("content") or ""):
            yield chunk({"content": piece})
        if message.get("reasoning_content"):
            yield chunk({"reasoning_content": message["reasoning_content"]})
        for j, call in enumerate(message.get("tool_calls") or ()):
            yield chunk({"tool_calls": [{"index": j, **call}]})
        extra = {"logprobs": choice["logprobs"]} if choice["logprobs"] else {}
        if "token_ids" in choice:
            extra["token_ids"] = choice["token_ids"]
        yield chunk({}, choice["finish_reason"], **extra)
    if request.stream_options is not None and request.stream_options.include_usage:
        yield head | {"choices": [], "usage": payload["usage"]}


def _completion_chunks(
    payload: dict[str, Any], request: CompletionRequest
) -> Iterator[dict[str, Any]]:
    head = {k: payload[k] for k in ("id", "created", "model", "object")}
    for choice in payload["choices"]:
        for piece in _pieces(choice["text"]):
            yield head | {"choices": [{"index": choice["index"], "text": piece,
                                       "finish_reason": None, "logprobs": None}]}  # fmt: skip
        last = {"index": choice["index"], "text": "", "finish_reason": choice["finish_reason"],
                "logprobs": None}  # fmt: skip
        if "token_ids" in choice:
            last["token_ids"] = choice["token_ids"]
        yield head | {"choices": [last]}
    if request.stream_options is not None and request.stream_options.include_usage:
        yield head | {"choices": [], "usage": payload["usage"]}


def _sse(chunks: Iterator[dict[str, Any]]) -> StreamingResponse:
    def lines() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")
