"""Bind policy, API-key checks, body limits, and no secrets in logs for `oneloop serve`."""

import logging

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from oneloop.backends.megatron_local.serve import ServeConfig, ServerThread, serve_main
from oneloop.backends.megatron_local.serve.security import (
    API_KEY_ENV,
    check_bind,
    is_loopback,
    resolve_api_key,
)
from oneloop.errors import ConfigError

pytestmark = pytest.mark.slow
KEY = "tml-serve-secret-0123456789"


def test_loopback_detection():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.3", "::", "example.com"))


def test_off_loopback_without_a_key_refuses_to_start(monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    # `oneloop serve` answers a configuration error with one line and exit status 2.
    assert serve_main(["--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "requires an API key" in err and len(err.splitlines()) == 1, err
    with pytest.raises(ConfigError, match="requires an API key"):
        check_bind("10.1.2.3", None)
    with pytest.raises(ConfigError, match="tml-"):
        check_bind("0.0.0.0", "short")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", KEY)
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert resolve_api_key(None) == KEY
    assert resolve_api_key("tml-from-the-flag-000000") == "tml-from-the-flag-000000"


def test_server_thread_refuses_off_loopback_without_key(backend):
    with pytest.raises(ConfigError, match="requires an API key"):
        ServerThread(ServeConfig(host="0.0.0.0", port=0), backend)


def test_key_is_checked_on_every_request(backend, caplog):
    caplog.set_level(logging.DEBUG)
    config = ServeConfig(host="0.0.0.0", port=0, api_key=KEY, max_body_bytes=4096)
    with ServerThread(config, backend) as server:
        url = f"http://127.0.0.1:{server.port}/api/v1"
        assert httpx.get(f"{url}/healthz", timeout=30).status_code == 401
        wrong = httpx.get(f"{url}/healthz", headers={"X-API-Key": "tml-wrong"}, timeout=30)
        assert wrong.status_code == 401 and "X-API-Key" in wrong.json()["detail"]
        assert httpx.get(f"{url}/healthz", headers={"X-API-Key": KEY}, timeout=30).json() == {
            "status": "ok"
        }
        bearer = httpx.get(f"{url}/healthz", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert bearer.status_code == 200

        with pytest.raises(tinker.AuthenticationError):
            _ = tinker.ServiceClient(
                base_url=f"http://127.0.0.1:{server.port}", api_key="tml-wrong-key-0000000000"
            ).holder
        client = tinker.ServiceClient(base_url=f"http://127.0.0.1:{server.port}", api_key=KEY)
        assert client.holder.get_session_id() in server.service.registry.sessions
        client.close("success").result(timeout=60)

        big = httpx.post(
            f"{url}/create_session",
            content=b"{" + b" " * 5000 + b"}",
            headers={"X-API-Key": KEY, "content-type": "application/json"},
            timeout=30,
        )
        assert big.status_code == 413

        def chunks():
            yield b"{" + b" " * 3000
            yield b" " * 3000 + b"}"

        streamed = httpx.post(
            f"{url}/create_session", content=chunks(), headers={"X-API-Key": KEY}, timeout=30
        )
        assert streamed.status_code == 413
        assert httpx.get(f"{url}/healthz", headers={"X-API-Key": KEY}, timeout=30).is_success
        assert server.service.internal_errors == 0
    assert KEY not in caplog.text


def test_zstd_bodies_and_decompression_limit(backend):
    config = ServeConfig(port=0, compress_fwdbwd=True, max_decompressed_bytes=1 << 16)
    with ServerThread(config, backend) as server:
        url = f"{server.base_url}/api/v1/forward_backward"
        headers = {"content-type": "application/x-protobuf", "content-encoding": "zstd"}
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={
                "target_tokens": np.array([2, 3, 4], np.int64),
                "weights": np.ones(3, np.float32),
            },
        )
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=[datum], loss_fn="cross_entropy"
            ),
            model_id="sess-none:train:0",
            seq_id=1,
        )
        body = zstandard.ZstdCompressor().compress(
            forward_backward_request_to_proto(request).SerializeToString()
        )
        unknown = httpx.post(url, content=body, headers=headers, timeout=30)
        assert unknown.status_code == 404 and "model_id" in unknown.json()["detail"]
        raw = zstandard.ZstdDecompressor().decompress(body)
        uncompressed = httpx.post(
            url, content=raw, timeout=30, headers={"content-type": "application/x-protobuf"}
        )
        assert uncompressed.status_code == 404
        bomb = zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))
        assert httpx.post(url, content=bomb, headers=headers, timeout=30).status_code == 413
        junk = httpx.post(url, content=b"not zstd", headers=headers, timeout=30)
        assert junk.status_code == 400 and "zstd" in junk.json()["detail"]
        plain = httpx.post(
            url, content=b"{}", headers={"content-type": "application/json"}, timeout=30
        )
        assert plain.status_code == 415


def test_server_thread_connections_have_nagle_off(backend):
    """Regression: `ServerThread` bound its own socket with proto 0, so asyncio left Nagle on
    for accepted connections and a response written as headers + body waited ~40 ms for the
    client's delayed ACK (every other `sample` in bench_serve)."""
    import socket

    with ServerThread(ServeConfig(port=0), backend) as server, httpx.Client() as client:
        assert client.get(f"{server.base_url}/api/v1/healthz", timeout=30).is_success
        connections = server._server.server_state.connections
        assert connections
        for connection in connections:
            sock = connection.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_a_bound_socket_already_accepts_connections():
    """Regression (CI, stop 33): `oneloop serve` printed its address once the socket was bound,
    but only uvicorn's start made it listen, so a client that came in between was refused
    (ECONNREFUSED). The socket listens from the bind on; the connection waits in the backlog."""
    import socket

    from oneloop.backends.megatron_local.serve.server import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname(), timeout=5):
            pass
    finally:
        sock.close()


def test_oneloop_serve_command_serves_and_stops(tmp_path):
    """`oneloop serve` as a subprocess: answers /healthz on loopback, exits cleanly on SIGINT."""
    import signal

    from oneloop.backends.megatron_local.serve.spawn import serve_process

    with serve_process(["--run-dir", str(tmp_path / "runs")]) as served:
        assert served.url.startswith("http://127.0.0.1:")
        r = httpx.get(f"{served.url}/api/v1/healthz", timeout=5)
        assert r.json() == {"status": "ok"}
    assert served.process.returncode == 128 + signal.SIGINT  # stopped by the signal, cleanly
