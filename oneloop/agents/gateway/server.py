"""The gateway's lifecycle: in-process (a uvicorn thread on a free loopback port) and `oneloop
gateway` (the CLI, in front of any Tinker service URL, e.g. `oneloop serve`).

This module owns `GatewayConfig` (validated; errors name the field), `Gateway` (start/stop on a
thread of its own event loop, so an agent that calls the endpoint synchronously from the trial's
event loop cannot deadlock it; `open_session` / `close_session` from any thread, bounded in time)
and `main` (the CLI). Sessions, accounting and routes live in `sessions.py` and `routes.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from oneloop.agents.gateway.routes import make_app
from oneloop.agents.gateway.sessions import SamplingDefaults, Session, SessionStore
from oneloop.agents.renderer import ChatRenderer
from oneloop.errors import ConfigError

logger = logging.getLogger(__name__)
CONTROL_TIMEOUT_S = 30.0  # open/close a session, start/stop the server
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")  # the CLI binds only these: no API key is checked


@dataclass(frozen=True)
class GatewayConfig:
    """One gateway: the model's tokenizer, the sampling defaults, the limits."""

    tokenizer_path: str
    """Directory of the Hugging Face tokenizer with the chat template (path)."""
    model_name: str = "oneloop"
    """The model name clients send (`model`; `openai/<name>` is accepted too)."""
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    """Sampling defaults and per-request limits (see `SamplingDefaults`)."""
    max_sessions: int = 256
    """Most sessions live at once (count); one more is a 429."""
    session_ttl_s: float = 3600.0
    """A session idle this long is dropped (seconds)."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body (bytes); larger is a 413."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra chat-template variables (mapping)."""
    host: str = "127.0.0.1"
    """Address to bind (loopback by default)."""
    port: int = 0
    """Port to bind (0: a free one)."""

    def __post_init__(self) -> None:
        d = self.defaults
        checks = (
            ("max_sessions", self.max_sessions >= 1, "an integer >= 1"),
            ("session_ttl_s", self.session_ttl_s > 0, "> 0"),
            ("max_body_bytes", self.max_body_bytes >= 1024, ">= 1024"),
            ("port", 0 <= self.port < 65536, "in [0, 65536)"),
            ("defaults.context_window", d.context_window >= 2, ">= 2"),
            ("defaults.max_tokens", d.max_tokens >= 1, ">= 1"),
            ("defaults.temperature", d.temperature >= 0, ">= 0"),
            ("defaults.top_p", 0 < d.top_p <= 1, "in (0, 1]"),
            ("defaults.request_timeout_s", d.request_timeout_s > 0, "> 0"),
        )
        for name, ok, what in checks:
            if not ok:
                raise ConfigError(f"gateway.{name}: must be {what}")
        if not self.model_name:
            raise ConfigError("gateway.model_name: must be a non-empty string")


class Gateway:
    """The gateway on a background thread of this process; a context manager.

    `base_url` is `http://host:port`; a session's OpenAI base URL is `session_url(id)`.
    """

    def __init__(self, config: GatewayConfig, sampler: Any = None) -> None:
        self.config = config
        renderer = ChatRenderer.from_pretrained(
            config.tokenizer_path, template_kwargs=config.template_kwargs
        )
        self.store = SessionStore(
            renderer, config.defaults, max_sessions=config.max_sessions,
            ttl_s=config.session_ttl_s, sampler=sampler,
        )  # fmt: skip
        app = make_app(
            self.store, model_name=config.model_name, max_body_bytes=config.max_body_bytes
        )
        self._server = uvicorn.Server(
            uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                           access_log=False, lifespan="off", timeout_keep_alive=75)
        )  # fmt: skip
        self._sock = _bind(config.host, config.port)
        self.port = int(self._sock.getsockname()[1])
        self.base_url = f"http://{config.host}:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="oneloop-gateway", daemon=True)

    def _run(self) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            await self._server.serve(sockets=[self._sock])

        asyncio.run(serve())

    def start(self, timeout_s: float = CONTROL_TIMEOUT_S) -> Gateway:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()
        if self._thread.is_alive():
            logger.warning("gateway thread still alive %s s after stop", timeout_s)

    def wait(self, timeout_s: float) -> bool:
        """Block up to `timeout_s`; whether the server thread is still running."""
        self._thread.join(timeout_s)
        return self._thread.is_alive()

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def session_url(self, session_id: str) -> str:
        """The OpenAI base URL (`.../v1`) of session `session_id`."""
        return f"{self.base_url}/s/{session_id}/v1"

    def _call[T](self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        if self._loop is None:
            raise RuntimeError("the gateway is not running; call start() first")
        future = asyncio.run_coroutine_threadsafe(make(), self._loop)
        try:
            return future.result(CONTROL_TIMEOUT_S)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise TimeoutError(f"gateway control call took over {CONTROL_TIMEOUT_S} s") from exc

    def open_session(self, session_id: str, sampler: Any, **overrides: Any) -> str:
        """Open session `session_id` over `sampler` (`overrides`: `SamplingDefaults` fields);
        returns its OpenAI base URL."""

        async def go() -> None:
            self.store.open(session_id, sampler, **overrides)

        self._call(go)
        return self.session_url(session_id)

    def close_session(self, session_id: str) -> Session | None:
        """Close session `session_id` once its in-flight request (if any) is answered."""

        async def go() -> Session | None:
            session = self.store.sessions.get(session_id)
            if session is None:
                return None
            async with session.lock:
                return self.store.close(session_id)

        return self._call(go)


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ConfigError(f"gateway.port: cannot bind {host}:{port} ({error.strerror})") from None
    return sock


def main(argv: list[str] | None = None) -> int:
    """`oneloop gateway --tinker-url URL --base-model NAME --tokenizer DIR [...]`: serve the
    OpenAI API in front of a Tinker service's sampling client until interrupted."""
    parser = argparse.ArgumentParser(prog="oneloop gateway", description=main.__doc__)
    parser.add_argument("--tinker-url", required=True, help="Tinker service base URL")
    parser.add_argument("--base-model", help="base model of the sampling client")
    parser.add_argument("--model-path", help="tinker:// sampler weights (instead of base model)")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (chat template)")
    parser.add_argument("--api-key", default="local", help="the Tinker service's API key")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--model-name", default="oneloop")
    parser.add_argument("--context-window", type=int, default=4096)
    parser.add_argument("--max-sessions", type=int, default=256)
    args = parser.parse_args(argv)
    if (args.base_model is None) == (args.model_path is None):
        parser.error("give exactly one of --base-model and --model-path")
    if args.host not in LOOPBACK_HOSTS:
        parser.error(f"--host {args.host}: the gateway checks no API key; bind a loopback "
                     f"address {LOOPBACK_HOSTS} and put an authenticating proxy in front")
    import tinker

    service = tinker.ServiceClient(base_url=args.tinker_url, api_key=args.api_key)
    sampler = service.create_sampling_client(
        base_model=args.base_model, model_path=args.model_path
    )
    config = GatewayConfig(
        tokenizer_path=args.tokenizer, model_name=args.model_name, host=args.host,
        port=args.port, max_sessions=args.max_sessions,
        defaults=SamplingDefaults(context_window=args.context_window),
    )  # fmt: skip
    gateway = Gateway(config, sampler).start()
    print(f"oneloop gateway on {gateway.base_url}/v1 (per session: {gateway.session_url('ID')})",
          flush=True)  # fmt: skip
    try:
        while gateway.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        gateway.stop()
    return 0
