"""The vllm sampler engine's weight-sync records on CPU, with a stand-in for vLLM's `AsyncLLM`
(vLLM itself runs on the device machine: tests/gpu/test_vllm_engine.py). The stand-in keeps every
request running until the test ends them, so a sync lands while they are in flight.

Each `SyncRecord` must say how many requests were in vLLM when its pause began and when (wall
clock) it began: on the H200 an in-flight pause of an eager MoE engine took 0.9-1.6 s, and only
those two figures, lined up with the Triton kernels compiled meanwhile, told that the pause had
waited for engine steps that JIT-compiled kernels.
"""

import asyncio
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from oneloop.backends.megatron_local.engines.base import SampleRequest
from oneloop.backends.megatron_local.engines.vllm.sampler import VllmSamplerEngine

KEY = "inflight:run"
WAIT_S = 10.0  # every wait in this test is bounded


class FakeQueue:
    """vLLM's per-request output collector: one final output once the engine ends the request."""

    def __init__(self, engine: "FakeAsyncLLM", request_id: str, params) -> None:
        self.engine, self.request_id, self.params = engine, request_id, params

    def get_nowait(self):
        return None

    async def get(self):
        deadline = time.monotonic() + WAIT_S
        while not self.engine.finish.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError("the test never ended the request")
            await asyncio.sleep(0.002)
        n = self.params.kwargs["max_tokens"]
        completion = types.SimpleNamespace(
            index=0,
            finish_reason="length",
            token_ids=[7] * n,
            logprobs=types.SimpleNamespace(token_ids=[7] * n, logprobs=[-1.0] * n),
            routed_experts=None,
        )
        return types.SimpleNamespace(finished=True, outputs=[completion], prompt_logprobs=None)

    def close(self) -> None:
        self.engine.running.discard(self.request_id)


class FakeAsyncLLM:
    """What the engine calls on `AsyncLLM`, recording pauses and loads."""

    def __init__(self) -> None:
        self.finish = threading.Event()  # ends every request
        self.running: set[str] = set()
        self.pauses: list[tuple[str, int]] = []  # (mode, requests in vLLM at the pause)
        self.loads: list[str] = []

    async def add_request(self, request_id, engine_input, params, lora_request=None):
        self.running.add(request_id)
        return FakeQueue(self, request_id, params)

    async def abort(self, request_id, internal=False) -> None:
        self.running.discard(request_id)

    async def pause_generation(self, *, mode, clear_cache) -> None:
        self.pauses.append((mode, len(self.running)))
        await asyncio.sleep(0.02)  # vLLM 0.26 sleeps 20 ms in every pause

    async def resume_generation(self) -> None:
        pass

    async def collective_rpc(self, method, timeout=None, args=()):
        self.loads.append(method)
        return [{}]

    def shutdown(self, timeout=None) -> None:
        pass


class Params:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


@pytest.fixture
def fake_vllm(monkeypatch) -> FakeAsyncLLM:
    """Stand-in `vllm` modules for the names the engine imports; yields the engine's AsyncLLM."""
    engine = FakeAsyncLLM()
    modules = {
        name: types.ModuleType(name)
        for name in (
            "vllm",
            "vllm.engine",
            "vllm.engine.arg_utils",
            "vllm.v1",
            "vllm.v1.engine",
            "vllm.v1.engine.async_llm",
            "vllm.sampling_params",
            "vllm.inputs",
            "vllm.inputs.engine",
        )
    }
    modules["vllm"].SamplingParams = Params
    modules["vllm.sampling_params"].RequestOutputKind = types.SimpleNamespace(FINAL_ONLY=2)
    modules["vllm.inputs.engine"].tokens_input = lambda ids, cache_salt: {
        "prompt_token_ids": ids,
        "cache_salt": cache_salt,
    }
    modules["vllm.engine.arg_utils"].AsyncEngineArgs = Params
    modules["vllm.v1.engine.async_llm"].AsyncLLM = types.SimpleNamespace(
        from_engine_args=lambda args: engine
    )
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield engine
    engine.finish.set()


def weights() -> dict[str, np.ndarray]:
    return {"model.norm.weight": np.ones(4, np.float32)}


def wait_until(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_sync_records_count_the_requests_in_flight_and_when_the_pause_began(fake_vllm):
    engine = VllmSamplerEngine(Path("/models/none"))
    try:
        engine.set_weights(KEY, weights(), version=1)  # a key switch: "wait", nothing running
        request = SampleRequest(prompt=np.arange(5), num_samples=1, max_tokens=3)
        futures = [engine.submit_sample(KEY, request) for _ in range(3)]
        wait_until(lambda: len(fake_vllm.running) == 3)
        before = time.time()
        engine.set_weights(KEY, weights(), version=2)  # same key: in flight, "keep"
        after = time.time()
        fake_vllm.finish.set()
        outputs = [f.result(timeout=WAIT_S) for f in futures]
        engine.set_weights(KEY, weights(), version=3)  # every request ended
        first, inflight, idle = engine.sync_history
    finally:
        engine.close(timeout=WAIT_S)
    assert fake_vllm.pauses == [("wait", 0), ("keep", 3), ("keep", 0)]
    assert fake_vllm.loads == ["load_hf_weights"] * 3
    assert [r.mode for r in engine.sync_history] == ["wait", "keep", "keep"]
    assert [r.in_flight for r in engine.sync_history] == [0, 3, 0]
    assert before <= inflight.started_at <= after
    assert first.started_at <= inflight.started_at <= idle.started_at
    assert inflight.pause_ms >= 20.0 and inflight.window_ms >= inflight.pause_ms + inflight.load_ms
    assert all(out.version == 1 and len(out.sequences[0].tokens) == 3 for out in outputs)


def test_a_request_cancelled_in_flight_no_longer_counts(fake_vllm):
    engine = VllmSamplerEngine(Path("/models/none"))
    try:
        engine.set_weights(KEY, weights(), version=1)
        request = SampleRequest(prompt=np.arange(5), num_samples=1, max_tokens=3)
        kept = engine.submit_sample(KEY, request)
        cancelled = engine.submit_sample(KEY, request)
        wait_until(lambda: len(fake_vllm.running) == 2)
        cancelled.cancel()  # the engine aborts its vLLM request
        wait_until(lambda: len(fake_vllm.running) == 1)
        engine.set_weights(KEY, weights(), version=2)
        fake_vllm.finish.set()
        kept.result(timeout=WAIT_S)
    finally:
        engine.close(timeout=WAIT_S)
    assert engine.sync_history[-1].in_flight == 1
