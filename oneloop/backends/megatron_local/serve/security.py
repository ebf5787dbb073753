"""Who may talk to `oneloop serve`, and how much: bind policy, API-key check, body size limits.

Facts from the SDK (tinker 0.38, `lib/_auth_token_provider.py`, `lib/internal_client_holder.py`):
- The SDK always sends its credential in the `X-API-Key` header. With `pjwt_auth_enabled`
  false (what our `client/config` says) it sends the API key itself; it refuses to start without
  one, and the key must start with `tml-` (or be a JWT, `eyJ...`). So a client of a loopback
  server still needs *some* `TINKER_API_KEY` such as `tml-local`; the server ignores it when no
  key is configured. `Authorization: Bearer <key>` is accepted too, for curl and other clients.
- The SDK's `forward_backward` chunks are capped at ~5 MB of estimated payload (before the
  optional zstd), so the body limits below leave ample room for real requests.

Policy: the server binds 127.0.0.1 by default. Binding any non-loopback address requires an
API key (`--api-key` or `ONELOOP_API_KEY`); without one the server refuses to start. When a key
is set, every request (health included) must carry it, compared in constant time; otherwise 401.
A body over its route's limit is refused with 413 before any route code runs, and one that does
not arrive within `body_timeout_s` with 408. Keys are never logged or echoed.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from oneloop.errors import ConfigError

API_KEY_ENV = "ONELOOP_API_KEY"
_MIN_KEY_LENGTH = 16

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_api_key(
    flag: str | None, environ: MutableMapping[str, str] | None = None
) -> str | None:
    """The key from the flag, else from `ONELOOP_API_KEY`, else None."""
    env = os.environ if environ is None else environ
    return flag or env.get(API_KEY_ENV) or None


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse an off-loopback bind without a key, and keys the SDK could not send."""
    if api_key is not None:
        if len(api_key) < _MIN_KEY_LENGTH or not (
            api_key.startswith("tml-") or api_key.startswith("eyJ")
        ):
            raise ConfigError(
                f"serve.api_key: must be at least {_MIN_KEY_LENGTH} characters and start with "
                "'tml-' (the tinker SDK only sends keys of that form)"
            )
    if not is_loopback(host) and api_key is None:
        raise ConfigError(
            f"serve.host: binding {host!r} (not loopback) requires an API key; pass --api-key or "
            f"set {API_KEY_ENV}, or bind 127.0.0.1"
        )


class GuardMiddleware:
    """ASGI middleware: API-key check, then the whole body read under a per-route byte limit."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        route_limits: dict[str, int] | None = None,
        body_timeout_s: float = 120.0,
    ) -> None:
        self._app = app
        self._body_timeout_s = body_timeout_s
        self._key = api_key.encode() if api_key else None
        self._max = max_body_bytes
        self._route_limits = route_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self._key is not None and not self._authorized(headers):
            await _reply(send, 401, "missing or wrong API key: send it in the X-API-Key header")
            return
        limit = self._route_limits.get(scope.get("path", ""), self._max)
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > limit
            except ValueError:
                await _reply(send, 400, "content-length: not an integer")
                return
            if too_big:
                await _reply(send, 413, f"body: larger than the {limit} byte limit of this route")
                return
        try:
            async with asyncio.timeout(self._body_timeout_s):
                whole = await _read_body(receive, limit)
        except TimeoutError:
            await _reply(send, 408, f"body: not received within {self._body_timeout_s} s")
            return
        if whole is None:  # the client went away
            return
        if len(whole) > limit:
            await _reply(send, 413, f"body: larger than the {limit} byte limit of this route")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        await self._app(scope, replay, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        assert self._key is not None
        offered = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if not offered and auth.lower().startswith(b"bearer "):
            offered = auth[7:].strip()
        return hmac.compare_digest(offered, self._key)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or as much as shows it is over `limit`; None if the client left."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body = message.get("body", b"")
        size += len(body)
        chunks.append(body)
        if size > limit or not message.get("more_body", False):
            return b"".join(chunks)


async def _reply(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-should-retry", b"false"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
