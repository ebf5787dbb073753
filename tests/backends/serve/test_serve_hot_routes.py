"""`serve.hot_routes`: asample and retrieve_future answered in front of FastAPI give the answers
the FastAPI routes give (status, body, retry header), and other methods still reach FastAPI."""

import httpx
import pytest

from oneloop.backends.megatron_local.serve import ServeConfig, ServerThread
from oneloop.backends.megatron_local.serve.hot_routes import HotRoutes

SESSION = "sess-hot-unknown"
BODIES = {
    "asample": [
        b"not json",
        b"[1, 2]",
        b'{"num_samples": 1}',
        b'{"num_samples": 1, "prompt": {"chunks": [{"tokens": [1], "type": "encoded_text"}]},'
        b' "sampling_params": {"max_tokens": 2, "bogus": 1},'
        b' "sampling_session_id": "' + SESSION.encode() + b':sample:0", "seq_id": 0}',
        b'{"num_samples": 1, "prompt": {"chunks": [{"tokens": [1], "type": "encoded_text"}]},'
        b' "sampling_params": {"max_tokens": 2},'
        b' "sampling_session_id": "' + SESSION.encode() + b':sample:0", "seq_id": 0}',
    ],
    "retrieve_future": [
        b"",
        b"{}",
        b'{"request_id": "req-unknown"}',
        b'{"request_id": 5}',
    ],
}


@pytest.fixture(scope="module")
def server(backend):
    with ServerThread(ServeConfig(port=0, long_poll_s=1.0), backend) as thread:
        yield thread


def _answer(response: httpx.Response) -> tuple[int, bytes, str | None, str | None]:
    return (response.status_code, response.content, response.headers.get("content-type"),
            response.headers.get("x-should-retry"))  # fmt: skip


@pytest.mark.parametrize(
    ("route", "body"), [(r, b) for r, bodies in BODIES.items() for b in bodies]
)
def test_hot_route_answers_as_the_fastapi_route(server, route, body, monkeypatch):
    hot = server._server.config.app._app  # uvicorn -> guard -> HotRoutes -> FastAPI
    assert isinstance(hot, HotRoutes)
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=f"{server.base_url}/api/v1", timeout=30) as client:
        via_hot = client.post(f"/{route}", content=body, headers=headers)
        monkeypatch.setattr(hot, "_routes", {})  # the same request through FastAPI's route
        via_fastapi = client.post(f"/{route}", content=body, headers=headers)
    assert 400 <= via_hot.status_code < 500, via_hot.text
    assert _answer(via_hot) == _answer(via_fastapi)
    assert via_hot.json()["detail"]


def test_other_methods_on_hot_paths_reach_fastapi(server):
    with httpx.Client(base_url=f"{server.base_url}/api/v1", timeout=30) as client:
        assert client.get("/asample").status_code == 405
        assert client.put("/retrieve_future", content=b"{}").status_code == 405
        assert client.get("/healthz").status_code == 200


def test_the_configured_http_parser_is_the_one_serving(server, backend):
    """`ServeConfig.http` picks uvicorn's parser (httptools by default, h11 on request), and
    both answer the hot routes alike."""
    assert server._server.config.http_protocol_class.__name__ == "HttpToolsProtocol"
    headers = {"content-type": "application/json"}
    with ServerThread(ServeConfig(port=0, long_poll_s=1.0, http="h11"), backend) as h11:
        assert h11._server.config.http_protocol_class.__name__ == "H11Protocol"
        for route, bodies in BODIES.items():
            for body in bodies:
                answers = []
                for thread in (server, h11):
                    with httpx.Client(base_url=f"{thread.base_url}/api/v1", timeout=30) as c:
                        answers.append(_answer(c.post(f"/{route}", content=body,
                                                      headers=headers)))  # fmt: skip
                assert answers[0] == answers[1], (route, body)
