"""Rollout producers: prompt groups run through the trial runner with the current sampling client.

`RolloutPool` owns the producer tasks and the queue of finished, accepted groups. Each producer:
take a task → wait for the staleness gate → run a group of n trials (bounded by a timeout) →
score it → hand it to the consumer or drop it (masked, zero variance), always telling the gate.
A group that times out or fails is cancelled, its task re-queued, and the event counted; a dead
producer re-raises in the consumer (`take` checks the tasks). The loop publishes each new
sampling client with `publish`; groups start on the newest one.

No silent waits. While `take` waits it reports a `WaitProgress` (groups finished, dropped for
zero variance, masked, in flight, seconds waited) every `progress_every_s`. A policy that solves
all or none of its tasks gives groups with no reward variance, which are dropped and never reach
the trainer; after `max_zero_variance_in_a_row` such groups with none accepted between them the
pool stops the run with `NoTrainableGroupsError` (the counts, and what to check first).
"""

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from oneloop.agents.tito import Trajectory
from oneloop.agents.trials import GroupResult, TrialRunner
from oneloop.errors import OneloopError
from oneloop.loop.advantages import ScoredGroup, has_variance
from oneloop.loop.data import TaskItem, TaskSource, sample_seed
from oneloop.loop.metrics import gateway_counts
from oneloop.loop.staleness import StalenessGate

log = logging.getLogger(__name__)

WARN_DROPPED_FRACTION = 0.75
"""A wait's progress report warns when more than this share of the groups finished during it were
dropped for zero variance (at least `WARN_MIN_GROUPS` of them): sampling then costs over 4× what
the trainer consumes, and a share that stays this high usually ends at the stop bound."""
WARN_MIN_GROUPS = 4


@dataclass
class RolloutStats:
    """Counters of every rollout event, reset by `drain_metrics` each step."""

    counts: Counter[str] = field(default_factory=Counter)
    rewards: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    llm_sec: float = 0.0
    env_sec: float = 0.0
    sampled_tokens: int = 0


@dataclass(frozen=True)
class WaitProgress:
    """Where the consumer's wait for a step's groups stands (`RolloutPool.take`'s report).
    `finished`, `accepted`, `zero_variance` and `masked` count groups since the wait began;
    `zero_variance_in_a_row` counts dropped groups since the last accepted one (any wait)."""

    waited_s: float
    ready: int
    """Groups taken so far of the `wanted`."""
    wanted: int
    finished: int
    accepted: int
    zero_variance: int
    masked: int
    in_flight: int
    zero_variance_in_a_row: int

    @property
    def dropped_fraction(self) -> float:
        """Share of the groups finished since the wait began dropped for zero variance."""
        return self.zero_variance / self.finished if self.finished else 0.0


class NoTrainableGroupsError(OneloopError, RuntimeError):
    """Too many rollout groups in a row had no reward variance: nothing reaches the trainer."""


