"""StalenessGate: each transition and error alone, plus a simulated async run (virtual clock)."""

import asyncio
import selectors
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oneloop.loop.staleness import StalenessGate

# -- a virtual-time event loop: asyncio.sleep advances a fake clock, never the wall clock ------


class Deadlock(AssertionError):
    """Every task is blocked and no timer is pending: the simulation can never finish."""


class _VirtualClockSelector(selectors.DefaultSelector):
    """The loop calls select(timeout) only when nothing is ready: jump the clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None):  # type: ignore[override]
        if timeout is None:
            raise Deadlock("every task waits and no timer is pending")
        self.now += max(timeout, 0.0)
        return super().select(0)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._clock = _VirtualClockSelector()
        super().__init__(selector=self._clock)

    def time(self) -> float:
        return self._clock.now


def run_virtual(coro):
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)


async def _started(task: asyncio.Task) -> None:
    """Let `task` run until it blocks (a few loop iterations, no time passes)."""
    for _ in range(5):
        await asyncio.sleep(0)


# -- construction --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_staleness": -1, "groups_per_step": 2}, "max_staleness"),
        ({"max_staleness": 1, "groups_per_step": 0}, "groups_per_step"),
        ({"max_staleness": True, "groups_per_step": 2}, "max_staleness"),
        ({"max_staleness": 1, "groups_per_step": 2.0}, "groups_per_step"),
        ({"max_staleness": 1, "groups_per_step": 2, "start_step": -1}, "start_step"),
        (
            {"max_staleness": 1, "groups_per_step": 2, "start_step": 3, "accepted_before": 5},
            "accepted_before",
        ),
        (
            {"max_staleness": 1, "groups_per_step": 2, "start_step": 3, "accepted_before": 11},
            "accepted_before",
        ),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        StalenessGate(**kwargs)


def test_fresh_gate_admits_s_plus_one_batches():
    gate = StalenessGate(max_staleness=2, groups_per_step=3)
    assert (gate.step, gate.running, gate.accepted, gate.consumed) == (0, 0, 0, 0)
    assert gate.capacity() == 9
    assert gate.histogram == {} and gate.violations == 0


def test_resume_counts_consumed_groups_and_waiting_ones():
    gate = StalenessGate(max_staleness=1, groups_per_step=2, start_step=5)
    assert (gate.step, gate.accepted, gate.consumed, gate.capacity()) == (5, 10, 10, 4)
    waiting = StalenessGate(max_staleness=1, groups_per_step=2, start_step=5, accepted_before=12)
    assert waiting.capacity() == 2
    assert waiting.consume(2, [4, 5]) == [1, 0]


# -- producer transitions -------------------------------------------------------------------


def test_acquire_returns_current_step_and_counts_running():
    async def main():
        gate = StalenessGate(max_staleness=0, groups_per_step=2)
        assert await gate.acquire(timeout=None) == 0
        assert (gate.running, gate.capacity()) == (1, 1)
        return gate

    run_virtual(main())


def test_finish_accepted_keeps_the_slot_and_counts_it():
    async def main():
        gate = StalenessGate(max_staleness=0, groups_per_step=2)
        version = await gate.acquire(timeout=None)
        gate.finish(accepted=True, version=version)
        assert (gate.running, gate.accepted, gate.capacity()) == (0, 1, 1)

    run_virtual(main())


def test_finish_rejected_and_cancel_free_the_slot_without_counting():
    async def main():
        gate = StalenessGate(max_staleness=0, groups_per_step=2)
        first = await gate.acquire(timeout=None)
        second = await gate.acquire(timeout=None)
        assert gate.capacity() == 0
        gate.finish(accepted=False, version=first)
        gate.cancel(version=second)
        assert (gate.running, gate.accepted, gate.capacity()) == (0, 0, 2)

    run_virtual(main())


@pytest.mark.parametrize("transition", ["finish", "cancel"])
def test_release_without_a_running_group_is_an_error(transition):
    gate = StalenessGate(max_staleness=1, groups_per_step=1)
    release = (lambda: gate.finish(True, 0)) if transition == "finish" else lambda: gate.cancel(0)
    with pytest.raises(RuntimeError, match=f"{transition}\\(version=0\\).*no group is running"):
        release()


def test_release_with_a_version_nothing_started_on_is_an_error():
    async def main():
        gate = StalenessGate(max_staleness=1, groups_per_step=1)
        await gate.acquire(timeout=None)
        with pytest.raises(RuntimeError, match="version=3"):
            gate.finish(accepted=True, version=3)
        assert gate.running == 1  # the failed call changed nothing

    run_virtual(main())


def test_acquire_times_out_on_the_virtual_clock():
    async def main():
        gate = StalenessGate(max_staleness=0, groups_per_step=1)
        await gate.acquire(timeout=None)
        loop = asyncio.get_running_loop()
        with pytest.raises(asyncio.TimeoutError):
            await gate.acquire(timeout=30.0)
        assert loop.time() == pytest.approx(30.0)
        with pytest.raises(TimeoutError):
            await gate.acquire(timeout=0)
        assert gate.running == 1  # timed-out waiters took no slot

    run_virtual(main())


def test_acquire_rejects_a_negative_timeout():
    gate = StalenessGate(max_staleness=0, groups_per_step=1)
    with pytest.raises(ValueError, match="timeout"):
        run_virtual(gate.acquire(timeout=-1.0))


def test_waiters_wake_on_finish_rejected_and_on_advance():
    async def main():
        gate = StalenessGate(max_staleness=0, groups_per_step=1)
        version = await gate.acquire(timeout=None)
        waiter = asyncio.create_task(gate.acquire(timeout=None), name="waiter")
        await _started(waiter)
        assert not waiter.done()
        gate.finish(accepted=False, version=version)  # frees the slot
        assert await waiter == 0
        gate.finish(accepted=True, version=0)
        late = asyncio.create_task(gate.acquire(timeout=None), name="late")
        await _started(late)
        gate.consume(1, [0])
        assert not late.done()  # consuming opens no slot: the bound moves with the step
        gate.advance()
        assert await late == 1

    run_virtual(main())


def test_a_cancelled_waiter_leaks_no_slot():
    async def main():
        gate = StalenessGate(max_staleness=0, groups_per_step=1)
        version = await gate.acquire(timeout=None)
        waiter = asyncio.create_task(gate.acquire(timeout=None), name="waiter")
        await _started(waiter)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gate.cancel(version)
        assert (gate.running, gate.capacity()) == (0, 1)

    run_virtual(main())


# -- consumer transitions -------------------------------------------------------------------


async def _accepted_groups(gate: StalenessGate, count: int) -> list[int]:
    versions = [await gate.acquire(timeout=0) for _ in range(count)]
    for version in versions:
        gate.finish(accepted=True, version=version)
    return versions


def test_consume_returns_staleness_and_records_the_histogram():
    async def main():
        gate = StalenessGate(max_staleness=1, groups_per_step=2)
        versions = await _accepted_groups(gate, 4)
        assert gate.consume(2, versions[:2]) == [0, 0]
        gate.advance()
        assert gate.consume(2, versions[2:]) == [1, 1]
        gate.advance()
        assert (gate.consumed, gate.violations, gate.histogram) == (4, 0, {0: 2, 1: 2})
        metrics = gate.metrics()
        assert metrics["staleness/max"] == 1.0 and metrics["staleness/mean"] == 1.0
        assert metrics["staleness/hist_0"] == 2.0 and metrics["staleness/violations"] == 0.0
        assert all(key.startswith("staleness/") for key in metrics)

    run_virtual(main())


def test_consume_records_a_violation_when_the_consumer_skips_fifo():
    async def main():
        gate = StalenessGate(max_staleness=0, groups_per_step=1)
        await _accepted_groups(gate, 1)
        gate.consume(1, [0])
        gate.advance()
        await _accepted_groups(gate, 1)
        # The consumer claims a version-0 group at step 1: staleness 1 > S = 0.
        assert gate.consume(1, [0]) == [1]
        assert gate.violations == 1 and gate.histogram == {0: 1, 1: 1}

    run_virtual(main())


def test_consume_more_than_accepted_is_an_error():
    async def main():
        gate = StalenessGate(max_staleness=1, groups_per_step=2)
        await _accepted_groups(gate, 1)
        with pytest.raises(RuntimeError, match="only 1 accepted groups wait"):
            gate.consume(2, [0, 0])
        assert gate.consumed == 0

    run_virtual(main())


@pytest.mark.parametrize(
    ("n", "versions", "match"),
    [
        (1, [0], "n=1"),
        (2, [0], "start_versions has 1"),
        (2, [0, 1], "outside 0..0"),
        (2, [0, -1], "outside 0..0"),
        (2, [0, "0"], "not an int"),
    ],
)
def test_consume_rejects_bad_arguments(n, versions, match):
    async def main():
        gate = StalenessGate(max_staleness=1, groups_per_step=2)
        await _accepted_groups(gate, 2)
        with pytest.raises(ValueError, match=match):
            gate.consume(n, versions)

    run_virtual(main())


def test_consume_twice_in_one_step_is_an_error():
    async def main():
        gate = StalenessGate(max_staleness=1, groups_per_step=1)
        await _accepted_groups(gate, 2)
        gate.consume(1, [0])
        with pytest.raises(RuntimeError, match="twice in step 0"):
            gate.consume(1, [0])

    run_virtual(main())


def test_advance_before_consume_is_an_error():
    gate = StalenessGate(max_staleness=1, groups_per_step=1)
    with pytest.raises(RuntimeError, match="before consume"):
        gate.advance()
    assert gate.step == 0


def test_straggler_cannot_be_overtaken():
    """Regression: with the textbook rule `accepted + running < (S + step + 1) * B`, a slow group
    started at version 0 (S=1, B=1) is overtaken at step 1 by a group started there, and is
    consumed at step 2 or later (staleness > S). The gate must hold new starts until it ends."""

    async def main():
        gate = StalenessGate(max_staleness=1, groups_per_step=1)
        straggler = await gate.acquire(timeout=0)
        fast = await gate.acquire(timeout=0)
        gate.finish(accepted=True, version=fast)
        gate.consume(1, [fast])
        gate.advance()
        # Textbook capacity here: (1 + 1 + 1) * 1 - 1 accepted - 1 running = 1.
        assert gate.capacity() == 0
        with pytest.raises(TimeoutError):
            await gate.acquire(timeout=0)
        gate.finish(accepted=True, version=straggler)
        assert gate.consume(1, [straggler]) == [1]
        gate.advance()
        assert gate.capacity() == 2

    run_virtual(main())


# -- simulated fully-async run --------------------------------------------------------------


@dataclass
class SimResult:
    steps_done: int = 0
    peak_running: int = 0
    staleness: list[int] = field(default_factory=list)
    groups_started: int = 0


async def _simulate(
    *,
    max_staleness: int,
    groups_per_step: int,
    steps: int,
    producers: int,
    seed: int,
    heavy_tail: str,
    tail: float,
    reject_p: float,
    cancel_p: float,
    train_time: float,
    start_step: int,
) -> tuple[StalenessGate, SimResult]:
    rng = np.random.default_rng(seed)
    gate = StalenessGate(max_staleness, groups_per_step, start_step=start_step)
    finished: asyncio.Queue[int] = asyncio.Queue()
    result = SimResult()

    def duration() -> float:
        if heavy_tail == "pareto":
            return float(rng.pareto(tail) + 1.0)
        return float(rng.lognormal(0.0, tail))

    async def producer() -> None:
        while True:
            version = await gate.acquire(timeout=None)
            result.groups_started += 1
            result.peak_running = max(result.peak_running, gate.running)
            await asyncio.sleep(duration())
            outcome = rng.random()
            if outcome < cancel_p:
                gate.cancel(version)
            elif outcome < cancel_p + reject_p:
                gate.finish(accepted=False, version=version)
            else:
                gate.finish(accepted=True, version=version)
                finished.put_nowait(version)

    tasks = [asyncio.create_task(producer(), name=f"producer-{i}") for i in range(producers)]
    try:
        for step in range(start_step, start_step + steps):
            versions = [await finished.get() for _ in range(groups_per_step)]  # finish order
            staleness = gate.consume(groups_per_step, versions)
            assert staleness == [step - v for v in versions]
            result.staleness.extend(staleness)
            await asyncio.sleep(train_time)
            gate.advance()
            result.steps_done += 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return gate, result


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_staleness=st.integers(0, 3),
    groups_per_step=st.integers(1, 4),
    steps=st.integers(1, 8),
    producer_factor=st.floats(0.25, 3.0),
    seed=st.integers(0, 2**32 - 1),
    heavy_tail=st.sampled_from(["pareto", "lognormal"]),
    tail=st.floats(0.6, 2.5),
    reject_p=st.floats(0.0, 0.6),
    cancel_p=st.floats(0.0, 0.2),
    train_time=st.floats(0.0, 5.0),
    start_step=st.integers(0, 3),
)
def test_simulated_async_run_never_exceeds_staleness_or_deadlocks(
    max_staleness,
    groups_per_step,
    steps,
    producer_factor,
    seed,
    heavy_tail,
    tail,
    reject_p,
    cancel_p,
    train_time,
    start_step,
):
    bound = (max_staleness + 1) * groups_per_step
    producers = max(1, round(producer_factor * bound))
    gate, result = run_virtual(
        _simulate(
            max_staleness=max_staleness,
            groups_per_step=groups_per_step,
            steps=steps,
            producers=producers,
            seed=seed,
            heavy_tail=heavy_tail,
            tail=tail,
            reject_p=reject_p,
            cancel_p=cancel_p,
            train_time=train_time,
            start_step=start_step,
        )
    )
    # A Deadlock from the virtual clock would have failed run_virtual: the run completed.
    assert result.steps_done == steps
    assert gate.step == start_step + steps
    assert len(result.staleness) == steps * groups_per_step
    assert gate.violations == 0
    assert max(result.staleness) <= max_staleness
    if max_staleness == 0:
        assert set(result.staleness) == {0}
    assert result.peak_running <= bound
    assert sum(gate.histogram.values()) == steps * groups_per_step


def test_simulation_detects_a_deadlock():
    """The virtual clock's deadlock check itself can fail: a consumer waiting for groups nobody
    produces is reported, not hung."""

    async def main():
        await asyncio.Queue().get()

    with pytest.raises(Deadlock):
        run_virtual(main())


def test_simulation_fills_the_pipeline():
    """Admission is not over-strict: with many producers and no stragglers at the start, all
    (S + 1) * B slots fill."""
    gate, result = run_virtual(
        _simulate(
            max_staleness=2,
            groups_per_step=3,
            steps=4,
            producers=20,
            seed=1,
            heavy_tail="lognormal",
            tail=0.1,
            reject_p=0.0,
            cancel_p=0.0,
            train_time=0.0,
            start_step=0,
        )
    )
    assert result.peak_running == 9
    assert gate.violations == 0
