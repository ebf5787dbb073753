"""The request store (long poll, failures, expiry) and per-model seq_id ordering."""

import asyncio
import json

import numpy as np
import pytest
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from oneloop.backends.megatron_local.serve.request_store import (
    FutureStore,
    Job,
    ModelSequencer,
    Outcome,
    SeenIds,
    digest,
)
from oneloop.backends.megatron_local.serve.wire import failed_future_body
from oneloop.errors import RequestError, WireError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _store(clock=None) -> FutureStore:
    return FutureStore(
        result_ttl_s=100.0,
        delivered_ttl_s=10.0,
        failure_body=lambda m, c: json.dumps(failed_future_body(m, c)).encode(),
        **({"clock": clock} if clock else {}),
    )


def _ok(value: str) -> Outcome:
    return Outcome(value.encode(), "application/json")


def test_long_poll_is_pending_then_returns_the_result():
    async def main():
        store = _store()
        rid = store.new("OptimStep")
        gate = asyncio.Event()

        async def work():
            await gate.wait()
            return "done"

        store.start(rid, work(), _ok)
        assert await store.wait(rid, 0.01) is None  # still running: the route answers 408
        gate.set()
        outcome = await store.wait(rid, 5.0)
        assert outcome == _ok("done")
        assert store.stats() == {"pending": 0, "undelivered": 0, "delivered": 1, "running_tasks": 0}

    asyncio.run(main())


def test_failures_carry_error_and_category():
    async def main():
        store = _store()
        user, server = store.new("X"), store.new("Y")

        async def bad_request():
            raise RequestError("data[0]: bad")

        async def crash():
            raise RuntimeError("engine exploded")

        store.start(user, bad_request(), _ok)
        store.start(server, crash(), _ok)
        u = json.loads((await store.wait(user, 5.0)).body)
        s = json.loads((await store.wait(server, 5.0)).body)
        assert u == {"error": "RequestError: data[0]: bad", "category": "user"}
        assert s["category"] == "server" and "engine exploded" in s["error"]
        assert types.RequestFailedResponse.model_validate(u).category == "user"

    asyncio.run(main())


def test_unknown_and_expired_requests():
    async def main():
        clock = Clock()
        store = _store(clock)
        with pytest.raises(WireError) as unknown:
            await store.wait("req-nope", 0.01)
        assert unknown.value.status == 404
        delivered, forgotten = store.new("A"), store.new("B")
        store.resolve(delivered, _ok("1"))
        store.resolve(forgotten, _ok("2"))
        await store.wait(delivered, 0.01)
        clock.now = 10.0  # the delivered one goes after delivered_ttl_s
        assert store.sweep() == 1
        assert await store.wait(forgotten, 0.01) == _ok("2")  # a retried poll still works
        with pytest.raises(WireError) as gone:
            await store.wait(delivered, 0.01)
        assert gone.value.status == 410  # the SDK then resends the original request
        clock.now = 150.0  # results are dropped result_ttl_s after completion, delivered or not
        assert store.sweep() == 1
        with pytest.raises(WireError) as expired:
            await store.wait(forgotten, 0.01)
        assert expired.value.status == 410

    asyncio.run(main())


def test_cancel_fails_the_request():
    async def main():
        store = _store()
        rid = store.new("Sample")
        store.start(rid, asyncio.sleep(3600), _ok)
        await asyncio.sleep(0)
        assert store.cancel(rid)
        outcome = await store.wait(rid, 5.0)
        assert outcome.failed and json.loads(outcome.body)["error"] == "cancelled"

    asyncio.run(main())


def test_seen_ids_retry_and_conflict():
    seen = SeenIds("model m", capacity=2)
    assert seen.lookup(1, "a") is None
    seen.add(1, "a", "req-1")
    assert seen.lookup(1, "a") == "req-1"
    with pytest.raises(WireError) as conflict:
        seen.lookup(1, "b")
    assert conflict.value.status == 409 and conflict.value.retry is False
    assert digest(b"x", "y") == digest(b"x", "y") != digest(b"xy")


