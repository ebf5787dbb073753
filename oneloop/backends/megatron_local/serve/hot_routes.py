"""The requests every `sample` call makes (POST asample, POST retrieve_future), answered as a
plain ASGI app in front of FastAPI.

Why: on the 2-core development machine the server's CPU is taken from the sampler it waits for.
Through FastAPI a 64-sample call cost the server thread 2.9-3.3 ms of CPU (matching the path
against every route in turn, three middleware layers, a `Request` object and dependency solving,
for each of the two requests); answered here, 2.5-2.9 ms (the server thread's CPU time from
/proc schedstat over 30 calls like `bench_serve --sample-only`'s, 3 runs each way, alternated).

The handlers are the ones the FastAPI routes call (`build_app` registers each under both), and
errors become the same responses through the same function (`error_response`), so an answer
does not depend on which way it took. Other methods on these paths fall through to FastAPI (405).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response

Handler = Callable[[bytes], Awaitable[Response]]
ErrorResponse = Callable[[str, str, Exception], Response]


class HotRoutes:
    """ASGI app: POST `routes[path]` answered directly, everything else passed to `app`."""

    def __init__(self, app: Any, routes: dict[str, Handler], on_error: ErrorResponse) -> None:
        self._app = app
        self._routes = routes
        self._on_error = on_error

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        handler = None
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._routes.get(scope["path"])
        if handler is None:
            await self._app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:  # the guard has read the body already: one message, as a rule
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        try:
            response = await handler(b"".join(chunks))
        except Exception as error:  # noqa: BLE001 - answered as FastAPI's handlers answer it
            response = self._on_error(scope["method"], scope["path"], error)
        await response(scope, receive, send)
