"""Rollout producers: prompt groups run through the trial runner with the current sampling client.

`RolloutPool` owns the producer tasks and the queue of finished, accepted groups. Each producer:
take a task → wait for the staleness gate → run a group of n trials (bounded by a timeout) →
score it → hand it to the consumer or drop it (masked, zero variance), always telling the gate.
A group that times out or fails is cancelled, its task re-queued, and the event counted; a dead
producer re-raises in the consumer (`take` checks the tasks). The loop publishes each new
sampling client with `publish`; groups start on the newest one.
"""

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from oneloop.agents.tito import Trajectory
from oneloop.agents.trials import GroupResult, TrialRunner
from oneloop.loop.advantages import ScoredGroup, has_variance
from oneloop.loop.data import TaskItem, TaskSource, sample_seed
from oneloop.loop.staleness import StalenessGate

log = logging.getLogger(__name__)


@dataclass
class RolloutStats:
    """Counters of every rollout event, reset by `drain_metrics` each step."""

    counts: Counter[str] = field(default_factory=Counter)
    rewards: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    llm_sec: float = 0.0
    env_sec: float = 0.0
    sampled_tokens: int = 0


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
    ) -> None:
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
        self._tasks = [
            asyncio.create_task(self._produce(), name=f"rollout-producer-{i}")
            for i in range(producers)
        ]

    def publish(self, client: Any, version: int) -> None:
        """Groups starting from now use `client` (weights of step `version`)."""
        self._client, self._version = client, version
        self._published.set()

    async def take(self, n: int, timeout: float) -> list[ScoredGroup]:
        """The next `n` accepted groups in finish order; re-raises a dead producer's error."""
        groups: list[ScoredGroup] = []
        deadline = time.monotonic() + timeout
        while len(groups) < n:
            self._check_producers()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"waited {timeout:.0f}s for {n} rollout groups, got {len(groups)} "
                    "(timeouts.wait_for_rollouts_s)"
                )
            try:
                groups.append(await asyncio.wait_for(self.ready.get(), min(remaining, 5.0)))
            except TimeoutError:
                continue
        return groups

    def _check_producers(self) -> None:
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"{task.get_name()} died") from task.exception()

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
        for trial in result.results:
            stats.outcomes[str(trial.outcome)] += 1
            stats.llm_sec += trial.timings.llm_sec
            stats.env_sec += trial.timings.env_start_sec + trial.timings.verifier_sec
        if result.masked:
            stats.counts[f"groups_masked_{result.mask_reason}"] += 1
            self._requeue(item)
            self.gate.finish(accepted=False, version=version)
            self._note_failure(result)
            return
        self.failures_in_a_row = 0
        # A single masked trajectory (e.g. one agent timeout) leaves the group; the rest trains.
        kept = [r for r in result.results if not r.masked and r.trajectory is not None]
        stats.counts["trajectories_masked"] += len(result.results) - len(kept)
        rewards = [float(r.reward or 0.0) for r in kept]
        stats.rewards.extend(rewards)
        trajectories = tuple(Trajectory.from_json(r.trajectory) for r in kept)
        if len(kept) < 2 or (self.filter_zero_variance and not has_variance(rewards)):
            stats.counts["groups_zero_variance"] += 1
            self.source.mark_consumed([item.sample_id])  # seen, no signal: never re-run
            self.gate.finish(accepted=False, version=version)
            return
        stats.sampled_tokens += sum(t.num_sampled_tokens for t in trajectories)
        self.gate.finish(accepted=True, version=version)
        self.ready.put_nowait(
            ScoredGroup(item.sample_id, result.task, version, trajectories, tuple(rewards))
        )