class RolloutPool:
    """Producers feeding finished groups to the consumer under the staleness gate."""

    def __init__(
        self,
        runner: TrialRunner,
        source: TaskSource,
        gate: StalenessGate,
        *,
        group_size: int,
        producers: int,
        filter_zero_variance: bool,
        group_timeout_s: float,
        seed: int,
        max_failures_in_a_row: int = 20,
        max_zero_variance_in_a_row: int | None = None,
    ) -> None:
        """`max_zero_variance_in_a_row`: stop after this many groups in a row are dropped for
        zero reward variance (`algo.max_zero_variance_in_a_row`); None = never."""
        self.runner = runner
        self.source = source
        self.gate = gate
        self.group_size = group_size
        self.filter_zero_variance = filter_zero_variance
        self.group_timeout_s = group_timeout_s
        self.seed = seed
        self.ready: asyncio.Queue[ScoredGroup] = asyncio.Queue()
        self.stats = RolloutStats()
        self.in_flight = 0
        self._client: Any = None
        self._version = 0
        self._published = asyncio.Event()
        self.failures_in_a_row = 0
        self.max_failures_in_a_row = max_failures_in_a_row
        self.zero_variance_in_a_row = 0
        self.max_zero_variance_in_a_row = max_zero_variance_in_a_row
        self._verdict: NoTrainableGroupsError | None = None  # the bound's, once reached
        self.totals: Counter[str] = Counter()
        """Groups over the whole run: finished, accepted, zero_variance, masked (never reset)."""
        self._started = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._produce(), name=f"rollout-producer-{i}")
            for i in range(producers)
        ]

    def publish(self, client: Any, version: int) -> None:
        """Groups starting from now use `client` (weights of step `version`)."""
        self._client, self._version = client, version
        self._published.set()

    async def take(
        self,
        n: int,
        timeout: float,
        *,
        report: Callable[[WaitProgress], None] | None = None,
        progress_every_s: float = 30.0,
    ) -> list[ScoredGroup]:
        """The next `n` accepted groups in finish order; re-raises a dead producer's error.
        While it waits, `report` gets a `WaitProgress` every `progress_every_s` seconds."""
        groups: list[ScoredGroup] = []
        started = time.monotonic()
        deadline = started + timeout
        next_report = started + progress_every_s
        at_start = self.totals.copy()
        while len(groups) < n:
            self._check_producers()
            now = time.monotonic()
            if report is not None and now >= next_report:
                report(self.progress(now - started, len(groups), n, at_start))
                next_report = now + progress_every_s
            remaining = deadline - now
            if remaining <= 0:
                got = self.progress(now - started, len(groups), n, at_start)
                raise TimeoutError(
                    f"waited {timeout:.0f}s for {n} rollout groups, got {len(groups)} "
                    f"(timeouts.wait_for_rollouts_s); meanwhile {describe(got)}"
                )
            poll = min(remaining, 5.0, max(next_report - now, 0.01) if report else 5.0)
            try:
                groups.append(await asyncio.wait_for(self.ready.get(), poll))
            except TimeoutError:
                continue
        return groups

    def progress(
        self, waited_s: float, ready: int, wanted: int, since: Counter[str]
    ) -> WaitProgress:
        """The counts since `since` (a copy of `totals` taken when the wait began)."""
        delta = self.totals - since
        return WaitProgress(
            waited_s=waited_s,
            ready=ready,
            wanted=wanted,
            finished=delta["finished"],
            accepted=delta["accepted"],
            zero_variance=delta["zero_variance"],
            masked=delta["masked"],
            in_flight=self.in_flight,
            zero_variance_in_a_row=self.zero_variance_in_a_row,
        )

    def _check_producers(self) -> None:
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                error = task.exception()
                if isinstance(error, NoTrainableGroupsError):
                    raise error  # the run's verdict, not a crash: its message says it all
                raise RuntimeError(f"{task.get_name()} died") from error

    async def close(self, timeout: float = 30.0) -> None:
        """Cancel producers (in-flight groups are abandoned: their tasks are re-run on resume)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.wait(self._tasks, timeout=timeout)

    def drain_metrics(self) -> dict[str, float]:
        stats, self.stats = self.stats, RolloutStats()
        out: dict[str, float] = {f"rollout/{k}": float(v) for k, v in stats.counts.items()}
        out.update({f"rollout/outcome_{k}": float(v) for k, v in stats.outcomes.items()})
        if stats.rewards:
            out["rollout/reward_mean"] = sum(stats.rewards) / len(stats.rewards)
            out["rollout/success_rate"] = sum(r > 0 for r in stats.rewards) / len(stats.rewards)
        out["rollout/in_flight"] = float(self.in_flight)
        out["rollout/sampled_tokens"] = float(stats.sampled_tokens)
        out["time/rollout_llm_s"] = stats.llm_sec
        out["time/rollout_env_s"] = stats.env_sec
        return out

    def _requeue(self, item: TaskItem) -> None:
        if not self.source.requeue(item):
            self.stats.counts["tasks_dropped"] += 1
            log.warning(
                "task %s (%s) failed %d times; dropped",
                item.sample_id,
                item.task,
                self.source.max_attempts,
            )

    def _note_failure(self, result: GroupResult) -> None:
        """Masked groups are re-run, but a harness that fails every time must stop the run."""
        self.failures_in_a_row += 1
        if self.failures_in_a_row >= self.max_failures_in_a_row:
            errors = [r.error for r in result.results if r.error]
            raise RuntimeError(
                f"{self.failures_in_a_row} rollout groups in a row were masked "
                f"({result.mask_reason}); last error: {errors[-1] if errors else 'none recorded'}"
            )

    def _note_zero_variance(self) -> None:
        """A policy that solves all or none of its tasks trains nothing: stop, don't wait."""
        self.zero_variance_in_a_row += 1
        bound = self.max_zero_variance_in_a_row
        if self._verdict is not None:  # every producer stops with the first verdict
            raise self._verdict
        if bound is None or self.zero_variance_in_a_row < bound:
            return
        totals = self.totals
        self._verdict = NoTrainableGroupsError(
            f"algo.max_zero_variance_in_a_row: {self.zero_variance_in_a_row} rollout groups in a "
            "row were dropped because every trial of the group got the same reward (no "
            f"variance, no advantage to train on); in {time.monotonic() - self._started:.0f} s "
            f"{totals['finished']} groups finished: {totals['zero_variance']} dropped for zero "
            f"variance, {totals['accepted']} accepted, {totals['masked']} masked; "
            f"{self.in_flight} in flight. The policy solves all or none of these tasks: run "
            "`oneloop eval` on them first (Pass@k per task), then adjust the tasks, the "
            "warm start (sft) or agent.temperature; or raise the bound"
        )
        raise self._verdict

    # -- one producer ----------------------------------------------------------------------------

    async def _produce(self) -> None:
        await self._published.wait()
        while True:
            # Admission first, then the task: tasks are handed out in admission order, so a
            # step's batch is the same sample ids however long producers waited.
            version = await self.gate.acquire(timeout=None)
            item = self.source.next()
            client = self._client
            self.in_flight += 1
            try:
                result = await asyncio.wait_for(
                    self._run(item, client, version), timeout=self.group_timeout_s
                )
            except TimeoutError:
                self.stats.counts["group_timeouts"] += 1
                log.warning("rollout group for %s timed out; re-queued", item.sample_id)
                self._requeue(item)
                self.gate.cancel(version)
                continue
            except Exception as error:  # noqa: BLE001 - classified, counted, re-queued
                self.stats.counts["group_errors"] += 1
                log.warning("rollout group for %s failed (%s); re-queued", item.sample_id, error)
                self._requeue(item)
                self.gate.cancel(version)
                self.failures_in_a_row += 1
                if self.failures_in_a_row >= self.max_failures_in_a_row:
                    raise
                continue
            finally:
                self.in_flight -= 1
            self._accept_or_drop(item, result, version)

    async def _run(self, item: TaskItem, client: Any, version: int) -> GroupResult:
        seed = sample_seed(item.sample_id, self.seed)
        per_trial = [
            {"seed": seed + 7_777 * i, "sampler_version": version} for i in range(self.group_size)
        ]
        return await self.runner.run_group(
            item.task, self.group_size, client, agent_kwargs=per_trial
        )

    def _accept_or_drop(self, item: TaskItem, result: GroupResult, version: int) -> None:
        stats = self.stats
        stats.counts["groups_finished"] += 1
        self.totals["finished"] += 1
        for trial in result.results:
            stats.outcomes[str(trial.outcome)] += 1
            stats.counts.update(gateway_counts(trial.agent_stats))
            stats.llm_sec += trial.timings.llm_sec
            stats.env_sec += trial.timings.env_start_sec + trial.timings.verifier_sec
        if result.masked:
            stats.counts[f"groups_masked_{result.mask_reason}"] += 1
            self.totals["masked"] += 1
            self._requeue(item)
            self.gate.finish(accepted=False, version=version)
            self._note_failure(result)
            return
        self.failures_in_a_row = 0
        # A single masked trajectory (e.g. one agent timeout) leaves the group; the rest trains.
        kept = [r for r in result.results if not r.masked and r.trajectories]
        stats.counts["trajectories_masked"] += len(result.results) - len(kept)
        rewards = [float(r.reward or 0.0) for r in kept]
        stats.rewards.extend(rewards)
        # A trial may hold several trajectories (a multi-step task's steps, agents/trial_steps.py;
        # a gateway session's segments after a history rewrite): each trains with its trial's
        # reward, and advantages count each trial once (ScoredGroup.trials).
        trials = [([Trajectory.from_json(t) for t in r.trajectories], float(r.reward or 0.0))
                  for r in kept]  # fmt: skip
        group = ScoredGroup.of_trials(item.sample_id, result.task, version, trials)
        if len(kept) < 2 or (self.filter_zero_variance and not has_variance(rewards)):
            stats.counts["groups_zero_variance"] += 1
            self.totals["zero_variance"] += 1
            self.source.mark_consumed([item.sample_id])  # seen, no signal: never re-run
            self.gate.finish(accepted=False, version=version)
            self._note_zero_variance()
            return
        self.totals["accepted"] += 1
        self.zero_variance_in_a_row = 0
        stats.sampled_tokens += sum(t.num_sampled_tokens for t in group.trajectories)
        self.gate.finish(accepted=True, version=version)
        self.ready.put_nowait(group)