class RecordingClient:
    """A training client that records the order in which requests were submitted to it."""

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def run(self, name: str) -> AwaitableConcurrentFuture[str]:
        from concurrent.futures import Future

        self.submitted.append(name)
        done: Future[str] = Future()
        done.set_result(f"result of {name}")
        return AwaitableConcurrentFuture(done)


def _sequencer(store, client_future):
    return ModelSequencer(
        "s:train:0", store, client_future, submit_timeout_s=30.0, result_timeout_s=30.0
    )


def _job_for(name):
    return lambda rid: Job(rid, lambda client: client.run(name), _ok)


def test_chunks_arriving_out_of_order_run_in_seq_order():
    async def main():
        store = _store()
        client = RecordingClient()
        ready = asyncio.get_running_loop().create_future()
        ready.set_result(client)
        seq = _sequencer(store, ready)
        r3 = seq.offer(3, "d3", "ForwardBackward", _job_for("chunk3"))
        r2 = seq.offer(2, "d2", "ForwardBackward", _job_for("chunk2"))
        await asyncio.sleep(0.05)
        assert client.submitted == []  # seq_id 1 has not arrived: nothing may run
        assert await store.wait(r3, 0.01) is None
        r1 = seq.offer(1, "d1", "ForwardBackward", _job_for("chunk1"))
        outcomes = [await store.wait(r, 10.0) for r in (r1, r2, r3)]
        assert client.submitted == ["chunk1", "chunk2", "chunk3"]
        assert [o.body for o in outcomes] == [
            b"result of chunk1",
            b"result of chunk2",
            b"result of chunk3",
        ]
        # A retried request gets the original future; a different payload is a 409.
        assert seq.offer(2, "d2", "ForwardBackward", _job_for("again")) == r2
        with pytest.raises(WireError) as conflict:
            seq.offer(2, "other", "ForwardBackward", _job_for("other"))
        assert conflict.value.status == 409
        assert client.submitted == ["chunk1", "chunk2", "chunk3"]
        await seq.close()

    asyncio.run(main())


def test_requests_wait_for_model_creation_and_fail_if_it_fails():
    async def main():
        store = _store()
        creating = asyncio.get_running_loop().create_future()
        seq = _sequencer(store, creating)
        rid = seq.offer(1, "d", "OptimStep", _job_for("step"))
        assert await store.wait(rid, 0.01) is None
        creating.set_exception(RuntimeError("no such base model"))
        outcome = await store.wait(rid, 10.0)
        assert outcome.failed and "no such base model" in json.loads(outcome.body)["error"]
        await seq.close()

    asyncio.run(main())


def test_a_request_whose_predecessor_never_arrives_fails():
    async def main():
        store = _store()
        ready = asyncio.get_running_loop().create_future()
        ready.set_result(RecordingClient())
        seq = _sequencer(store, ready)
        rid = seq.offer(2, "d", "OptimStep", _job_for("late"))
        assert seq.fail_stale_gaps(max_wait_s=0.0) == 1
        outcome = await store.wait(rid, 1.0)
        assert outcome.failed and "never arrived" in json.loads(outcome.body)["error"]
        with pytest.raises(WireError) as ahead:
            seq.offer(10**9, "x", "OptimStep", _job_for("far"))
        assert ahead.value.status == 400
        await seq.close()

    asyncio.run(main())


def test_fixed_weights_sample_on_another_version_fails_instead_of_mislabelling():
    """A snapshot/path/base sampler is acked before it runs, with its creation version in the
    sequence ids; a result that ran on another version must fail the request, not go out
    under ids that claim the wrong version."""
    from oneloop.backends.megatron_local.serve.codec.sample_versions import check_fixed_version

    def response(*ids: str) -> types.SampleResponse:
        return types.SampleResponse(sequences=[
            types.SampledSequence(stop_reason="length", sequence_id=i, tokens_np=np.array([1]))
            for i in ids
        ])  # fmt: skip

    check_fixed_version(response("s/v2/0", "s/v2/1"), 2, "s")
    check_fixed_version(response("not-versioned"), 2, "s")  # nothing to compare
    with pytest.raises(RuntimeError, match=r"sequences\[1\].*version 2.*version 3"):
        check_fixed_version(response("s/v2/0", "s/v3/1"), 2, "s")
