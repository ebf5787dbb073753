"""Starting `oneloop serve`: its config, the blocking entry points, and an in-process thread.

- `serve_main(argv)`: the `oneloop serve` command line (the lead's CLI calls it).
- `run_server(config, backend=None)`: blocking; builds the backend `config.backend` names
  (`local`, or `tinker`: the SDK's client of a Tinker service) unless one is passed.
- `ServerThread(config, backend)`: the same server on a background thread, on a free port
  when `config.port` is 0 (tests and benchmarks); a context manager, `.base_url`.

The bind policy is enforced before anything listens: off loopback needs an API key. `oneloop
serve` binds its port before it starts the backend (a busy port is a one-line error at once), and
a SIGTERM or SIGINT ends it in order within `STOP_GRACE_S`: uvicorn stops taking requests, the
backend's actors stop, Ray shuts down, and the process exits with 128 + the signal number (143
for SIGTERM, 130 for SIGINT), as `oneloop train` does. A second signal, or a cleanup past the
bound, ends it at once by the signal's default action.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from oneloop.backends.config import (
    BackendConfig,
    check_model_dirs,
    format_validation_error,
    parse_backend_config,
    read_backend_file,
)
from oneloop.backends.megatron_local.serve.app import build_app
from oneloop.backends.megatron_local.serve.lifecycle import LifecycleLimits
from oneloop.backends.megatron_local.serve.security import (
    GuardMiddleware,
    check_bind,
    resolve_api_key,
)
from oneloop.backends.megatron_local.serve.service import Limits, ServeService
from oneloop.errors import ConfigError

logger = logging.getLogger(__name__)
MiB = 1 << 20
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_GRACE_S = 45.0
"""Most seconds from the first SIGTERM/SIGINT to the end of `oneloop serve` (issue 21 bounds a
stop at 60 s; the rest is the interpreter's own exit). uvicorn gets a third of it to finish
open requests; the backend and Ray the rest."""
LISTEN_BACKLOG = 2048
"""uvicorn's own default, set at bind time (uvicorn sets it again when it starts serving)."""


class ServeConfig(BaseModel):
    """Settings of one `oneloop serve` process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    """Address to bind; anything but loopback requires `api_key`."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port; 0 picks a free one."""
    api_key: str | None = Field(default=None, repr=False)
    """Key every request must send (X-API-Key); None = no check (loopback only)."""
    backend: BackendConfig = BackendConfig()
    """The local backend the server drives."""
    max_body_bytes: int = Field(default=16 * MiB, gt=0)
    """Largest JSON request body, in bytes (413 above)."""
    max_fwdbwd_body_bytes: int = Field(default=128 * MiB, gt=0)
    """Largest forward_backward body as sent (maybe zstd), in bytes."""
    max_decompressed_bytes: int = Field(default=512 * MiB, gt=0)
    """Largest forward_backward body after zstd decompression, in bytes."""
    compress_fwdbwd: bool = False
    """Ask the SDK to zstd-compress forward_backward bodies (worth it off-host only)."""
    use_pyqwest: bool = True
    """Let the SDK use its pyqwest HTTP transport (its default)."""
    long_poll_s: float = Field(default=30.0, gt=0, lt=45)
    """How long one /retrieve_future waits before answering 408 (the SDK waits 45 s)."""
    sample_ack_wait_s: float = Field(default=2.0, ge=0)
    """How long /asample of an `inflight` sampler waits for the result, to acknowledge with the
    exact weight version (fixed-weights samplers are acknowledged at once)."""
    submit_timeout_s: float = Field(default=300.0, gt=0)
    """Longest a backend call may take to accept a request, in seconds."""
    result_timeout_s: float = Field(default=3600.0, gt=0)
    """Longest a backend request may run, in seconds."""
    result_ttl_s: float = Field(default=3600.0, gt=0)
    """How long an unretrieved result is kept, in seconds (then polls get 410)."""
    body_timeout_s: float = Field(default=120.0, gt=0)
    """Longest a client may take to send a request body, in seconds (then 408)."""
    gap_timeout_s: float = Field(default=600.0, gt=0)
    """How long a request waits for a missing earlier seq_id before failing, in seconds."""
    max_live_trainers: int | None = Field(default=8, ge=1)
    """Most training models holding a trainer (a Ray actor) at once; one more is refused with
    a 403 naming this cap. None = no cap."""
    trainer_idle_s: float | None = Field(default=None, gt=0)
    """Release a model's trainer after this many seconds without a request (its unsaved state
    is lost; later requests get a 410). None = never."""
    session_expiry_s: float | None = Field(default=180.0, gt=0)
    """Finish a session, releasing its trainers, after this many seconds without a heartbeat
    (the SDK sends one every 10 s). None = never."""
    http: Literal["httptools", "h11"] = "httptools"
    """uvicorn's HTTP/1.1 parser: `httptools` (C, a dependency; the default) or `h11` (pure
    Python, uvicorn's fallback), chosen here rather than by what happens to be installed."""


def make_asgi(config: ServeConfig, backend: Any) -> tuple[GuardMiddleware, ServeService]:
    """The whole ASGI application (guard middleware around the routes) and its service."""
    check_bind(config.host, config.api_key)
    limits = Limits(
        submit_timeout_s=config.submit_timeout_s,
        result_timeout_s=config.result_timeout_s,
        long_poll_s=config.long_poll_s,
        sample_ack_wait_s=config.sample_ack_wait_s,
    )
    lifecycle = LifecycleLimits(
        max_live_trainers=config.max_live_trainers,
        trainer_idle_s=config.trainer_idle_s,
        session_expiry_s=config.session_expiry_s,
    )
    service = ServeService(backend, limits, result_ttl_s=config.result_ttl_s, lifecycle=lifecycle)
    app = build_app(
        service,
        compress_fwdbwd=config.compress_fwdbwd,
        use_pyqwest=config.use_pyqwest,
        max_decompressed_bytes=config.max_decompressed_bytes,
        gap_timeout_s=config.gap_timeout_s,
    )
    guarded = GuardMiddleware(
        app,
        api_key=config.api_key,
        max_body_bytes=config.max_body_bytes,
        route_limits={"/api/v1/forward_backward": config.max_fwdbwd_body_bytes},
        body_timeout_s=config.body_timeout_s,
    )
    return guarded, service


def _uvicorn(config: ServeConfig, backend: Any) -> tuple[uvicorn.Server, ServeService]:
    asgi, service = make_asgi(config, backend)
    # proxy_headers off: no route reads the client address X-Forwarded-For would rewrite (the
    # middleware ran on every request); server_header off: one header less for every client to
    # parse, and nothing reads it.
    server = uvicorn.Server(
        uvicorn.Config(asgi, host=config.host, port=config.port, log_level="warning",
                       access_log=False, lifespan="on", timeout_keep_alive=75,
                       http=config.http, timeout_graceful_shutdown=STOP_GRACE_S / 3,
                       proxy_headers=False, server_header=False)
    )
    return server, service


def _backend(config: ServeConfig) -> Any:
    """The service client `config.backend` names, built here rather than through
    `oneloop.backends.connect` (the package above this one): `local` is our Ray backend,
    `tinker` the SDK's own client of a Tinker service (the server then relays to it)."""
    if config.backend.backend == "local":
        from oneloop.backends.megatron_local.service_client import LocalServiceClient

        return LocalServiceClient(config.backend)
    from oneloop.backends.tinker_remote import connect_remote

    return connect_remote(config.backend)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (Nagle off: see `ServerThread`); a busy port
    or an address this host lacks is a one-line ConfigError naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        # Listening from here on: a client that connects between the "serve on" line and
        # uvicorn's first accept waits in the backlog instead of being refused.
        sock.listen(LISTEN_BACKLOG)
    except OSError as error:
        sock.close()
        if error.errno == 98:  # EADDRINUSE
            raise ConfigError(f"--port {port}: {host}:{port} is already in use; stop what "
                              "listens there or pick another port with --port") from None
        raise ConfigError(f"--host {host} --port {port}: cannot bind ({error.strerror})") from None
    return sock


class _Stop:
    """The signal that stopped `run_server`, and the bound on the cleanup after it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._deadline: threading.Timer | None = None
        self._before: dict[int, Any] = {}

    def handle(self, signum: int, _frame: object) -> None:
        # uvicorn captures the signals while it serves and re-raises the first one here once it
        # has shut down; any signal after that one ends the process at once.
        if self.signum is not None:
            self._die(signum)
        self.signum = signum
        self._deadline = threading.Timer(STOP_GRACE_S, self._die, (signum,))
        self._deadline.daemon = True
        self._deadline.start()

    @staticmethod
    def _die(signum: int) -> None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def install(self) -> None:
        """Make `handle` the SIGTERM/SIGINT handler (again: `ray.init` replaces it)."""
        for s in STOP_SIGNALS:
            before = signal.signal(s, self.handle)
            self._before.setdefault(s, before)

    @contextmanager
    def installed(self) -> Iterator[None]:
        self.install()
        try:
            yield
        finally:
            for s, handler in self._before.items():
                signal.signal(s, handler)
            if self._deadline is not None:
                self._deadline.cancel()


def run_server(config: ServeConfig, backend: Any = None) -> int:
    """Serve until SIGTERM/SIGINT (blocking); returns the exit status (0, or 128 + signal)."""
    check_bind(config.host, config.api_key)
    sock = bind_socket(config.host, config.port)  # before the backend: a busy port fails at once
    owned = backend is None
    stop = _Stop()
    try:
        with stop.installed():  # a signal while the backend starts skips serving
            backend = _backend(config) if owned else backend
            # `ray.init` installs a SIGTERM handler that calls sys.exit from whatever runs (an
            # abort with a C++ stack trace): ours goes back in its place.
            stop.install()
            if stop.signum is None:
                server, _ = _uvicorn(config, backend)
                port = sock.getsockname()[1]
                logger.warning("oneloop serve on http://%s:%d (API key %s)", config.host, port,
                               "required" if config.api_key else "not required: loopback only")
                server.run(sockets=[sock])
            if owned:
                backend.close()
                backend = None
                _shutdown_ray()
    finally:
        sock.close()
        if owned and backend is not None:
            backend.close()
    if stop.signum is not None:
        logger.warning("oneloop serve: stopped by %s", signal.Signals(stop.signum).name)
        return 128 + stop.signum
    return 0


def _shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


class ServerThread:
    """`oneloop serve` on a background thread of this process."""

    def __init__(self, config: ServeConfig, backend: Any) -> None:
        # Builds (and checks the bind policy) before binding anything.
        self._server, self.service = _uvicorn(config, backend)
        # proto=IPPROTO_TCP: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets
        # whose proto says TCP, and a socket made with proto 0 passes 0 on to them. With Nagle
        # on, a response written as headers + body waited for the client's delayed ACK (~40 ms
        # on every other /retrieve_future in bench_serve --sample-only).
        self._sock = bind_socket(config.host, config.port)
        self.port = self._sock.getsockname()[1]
        host = f"[{config.host}]" if ":" in config.host else config.host
        self.base_url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._run, name="oneloop-serve", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("oneloop serve did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def parse_args(argv: list[str] | None) -> ServeConfig:
    parser = argparse.ArgumentParser(prog="oneloop serve",
                                     description="Serve the local backend over the Tinker API.")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="required off loopback; default: $ONELOOP_API_KEY")
    parser.add_argument("--run-dir", type=Path, default=None, help="checkpoint root directory")
    parser.add_argument("--backend-config", type=Path, default=None,
                        help="YAML (.yaml/.yml) or JSON (.json) file with the backend section "
                             "(BackendConfig: backend, run_dir, models, local, tinker), bare or "
                             "wrapped in `backend:`")
    parser.add_argument("--compress-fwdbwd", action="store_true",
                        help="ask clients to zstd-compress forward_backward bodies")
    parser.add_argument("--max-live-trainers", type=trainer_cap, default=8, metavar="N",
                        help="most training models holding a trainer at once (default 8; "
                             "0 = no cap)")
    parser.add_argument("--trainer-idle-s", type=float, default=None, metavar="S",
                        help="release a trainer after S seconds without a request (default: "
                             "never; its unsaved state is lost)")
    parser.add_argument("--session-expiry-s", type=float, default=180.0, metavar="S",
                        help="finish a session without a heartbeat for S seconds, releasing "
                             "its trainers (default 180)")
    args = parser.parse_args(argv)
    backend: dict[str, Any] = {"backend": "local"}
    if args.backend_config is not None:
        backend.update(read_backend_file(args.backend_config))
    if args.run_dir is not None:
        backend["run_dir"] = str(args.run_dir)
    try:
        config = ServeConfig(
            host=args.host, port=args.port, api_key=resolve_api_key(args.api_key),
            backend=parse_backend_config(backend), compress_fwdbwd=args.compress_fwdbwd,
            max_live_trainers=args.max_live_trainers, trainer_idle_s=args.trainer_idle_s,
            session_expiry_s=args.session_expiry_s,
        )
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, "serve")) from None
    check_model_dirs(config.backend)
    return config


def trainer_cap(text: str) -> int | None:
    """`--max-live-trainers`: an integer, 0 meaning no cap."""
    value = int(text)
    return None if value == 0 else value


def serve_main(argv: list[str] | None = None) -> int:
    """`oneloop serve [--host H] [--port P] [--api-key K] [--run-dir D] [--backend-config F]
    [--max-live-trainers N] [--trainer-idle-s S] [--session-expiry-s S]`: exit status 0, 2 for
    a configuration error (one line on stderr), 128 + signal after a SIGTERM/SIGINT stop."""
    try:
        config = parse_args(argv)
        check_bind(config.host, config.api_key)
        return run_server(config)
    except ConfigError as error:
        print(f"oneloop serve: config error: {error}", file=sys.stderr)
        return 2


main = serve_main
