"""Admission control for fully asynchronous RL: the one place staleness is decided.

`StalenessGate` owns the counters that bound how off-policy a trained group can be: the
optimizer step, the groups running (per policy version they started on), the groups accepted
into the training buffer and the groups consumed, plus the staleness histogram and the
violation count. Producers `acquire` before starting a group and `finish` or `cancel` after;
the consumer `consume`s B accepted groups per step and `advance`s after publishing weights.

Admission rule, and its departure from the textbook one. The usual rule (AReaL, SkyRL) lets a
group start while `accepted + running < (S + step + 1) * B`. With groups consumed in finish
order that does *not* bound staleness: a slow group started at version v can be overtaken by
groups started after `step` moved past v, which then fill the batches of steps v+1 ... v+S
(see `test_straggler_cannot_be_overtaken`). Here `step` in that rule is replaced by the
oldest version still running (`step` when nothing runs):

    start allowed  iff  accepted + running < (S + oldest_running_version + 1) * B

Invariant kept: for every running group g, `accepted + running <= (S + version(g) + 1) * B`.
When g is accepted, fewer than `(S + version(g) + 1) * B` groups were accepted before it, so
with B groups consumed per step in acceptance (finish) order g is consumed at a step
`<= version(g) + S`. The rule equals the textbook one whenever no running group is older than
the current step, running never exceeds `(S + 1) * B`, and it cannot deadlock: with nothing
running the consumer holds fewer than B unconsumed groups, so capacity is at least 1.

One broadcast condition. Transitions are plain methods (they run in `finally` blocks and in
cancelled producers, where awaiting is unsafe), and `asyncio.Condition.notify` needs its lock,
which only a coroutine can take. So the condition variable is an `asyncio.Event` used as a
broadcast: every transition sets it, every waiter re-checks `capacity()`. Single event loop
thread only.
"""

import asyncio
from collections import Counter


