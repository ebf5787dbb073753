"""The torch sampler batches concurrent requests (issue 21): a seeded request gives the same tokens
alone or batched, a failing request fails alone, and each request's stops and max_tokens hold
inside a batch; requests arriving mid-batch join it between decode steps, except while a weight
update waits. On the engine directly; through the Ray sampler actor: tests/backends/local/
test_sampler_concurrency.py."""

import concurrent.futures
import time

import numpy as np
import pytest

from oneloop.backends.megatron_local.engines.base import SampleOutput, SampleRequest
from oneloop.backends.megatron_local.engines.torch.sampler import TorchSamplerEngine
from oneloop.errors import RequestError
from oneloop.tiny.model import TINY_QWEN3_5_MOE, TINY_QWEN3_MOE, build_tiny_model, named_tiny_specs

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    engine = TorchSamplerEngine(tiny_model_path, threads=1)
    yield engine
    engine.close()


def prompt(seed: int, length: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 1000, size=length).astype(np.int64)


def batched(engine: TorchSamplerEngine, requests: list[SampleRequest]) -> list:
    """Submit `requests` while the engine's model lock is held, so they queue up behind the
    first batch and run together; each request's output or error, and the batch sizes seen."""
    before = len(engine.batch_history)
    with engine.lock:
        futures = [engine.submit_sample("base", r) for r in requests]
    done, _ = concurrent.futures.wait(futures, timeout=TIMEOUT_S)
    assert len(done) == len(futures), "a batched request never finished"
    sizes = list(engine.batch_history)[before:]
    return [f.exception() or f.result() for f in futures], sizes