def describe(progress: WaitProgress) -> str:
    """`progress` as the words of a console line."""
    return (
        f"{progress.finished} groups finished ({progress.zero_variance} dropped for zero "
        f"variance, {progress.masked} masked, {progress.accepted} accepted), "
        f"{progress.in_flight} in flight"
    )


def report_wait(step: int, progress: WaitProgress, console: bool, bound: int | None) -> None:
    """The loop's `take` report: a progress line while step `step` waits for its groups (stdout
    when `console`, else the log), and a warning while most finished groups are dropped for zero
    variance (`bound`: `algo.max_zero_variance_in_a_row`)."""
    line = (
        f"step {step} waiting {progress.waited_s:.0f}s for groups: {progress.ready}/"
        f"{progress.wanted} ready; {describe(progress)}"
    )
    if console:
        print(line, flush=True)
    else:
        log.info(line)
    if progress.finished >= WARN_MIN_GROUPS and progress.dropped_fraction > WARN_DROPPED_FRACTION:
        log.warning(
            "%d of the %d groups finished while step %d waits were dropped for zero reward "
            "variance (the policy solves all or none of them); %d in a row so far, the run stops "
            "at %s (algo.max_zero_variance_in_a_row); check the policy with `oneloop eval`",
            progress.zero_variance,
            progress.finished,
            step,
            progress.zero_variance_in_a_row,
            bound if bound is not None else "no bound",
        )