class StalenessGate:
    """Bounds staleness (consume step − start version) by S via admission control.

    Contract: each successful `acquire` is matched by exactly one `finish` or `cancel` with the
    version `acquire` returned; each step calls `consume(B, ...)` once, then `advance()` once.
    """

    def __init__(
        self,
        max_staleness: int,
        groups_per_step: int,
        start_step: int = 0,
        accepted_before: int | None = None,
    ) -> None:
        """`accepted_before`: groups accepted before `start_step` (resume); default
        `start_step * groups_per_step` (all consumed). Larger values mean accepted groups from
        before the resume still wait in the buffer and will be consumed first."""
        _require_int("max_staleness", max_staleness, minimum=0)
        _require_int("groups_per_step", groups_per_step, minimum=1)
        _require_int("start_step", start_step, minimum=0)
        consumed_before = start_step * groups_per_step
        if accepted_before is None:
            accepted_before = consumed_before
        _require_int("accepted_before", accepted_before, minimum=consumed_before)
        ceiling = (max_staleness + start_step + 1) * groups_per_step
        if accepted_before > ceiling:
            raise ValueError(
                f"accepted_before={accepted_before} exceeds (max_staleness + start_step + 1) * "
                f"groups_per_step = {ceiling}: more groups waiting than the gate could admit"
            )
        self._max_staleness = max_staleness
        self._groups_per_step = groups_per_step
        self._step = start_step
        self._accepted = accepted_before
        self._consumed = consumed_before
        self._consumed_this_step = False
        self._running_by_version: Counter[int] = Counter()
        self._histogram: Counter[int] = Counter()
        self._violations = 0
        self._last_batch: list[int] = []
        self._changed = asyncio.Event()  # the broadcast condition; see module docstring

    # -- read-only state ---------------------------------------------------------------------

    @property
    def max_staleness(self) -> int:
        return self._max_staleness

    @property
    def groups_per_step(self) -> int:
        return self._groups_per_step

    @property
    def step(self) -> int:
        """Optimizer steps done so far = the policy version a group starting now samples from."""
        return self._step

    @property
    def running(self) -> int:
        """Groups started and not yet finished or cancelled."""
        return self._running_by_version.total()

    @property
    def accepted(self) -> int:
        """Groups ever accepted into the training buffer (consumed or waiting)."""
        return self._accepted

    @property
    def consumed(self) -> int:
        """Groups ever taken by the consumer."""
        return self._consumed

    @property
    def violations(self) -> int:
        """Consumed groups whose staleness exceeded S (0 unless the consumer skips FIFO)."""
        return self._violations

    @property
    def histogram(self) -> dict[int, int]:
        """Consumed groups per staleness value (a copy)."""
        return dict(sorted(self._histogram.items()))

    def capacity(self) -> int:
        """How many more groups may start now."""
        return self._limit() - self._accepted - self.running

    def metrics(self) -> dict[str, float]:
        """Namespaced metrics for this step's log line (last consumed batch + cumulative)."""
        out: dict[str, float] = {
            "staleness/violations": float(self._violations),
            "staleness/running": float(self.running),
            "staleness/capacity": float(self.capacity()),
        }
        if self._last_batch:
            out["staleness/mean"] = sum(self._last_batch) / len(self._last_batch)
            out["staleness/max"] = float(max(self._last_batch))
        for staleness, count in sorted(self._histogram.items()):
            out[f"staleness/hist_{staleness}"] = float(count)
        return out

    # -- transitions -------------------------------------------------------------------------

    async def acquire(self, timeout: float | None) -> int:
        """Wait until a group may start, count it as running; return its policy version.

        Raises TimeoutError (= asyncio.TimeoutError) after `timeout` seconds; None waits forever.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
        async with asyncio.timeout(timeout):
            while self.capacity() <= 0:
                # Clearing is safe: capacity was just read after every earlier transition, and
                # waiters already woken by an earlier set() stay woken.
                self._changed.clear()
                await self._changed.wait()
        version = self._step
        self._running_by_version[version] += 1
        self._check()
        return version

    def finish(self, accepted: bool, version: int) -> None:
        """A group started on `version` finished: accepted into the buffer, or rejected
        (zero variance, masked), which frees its slot without counting it."""
        self._release("finish", version)
        if accepted:
            self._accepted += 1
        self._check()
        self._wake()

    def cancel(self, version: int) -> None:
        """A group started on `version` was abandoned (its task re-queued): frees its slot."""
        self._release("cancel", version)
        self._check()
        self._wake()

    def consume(self, n: int, start_versions: list[int]) -> list[int]:
        """The consumer takes `n` (= B) accepted groups for the current step.

        `start_versions` are the groups' start versions in the order taken. Returns their
        staleness (step − start version); records the histogram and violations (> S).
        """
        if n != self._groups_per_step:
            raise ValueError(
                f"n={n}: the gate's staleness bound assumes exactly groups_per_step="
                f"{self._groups_per_step} groups consumed per step"
            )
        if len(start_versions) != n:
            raise ValueError(f"start_versions has {len(start_versions)} entries, n={n}")
        for version in start_versions:
            if isinstance(version, bool) or not isinstance(version, int):
                raise ValueError(f"start_versions holds {version!r}, not an int version")
            if not 0 <= version <= self._step:
                raise ValueError(
                    f"start_versions holds {version}: a group cannot start on a version outside "
                    f"0..{self._step} (the current step)"
                )
        if self._consumed_this_step:
            raise RuntimeError(
                f"consume() called twice in step {self._step}; call advance() after each step"
            )
        waiting = self._accepted - self._consumed
        if n > waiting:
            raise RuntimeError(
                f"consume(n={n}) but only {waiting} accepted groups wait unconsumed: the consumer "
                "took groups that were never finish(accepted=True)-ed"
            )
        staleness = [self._step - version for version in start_versions]
        self._histogram.update(staleness)
        self._violations += sum(s > self._max_staleness for s in staleness)
        self._last_batch = staleness
        self._consumed += n
        self._consumed_this_step = True
        self._check()
        return staleness

    def advance(self) -> None:
        """The step's optim_step ran and its weights are published: step += 1, wake waiters."""
        if not self._consumed_this_step:
            raise RuntimeError(
                f"advance() in step {self._step} before consume(): the gate's bound assumes "
                "each step trains on exactly groups_per_step groups"
            )
        self._step += 1
        self._consumed_this_step = False
        self._check()
        self._wake()

    # -- internals ---------------------------------------------------------------------------

    def _limit(self) -> int:
        """Ceiling on accepted + running: (S + oldest running version + 1) * B."""
        oldest = min(self._running_by_version, default=self._step)
        return (self._max_staleness + oldest + 1) * self._groups_per_step

    def _release(self, transition: str, version: int) -> None:
        if self._running_by_version.get(version, 0) <= 0:
            running = dict(sorted(self._running_by_version.items()))
            raise RuntimeError(
                f"{transition}(version={version}) but no group is running on version {version} "
                f"(running per version: {running}); each acquire() takes one finish() or cancel()"
            )
        self._running_by_version[version] -= 1
        if self._running_by_version[version] == 0:
            del self._running_by_version[version]

    def _wake(self) -> None:
        # Only a transition that leaves room is worth waking every waiter for.
        if self.capacity() > 0:
            self._changed.set()

    def _check(self) -> None:
        """Invariants every transition keeps; a failure is a bug in the gate or its caller."""
        expected_consumed = (self._step + self._consumed_this_step) * self._groups_per_step
        problems = []
        if self._consumed != expected_consumed:
            problems.append(f"consumed={self._consumed} != {expected_consumed}")
        if self._consumed > self._accepted:
            problems.append(f"consumed={self._consumed} > accepted={self._accepted}")
        if self._accepted + self.running > self._limit():
            problems.append(
                f"accepted + running = {self._accepted + self.running} > limit {self._limit()}"
            )
        if problems:
            raise RuntimeError("StalenessGate invariant broken: " + "; ".join(problems))


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
