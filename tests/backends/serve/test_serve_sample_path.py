"""The path of one SDK `sample` call through `oneloop serve`: its HTTP requests, and where the
server submits it to the sampler (on the event loop while that is non-blocking, else a thread)."""

import collections
import threading
import time

import pytest
import tinker
from tinker import types

from oneloop.backends.megatron_local.sampling_client import LocalSamplingClient
from oneloop.backends.megatron_local.serve import ServeConfig, ServerThread, service
from oneloop.tiny.model import TINY_MODEL_NAME

pytestmark = pytest.mark.slow
SERVER_THREAD = "oneloop-serve"  # ServerThread's thread, which runs the event loop


@pytest.fixture(scope="module")
def server(backend):
    with ServerThread(ServeConfig(port=0), backend) as thread:
        yield thread
        assert thread.service.internal_errors == 0


@pytest.fixture
def sampler(server):
    """A fresh SDK sampling client (a fresh sampler slot: no overruns counted yet)."""
    sdk = tinker.ServiceClient(base_url=server.base_url, api_key="tml-path")
    yield sdk.create_sampling_client(base_model=TINY_MODEL_NAME).result(timeout=300)
    sdk.close("success").result(timeout=60)


@pytest.fixture
def submit_threads(monkeypatch):
    """Names of the threads `LocalSamplingClient.sample` runs on, in call order; `delay_s[0]`
    seconds of blocking are added to each call."""
    names: list[str] = []
    delay_s = [0.0]
    original = LocalSamplingClient.sample

    def recorded(self, *args, **kwargs):
        names.append(threading.current_thread().name)
        time.sleep(delay_s[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LocalSamplingClient, "sample", recorded)
    return names, delay_s


def _sample(client, tokens: int, seed: int) -> types.SampleResponse:
    prompt = types.ModelInput.from_ints(list(range(10, 10 + tokens)))
    params = types.SamplingParams(max_tokens=4, seed=seed, stop=[])
    return client.sample(prompt, 1, params).result(timeout=120)


def test_one_sample_is_two_http_requests(server, sampler, monkeypatch):
    """The SDK's `sample` costs one POST asample and one POST retrieve_future: the long poll
    holds the retrieve until the result is there (no 408 round), and the result comes whole
    (no metadata-only round first)."""
    hot = server._server.config.app._app  # uvicorn -> guard -> HotRoutes
    counts: collections.Counter[str] = collections.Counter()

    def counting(path, handler):
        async def handle(body: bytes):
            counts[path.rsplit("/", 1)[1]] += 1
            return await handler(body)

        return handle

    monkeypatch.setattr(hot, "_routes", {p: counting(p, h) for p, h in hot._routes.items()})
    futures = [
        sampler.sample(types.ModelInput.from_ints([11, 12, 13]), 1,
                       types.SamplingParams(max_tokens=4, seed=i, stop=[]))
        for i in range(16)
    ]  # fmt: skip
    assert all(len(f.result(timeout=120).sequences) == 1 for f in futures)
    assert counts == {"asample": 16, "retrieve_future": 16}


def test_small_prompts_are_submitted_on_the_event_loop(sampler, submit_threads, monkeypatch):
    names, _ = submit_threads
    monkeypatch.setattr(LocalSamplingClient, "nonblocking_submit_max_tokens", 8)
    inline, threaded = _sample(sampler, 8, 0), _sample(sampler, 9, 1)
    assert names == [SERVER_THREAD, names[1]] and names[1] != SERVER_THREAD
    assert inline.sequences[0].tokens and threaded.sequences[0].tokens


def test_slow_inline_submits_move_the_sampler_to_a_thread(sampler, submit_threads, monkeypatch):
    """The bound on a submit made on the event loop: after `INLINE_SUBMIT_STRIKES` submits over
    `INLINE_SUBMIT_BUDGET_S`, the sampler's submits run in a worker thread (under the submit
    timeout), and the slow ones still answer."""
    names, delay_s = submit_threads
    monkeypatch.setattr(service, "INLINE_SUBMIT_BUDGET_S", 0.01)
    delay_s[0] = 0.02
    strikes = service.INLINE_SUBMIT_STRIKES
    for seed in range(strikes + 2):
        assert _sample(sampler, 4, seed).sequences[0].tokens
    assert names[:strikes] == [SERVER_THREAD] * strikes
    assert SERVER_THREAD not in names[strikes:]