def assert_same(alone: SampleOutput, together: SampleOutput) -> None:
    assert [s.tokens.tolist() for s in alone.sequences] == [
        s.tokens.tolist() for s in together.sequences
    ]
    assert [s.stop_reason for s in alone.sequences] == [s.stop_reason for s in together.sequences]
    for a, b in zip(alone.sequences, together.sequences, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def mixed_requests() -> list[SampleRequest]:
    """Seeded requests that differ in everything a batch must keep apart: prompt length,
    num_samples, max_tokens, temperature / top-k / top-p, prompt logprobs."""
    return [
        SampleRequest(prompt(1, 5), num_samples=1, max_tokens=12, seed=11),
        SampleRequest(prompt(2, 31), num_samples=3, max_tokens=7, seed=12),
        SampleRequest(prompt(3, 17), num_samples=2, max_tokens=20, seed=13, temperature=0.7),
        SampleRequest(prompt(4, 9), num_samples=1, max_tokens=1, seed=14, top_k=5),
        SampleRequest(prompt(5, 24), num_samples=2, max_tokens=16, seed=15, top_p=0.8),
        SampleRequest(prompt(6, 12), num_samples=1, max_tokens=9, seed=16, temperature=0.0),
        SampleRequest(prompt(7, 3), 1, 10, seed=17, include_prompt_logprobs=True),
        SampleRequest(prompt(8, 40), num_samples=4, max_tokens=14, seed=18),
    ]


def test_seeded_request_same_tokens_alone_or_batched(engine):
    requests = mixed_requests()
    alone = [engine.sample("base", r) for r in requests]
    outputs, sizes = batched(engine, requests)
    assert sum(sizes) == len(requests) and max(sizes) >= len(requests) // 2, sizes
    for request, a, b in zip(requests, alone, outputs, strict=True):
        assert isinstance(b, SampleOutput), b
        assert len(b.sequences) == request.num_samples
        assert_same(a, b)
        if request.include_prompt_logprobs:
            np.testing.assert_allclose(a.prompt_logprobs, b.prompt_logprobs, atol=1e-5)
        else:
            assert b.prompt_logprobs is None
    # Sample i of a request does not depend on num_samples, batched or not.
    first = engine.submit_sample("base", SampleRequest(prompt(8, 40), 1, 14, seed=18))
    assert first.result(timeout=TIMEOUT_S).sequences[0].tokens.tolist() == (
        alone[-1].sequences[0].tokens.tolist()
    )


def test_a_failing_request_fails_alone(engine, monkeypatch):
    """Bad input is refused per request; a request whose generation raises inside a batch
    (a fault injected into its draw) fails alone, its batch neighbours get their own tokens."""
    good = [SampleRequest(prompt(20 + i, 6 + 3 * i), 2, 8, seed=30 + i) for i in range(3)]
    alone = [engine.sample("base", r) for r in good]
    vocab = engine.vocab_size
    out_of_vocab = SampleRequest(np.array([5, vocab + 7]), 1, 4, seed=1)
    nan_temperature = SampleRequest(prompt(9, 4), 1, 4, seed=1, temperature=float("nan"))
    # Its own temperature: rows drawn alike share one draw call, this one is drawn alone.
    faulty = SampleRequest(prompt(10, 8), 1, 8, seed=666, temperature=0.9)
    draw = engine._draw

    def failing_draw(logits, request, generators):
        if request.seed == 666:
            raise RuntimeError("injected fault in the draw of request 666")
        return draw(logits, request, generators)

    monkeypatch.setattr(engine, "_draw", failing_draw)
    failed_before = engine.failed_requests
    requests = [good[0], out_of_vocab, good[1], faulty, nan_temperature, good[2]]
    outputs, sizes = batched(engine, requests)
    assert max(sizes) >= 2, sizes
    assert isinstance(outputs[1], RequestError) and f"token id {vocab + 7}" in str(outputs[1])
    assert isinstance(outputs[4], RequestError) and "temperature" in str(outputs[4])
    assert isinstance(outputs[3], RuntimeError) and "request 666" in str(outputs[3])
    for a, b in zip(alone, [outputs[0], outputs[2], outputs[5]], strict=True):
        assert isinstance(b, SampleOutput), b
        assert_same(a, b)
    assert engine.failed_requests - failed_before == 3
    with pytest.raises(RequestError, match="vocabulary"):
        engine.sample("base", out_of_vocab)


def test_stops_and_max_tokens_hold_per_request_in_a_batch(engine):
    base = SampleRequest(prompt(40, 10), num_samples=1, max_tokens=24, seed=41)
    reference = engine.sample("base", base).sequences[0].tokens.tolist()
    stop_token = reference[3]
    text = engine.tokenizer.decode(reference)
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    requests = [
        base,
        SampleRequest(base.prompt, 1, 24, seed=41, stop_token_ids=(stop_token,)),
        SampleRequest(base.prompt, 1, 24, seed=41, stop_strings=(needle,)),
        SampleRequest(base.prompt, 2, 5, seed=41),
        SampleRequest(base.prompt, 1, 1, seed=41),
        SampleRequest(prompt(42, 30), 3, 40, seed=43, stop_token_ids=(int(reference[0]),)),
    ]
    outputs, sizes = batched(engine, requests)
    assert max(sizes) >= 3, sizes
    assert all(isinstance(o, SampleOutput) for o in outputs), outputs
    full, by_token, by_string, short, single, many = (o.sequences for o in outputs)
    assert full[0].tokens.tolist() == reference and full[0].stop_reason == "length"
    cut = reference.index(stop_token) + 1
    assert by_token[0].tokens.tolist() == reference[:cut] and by_token[0].stop_reason == "stop"
    tokens = by_string[0].tokens.tolist()
    assert by_string[0].stop_reason == "stop" and tokens == reference[: len(tokens)]
    assert needle in engine.tokenizer.decode(tokens)
    assert needle not in engine.tokenizer.decode(tokens[:-1])
    assert short[0].tokens.tolist() == reference[:5] and short[0].stop_reason == "length"
    assert len(short[1].tokens) == 5
    assert single[0].tokens.tolist() == reference[:1] and single[0].stop_reason == "length"
    for seq in many:
        assert len(seq.tokens) <= 40
        assert seq.stop_reason == ("stop" if seq.tokens[-1] == reference[0] else "length")
        assert reference[0] not in seq.tokens[:-1].tolist()
        assert len(seq.tokens) == 40 or seq.stop_reason == "stop"


def _join_on_first_draw(engine: TorchSamplerEngine, monkeypatch, act) -> None:
    """Run `act()` from inside the running batch, at its first draw: what `act` submits then
    arrives while the batch is mid-way, deterministically."""
    draw, fired = engine._draw, []

    def draw_then_act(logits, request, generators):
        if not fired:
            fired.append(True)
            act()
        return draw(logits, request, generators)

    monkeypatch.setattr(engine, "_draw", draw_then_act)


@pytest.mark.parametrize("name", ["dense", TINY_QWEN3_MOE, TINY_QWEN3_5_MOE])
def test_requests_join_a_running_batch_with_the_tokens_they_get_alone(
    name, tiny_model_path, monkeypatch
):
    """Requests that arrive while a batch runs are admitted between decode steps (longer and
    shorter prompts than the running cache, several samples, prompt logprobs, MoE routing, Gated
    DeltaNet state) and get what they get alone; a request finishing early is settled before the
    batch ends."""
    path = tiny_model_path if name == "dense" else build_tiny_model(named_tiny_specs()[name])
    engine = TorchSamplerEngine(path, threads=1)
    try:
        running = SampleRequest(prompt(50, 8), 2, 40, seed=51, stop_token_ids=())
        joiners = [
            SampleRequest(prompt(52, 45), 1, 12, seed=53, stop_token_ids=()),  # longer cache
            SampleRequest(prompt(54, 3), 3, 6, seed=55, temperature=0.8, stop_token_ids=()),
            SampleRequest(prompt(56, 9), 1, 9, seed=57, top_p=0.9, include_prompt_logprobs=True),
            SampleRequest(prompt(58, 20), 2, 50, seed=59, top_k=7, stop_token_ids=()),
        ]
        alone = [engine.sample("base", r) for r in [running, *joiners]]
        futures: list = []
        _join_on_first_draw(
            engine,
            monkeypatch,
            lambda: futures.extend(engine.submit_sample("base", r) for r in joiners),
        )
        joined_before, history = engine.joined_requests, len(engine.batch_history)
        first = engine.submit_sample("base", running)
        outputs = [first.result(timeout=TIMEOUT_S)]  # the joiners were submitted by then
        outputs += [f.result(timeout=TIMEOUT_S) for f in futures]
        assert engine.joined_requests - joined_before == len(joiners)
        # the batch's size is recorded as it ends, just after its last request is settled
        deadline = time.monotonic() + TIMEOUT_S
        while len(engine.batch_history) == history and time.monotonic() < deadline:
            time.sleep(0.001)
        assert list(engine.batch_history)[history:] == [1 + len(joiners)]
        for a, b in zip(alone, outputs, strict=True):
            assert_same(a, b)
            for x, y in zip(a.sequences, b.sequences, strict=True):
                if name == "dense":
                    assert x.routed_experts is None and y.routed_experts is None
                else:  # every fed position's experts, per layer
                    np.testing.assert_array_equal(x.routed_experts, y.routed_experts)
        np.testing.assert_allclose(alone[3].prompt_logprobs, outputs[3].prompt_logprobs, atol=1e-5)
        # The 6-token joiner was settled while the 40- and 50-token rows still ran.
        assert futures[1].done()
    finally:
        engine.close()


def test_a_waiting_weight_update_stops_admission(engine, monkeypatch):
    """While a weight update waits for the model, the running batch admits no one: it ends, the
    update lands, and what arrived meanwhile runs on the new weights (a stream of requests
    cannot hold weights off)."""
    import threading

    running = SampleRequest(prompt(60, 6), 1, 30, seed=61, stop_token_ids=())
    late = SampleRequest(prompt(62, 6), 1, 5, seed=63, stop_token_ids=())
    weights = {k: v.numpy() for k, v in engine.weight_sets["base"][0].items()}
    version = engine.version("base") + 1
    futures: list = []
    updater = threading.Thread(target=engine.set_weights, args=("base", weights, version))

    def update_then_submit() -> None:
        updater.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not engine._lock_waiters and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine._lock_waiters, "the weight update never started waiting"
        futures.append(engine.submit_sample("base", late))

    _join_on_first_draw(engine, monkeypatch, update_then_submit)
    joined_before = engine.joined_requests
    first = engine.submit_sample("base", running)
    assert first.result(timeout=TIMEOUT_S).version == version - 1
    assert futures[0].result(timeout=TIMEOUT_S).version == version
    updater.join(timeout=TIMEOUT_S)
    assert engine.joined_requests == joined_before


def test_a_request_on_another_weight_set_first_in_line_stops_admission(engine, monkeypatch):
    """Admission keeps arrival order across weight sets: while a request on another set is
    first in line, a later request on the running set does not overtake it by joining."""
    weights = {k: v.numpy() for k, v in engine.weight_sets["base"][0].items()}
    engine.set_weights("snapshot:other", weights, 1)
    running = SampleRequest(prompt(70, 6), 1, 30, seed=71, stop_token_ids=())
    other = SampleRequest(prompt(72, 6), 1, 5, seed=73, stop_token_ids=())
    late = SampleRequest(prompt(74, 6), 1, 5, seed=75, stop_token_ids=())
    alone = engine.sample("base", late)
    futures: list = []
    _join_on_first_draw(
        engine,
        monkeypatch,
        lambda: futures.extend(
            [engine.submit_sample("snapshot:other", other), engine.submit_sample("base", late)]
        ),
    )
    joined_before = engine.joined_requests
    engine.submit_sample("base", running).result(timeout=TIMEOUT_S)
    assert futures[0].result(timeout=TIMEOUT_S).version == 1
    assert_same(alone, futures[1].result(timeout=TIMEOUT_S))
    assert engine.joined_requests == joined_before
    engine.drop_weights("snapshot:other")
