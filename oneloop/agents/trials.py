"""The trial runner: one Harbor trial per trajectory, each in its own Ray task, classified.

This module owns running a prompt group (n trials of one task) and the failure policy:

* each trial is one `harbor.trial.Trial` (`await Trial.create(cfg)`, `await trial.run()`) inside
  its own Ray task, so MCP clients and stdio servers live in a worker process of their own; the
  sampling client travels as a Ray task argument and is published to the agent through
  `oneloop.agents.registry.register_sampler(key, client)` (Harbor's config cannot carry it);
* a concurrency cap (trials running at once) and a rate limit (trials started per second) are
  shared by every group the runner runs;
* outcomes (`TrialOutcome`):
  `ok` → the verifier's reward;
  `truncated` (the agent's metadata says context overflow or a length-capped turn without a tool
  call) → reward 0, tokens kept for training;
  `agent_timeout` → masked, and 2 or more in a group mask the whole group;
  `infra_error` (environment start, MCP connect, missing reward, any exception, a lost Ray task)
  → retried with a fresh trial up to `max_infra_retries` times, then the whole group is masked;
  `mcp_server_crash` (a stdio MCP server that had connected exited nonzero during the trial: the
  agent may have carried on without its tools) → an infrastructure failure of its own class,
  counted apart and handled like `infra_error` (`TrialOutcome.infra`);
  `task_config` (the environment cannot run the task: `oneloop.agents.tasks_check`, checked before
  a group's first trial) → no trial runs, never retried, the group is masked, counted apart.

Multi-step tasks (Harbor's `step_results`) are read through `oneloop.agents.trial_steps`: counts
and phase times are the steps' sums, and each step's trajectory is kept (`step_trajectories`).

Contract with the agent (`AgentContext.metadata`, all optional): `METADATA_OUTCOME` (a string;
`TRUNCATION_OUTCOMES` count as truncated), `METADATA_TRAJECTORY` (the TITO trajectory as a JSON
dict, returned untouched), `METADATA_TIMINGS` (seconds: `llm_sec`, `tool_sec`, `mcp_connect_sec`).
"""

from __future__ import annotations

import asyncio
import json
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import ray

from oneloop.agents.environment import NO_CONTAINER_IMPORT_PATH, STDIO_EXIT_PREFIX
from oneloop.agents.providers import check_environment_choice, preflight_environment
from oneloop.agents.trial_steps import agent_view, phase_seconds, step_exception
from oneloop.errors import ConfigError

MCP_AGENT_IMPORT_PATH = "oneloop.agents.mcp_agent:McpToolAgent"
METADATA_OUTCOME = "outcome"
METADATA_TRAJECTORY = "tito"
METADATA_TIMINGS = "timings"
AGENT_KINDS = ("mcp", "openai_gateway")
TRUNCATION_OUTCOMES = frozenset({"context_overflow", "length_cap"})
INFRA_OUTCOMES = frozenset({"infra_error"})
# Harbor raises this (asyncio.TimeoutError subclass) when the agent phase runs past its timeout.
AGENT_TIMEOUT_EXCEPTION = "AgentTimeoutError"
# The driver waits this much longer than the in-task trial timeout before it kills the Ray task;
# the in-task timeout lets Harbor stop the environment, the kill does not.
RAY_GRACE_SEC = 60.0
ERROR_TEXT_CHARS = 4000


class TrialOutcome(StrEnum):
    OK = "ok"
    TRUNCATED = "truncated"
    AGENT_TIMEOUT = "agent_timeout"
    INFRA_ERROR = "infra_error"
    MCP_SERVER_CRASH = "mcp_server_crash"
    # The task cannot run in the chosen environment (`oneloop.agents.tasks_check`): refused
    # before any trial, never retried, counted on its own; it masks its group.
    TASK_CONFIG = "task_config"

    @property
    def infra(self) -> bool:
        """An infrastructure failure: retried with a fresh trial, then it masks the group."""
        return self in (TrialOutcome.INFRA_ERROR, TrialOutcome.MCP_SERVER_CRASH)


class MaskReason(StrEnum):
    INFRA = "infra_error_after_retries"
    AGENT_TIMEOUTS = "agent_timeouts"
    TASK_CONFIG = "task_config"


@dataclass(frozen=True)
class TrialTimings:
    """Seconds spent in each phase of one attempt (0 where a phase did not run)."""

    queue_sec: float = 0.0  # waiting for the concurrency cap and the rate limit
    env_start_sec: float = 0.0
    agent_setup_sec: float = 0.0
    agent_sec: float = 0.0  # the whole agent phase: llm + tools + the agent's own work
    llm_sec: float = 0.0  # from the agent's metadata
    tool_sec: float = 0.0  # from the agent's metadata
    mcp_connect_sec: float = 0.0  # from the agent's metadata
    verifier_sec: float = 0.0
    total_sec: float = 0.0  # Ray task start to result, this attempt


@dataclass(frozen=True)
class TrajectoryResult:
    """One trajectory's final result (after retries)."""

    outcome: TrialOutcome
    reward: float | None  # None when masked
    trajectory: Mapping[str, Any] | None  # the agent's TITO trajectory JSON, as it wrote it
    timings: TrialTimings
    error: str | None
    attempts: int
    trial_name: str
    agent_outcome: str | None = None
    agent_stats: Mapping[str, Any] | None = None  # the agent's metadata minus the trajectory
    attempt_errors: tuple[str, ...] = ()  # errors of earlier attempts (infra errors: they retry)
    # Multi-step tasks: one TITO trajectory per step, in step order (`trial_steps` says why);
    # `trajectory` is then None. Single-step: empty.
    step_trajectories: tuple[Mapping[str, Any], ...] = ()

    @property
    def masked(self) -> bool:
        masking = (TrialOutcome.AGENT_TIMEOUT, TrialOutcome.TASK_CONFIG)
        return self.outcome.infra or self.outcome in masking

    @property
    def trajectories(self) -> tuple[Mapping[str, Any], ...]:
        """Every trajectory of this trial: the steps' (multi-step), or the one (single-step)
        after the segments a gateway session closed before it (an agent that rewrote its
        history: each segment is its own exact TITO trajectory)."""
        if self.step_trajectories:
            return self.step_trajectories
        if self.trajectory is None:
            return ()
        from oneloop.agents.gateway.trial import METADATA_GATEWAY

        gateway = (self.agent_stats or {}).get(METADATA_GATEWAY) or {}
        return (*gateway.get("earlier_segments", ()), self.trajectory)


@dataclass(frozen=True)
class GroupResult:
    task: str
    results: tuple[TrajectoryResult, ...]
    mask_reason: MaskReason | None

    @property
    def masked(self) -> bool:
        return self.mask_reason is not None

    @property
    def rewards(self) -> tuple[float | None, ...]:
        return tuple(r.reward for r in self.results)


@dataclass(frozen=True)
class TrialRunnerConfig:
    """How trials are built and run. Agent: `agent_name` (Harbor built-in, e.g. "oracle") or
    `agent_import_path` (default: oneloop's MCP tool agent)."""

    trials_dir: Path  # Harbor writes one directory per trial here
    agent_import_path: str | None = MCP_AGENT_IMPORT_PATH
    agent_name: str | None = None
    agent_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # "mcp": the agent samples token ids itself (sampler_key); "openai_gateway": the agent
    # speaks /chat/completions to a per-trial gateway session (oneloop.agents.gateway.trial).
    agent_kind: str = "mcp"
    environment_import_path: str | None = NO_CONTAINER_IMPORT_PATH
    # A Harbor environment type (docker, modal, daytona, ...); set it with import_path None.
    environment_type: str | None = None
    environment_kwargs: Mapping[str, Any] = field(default_factory=dict)
    verifier_import_path: str | None = None  # None: the task's tests/test.sh
    verifier_kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_concurrent_trials: int = 16  # trials running at once, over all groups
    trials_per_second: float = 8.0  # trial starts per second, over all groups
    trial_timeout_sec: float = 900.0  # a whole trial, enforced inside its Ray task
    agent_timeout_sec: float | None = None  # overrides the task's [agent].timeout_sec
    max_infra_retries: int = 2  # fresh trials after an infra error, per trajectory
    agent_timeouts_to_mask_group: int = 2
    ray_num_cpus: float = 0.0  # Ray CPUs reserved per trial task (the cap above still applies)
    ray_max_calls: int = 0  # >0: a fresh worker process after this many trials (0: reuse)
    delete_environment: bool = True

    def __post_init__(self) -> None:
        if (self.agent_name is None) == (self.agent_import_path is None):
            raise ConfigError("trials: set exactly one of agent_name and agent_import_path")
        check_environment_choice(self.environment_type, self.environment_import_path, "trials")
        if self.agent_kind not in AGENT_KINDS:
            raise ConfigError(f"trials.agent_kind: expected one of {AGENT_KINDS}, "
                              f"got {self.agent_kind!r}")  # fmt: skip
        checks = (
            ("max_concurrent_trials", self.max_concurrent_trials >= 1),
            ("trials_per_second", self.trials_per_second > 0),
            ("trial_timeout_sec", self.trial_timeout_sec > 0),
            ("agent_timeout_sec", self.agent_timeout_sec is None or self.agent_timeout_sec > 0),
            ("max_infra_retries", self.max_infra_retries >= 0),
            ("agent_timeouts_to_mask_group", self.agent_timeouts_to_mask_group >= 1),
            ("ray_num_cpus", self.ray_num_cpus >= 0),
            ("ray_max_calls", self.ray_max_calls >= 0),
        )
        for name, ok in checks:
            if not ok:
                raise ConfigError(f"trials.{name}: invalid value {getattr(self, name)!r}")


# ----------------------------------------------------------------------------------------------
# Inside the Ray task
# ----------------------------------------------------------------------------------------------


def _seconds(timing: Any) -> float:
    if timing is None or timing.started_at is None or timing.finished_at is None:
        return 0.0
    return max(0.0, (timing.finished_at - timing.started_at).total_seconds())


def _error_text(exception_type: str, message: str, tb: str = "") -> str:
    text = f"{exception_type}: {message}"
    if tb:
        text += "\n" + tb
    return text[:ERROR_TEXT_CHARS]


def _crashed_stdio_servers(trial_dir: Path | None) -> list[str]:
    """Exit records the no-container environment leaves for stdio servers that exited nonzero."""
    if trial_dir is None:
        return []
    records = sorted((trial_dir / "agent").glob(f"{STDIO_EXIT_PREFIX}*.txt"))
    return [record.read_text().strip() for record in records]


def classify(
    harbor_result: Any, trial_dir: Path | None = None
) -> tuple[TrialOutcome, float | None, str | None]:
    """(outcome, reward, error) of one Harbor `TrialResult` under this module's policy.

    `trial_dir` (Harbor's directory of this trial) lets a stdio MCP server that crashed
    mid-trial count as `mcp_server_crash` even when the agent carried on without its tools (one
    that never came up fails the agent's connect: an exception, so `infra_error`).
    """
    view = agent_view(harbor_result, METADATA_TRAJECTORY)
    metadata = view.metadata
    info = step_exception(harbor_result)
    if info is not None:
        error = _error_text(info.exception_type, info.exception_message)
        if info.exception_type == AGENT_TIMEOUT_EXCEPTION:
            return TrialOutcome.AGENT_TIMEOUT, None, error
        return TrialOutcome.INFRA_ERROR, None, error
    crashed = _crashed_stdio_servers(trial_dir)
    if crashed:
        error = "MCP stdio server exited mid-trial: " + "; ".join(crashed)
        return TrialOutcome.MCP_SERVER_CRASH, None, error
    if metadata.get(METADATA_OUTCOME) in INFRA_OUTCOMES:
        return TrialOutcome.INFRA_ERROR, None, f"agent reported {metadata[METADATA_OUTCOME]}"
    if view.missing:  # a step's agent ran and left nothing to train on
        return TrialOutcome.INFRA_ERROR, None, f"steps {list(view.missing)} reported no trajectory"
    if metadata.get(METADATA_OUTCOME) in TRUNCATION_OUTCOMES:
        return TrialOutcome.TRUNCATED, 0.0, None
    verifier = harbor_result.verifier_result
    if verifier is None or not verifier.rewards:
        return TrialOutcome.INFRA_ERROR, None, "no verifier result (verifier disabled or lost)"
    rewards = verifier.rewards
    if "reward" in rewards:
        value = rewards["reward"]
    elif len(rewards) == 1:
        value = next(iter(rewards.values()))
    else:
        return TrialOutcome.INFRA_ERROR, None, f"reward.json has no 'reward' key: {rewards}"
    return TrialOutcome.OK, float(value), None


def _trial_config(spec: dict[str, Any], trial_name: str, sampler_key: str | None) -> Any:
    from harbor.models.trial.config import (
        AgentConfig,
        EnvironmentConfig,
        TaskConfig,
        TrialConfig,
        VerifierConfig,
    )

    kwargs = dict(spec["agent_kwargs"])
    if sampler_key is not None:
        kwargs["sampler_key"] = sampler_key
    return TrialConfig(
        task=TaskConfig(path=Path(spec["task"])),
        trial_name=trial_name,
        trials_dir=Path(spec["trials_dir"]),
        agent=AgentConfig(
            name=spec["agent_name"],
            import_path=spec["agent_import_path"],
            model_name=spec.get("model_name"),
            env=dict(spec.get("agent_env") or {}),
            kwargs=kwargs,
            override_timeout_sec=spec["agent_timeout_sec"],
        ),
        environment=EnvironmentConfig(
            type=spec["environment_type"],
            import_path=spec["environment_import_path"],
            kwargs=dict(spec["environment_kwargs"]),
            delete=spec["delete_environment"],
        ),
        verifier=VerifierConfig(
            import_path=spec["verifier_import_path"], kwargs=dict(spec["verifier_kwargs"])
        ),
    )


async def run_one_trial(spec: dict[str, Any], sampling_client: Any) -> TrajectoryResult:
    """One Harbor trial for `spec` (the runner's per-trial dict) in the calling event loop; every
    failure comes back as a `TrajectoryResult` with its outcome class, never as an exception."""
    from harbor.trial.trial import Trial

    started = time.monotonic()
    trial_name = f"{Path(spec['task']).name}__{uuid.uuid4().hex[:10]}"
    sampler_key = gateway = None
    if spec.get("agent_kind") == "openai_gateway":
        from oneloop.agents.gateway.trial import MODEL_NAME, GatewayTrial

        gateway = GatewayTrial(dict(spec["agent_kwargs"]), sampling_client, trial_name)
        spec = {**spec, "model_name": f"openai/{MODEL_NAME}"}
    elif sampling_client is not None:
        from oneloop.agents.registry import register_sampler, unregister_sampler

        sampler_key = f"trial-{trial_name}"
        register_sampler(sampler_key, sampling_client)
    try:
        if gateway is not None:
            spec = {**spec, "agent_kwargs": gateway.start(), "agent_env": gateway.env}
        trial = await asyncio.wait_for(
            Trial.create(_trial_config(spec, trial_name, sampler_key)), timeout=60.0
        )
        result = await asyncio.wait_for(trial.run(), timeout=spec["trial_timeout_sec"])
        if gateway is not None:
            gateway.finish(result)
    except Exception as exc:  # every failure is a value; see TrialOutcome
        return TrajectoryResult(
            outcome=TrialOutcome.INFRA_ERROR,
            reward=None,
            trajectory=None,
            timings=TrialTimings(total_sec=time.monotonic() - started),
            error=_error_text(type(exc).__name__, str(exc), traceback.format_exc()),
            attempts=1,
            trial_name=trial_name,
        )
    finally:
        if sampler_key is not None:
            unregister_sampler(sampler_key)
        if gateway is not None:
            gateway.stop()
    outcome, reward, error = classify(result, Path(spec["trials_dir"]) / trial_name)
    view = agent_view(result, METADATA_TRAJECTORY)  # steps merged (multi-step tasks)
    metadata = view.metadata
    agent_timings = metadata.get(METADATA_TIMINGS) or {}
    stats = metadata or None
    agent_sec, verifier_sec = phase_seconds(result)
    return TrajectoryResult(
        outcome=outcome,
        reward=reward,
        trajectory=view.trajectories[0] if view.trajectories and not view.step_names else None,
        step_trajectories=view.trajectories if view.step_names else (),
        timings=TrialTimings(
            env_start_sec=_seconds(result.environment_setup),
            agent_setup_sec=_seconds(result.agent_setup),
            agent_sec=agent_sec,
            llm_sec=float(agent_timings.get("llm_sec", 0.0)),
            tool_sec=float(agent_timings.get("tool_sec", 0.0)),
            mcp_connect_sec=float(agent_timings.get("mcp_connect_sec", 0.0)),
            verifier_sec=verifier_sec,
            total_sec=time.monotonic() - started,
        ),
        error=error,
        attempts=1,
        trial_name=trial_name,
        agent_outcome=(
            str(metadata[METADATA_OUTCOME])
            if metadata.get(METADATA_OUTCOME) is not None
            else None
        ),
        agent_stats=stats,
    )


def _trial_task(spec: dict[str, Any], sampling_client: Any) -> TrajectoryResult:
    """Body of the Ray task: its own event loop, one trial."""
    import oneloop  # noqa: F401  (sets Harbor's offline defaults in this worker)

    return asyncio.run(run_one_trial(spec, sampling_client))


# ----------------------------------------------------------------------------------------------
# Driver side
# ----------------------------------------------------------------------------------------------


class _RateLimiter:
    """Spaces trial starts at least `1 / rate` seconds apart."""

    def __init__(self, rate: float) -> None:
        self._interval = 1.0 / rate
        self._next = 0.0
        self._lock = asyncio.Lock()

    async def wait(self) -> None:
        async with self._lock:
            now = time.monotonic()
            delay = self._next - now
            self._next = max(now, self._next) + self._interval
        if delay > 0:
            await asyncio.sleep(delay)


class TrialRunner:
    """Runs groups of trials under one concurrency cap and rate limit; counts every class.

    `counters()` keys: `trials/attempts_<outcome>` (every attempt), `trials/final_<outcome>`
    (after retries), `trials/retries`, `groups/total`, `groups/masked_<reason>`.
    """

    def __init__(self, cfg: TrialRunnerConfig) -> None:
        # Before any trial: a missing SDK, credential or daemon is one error, not one per trial.
        preflight_environment(cfg.environment_type, cfg.environment_import_path, "trials")
        self.cfg = cfg
        # The cap and the rate limiter belong to one event loop; `_limits` makes them anew when a
        # later `asyncio.run` drives the same runner (the counters carry over).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._semaphore = asyncio.Semaphore(cfg.max_concurrent_trials)
        self._rate = _RateLimiter(cfg.trials_per_second)
        self._counts: Counter[str] = Counter()
        self._refused: dict[Path, str | None] = {}
        self._spec_base = {
            "trials_dir": str(Path(cfg.trials_dir).absolute()),
            "agent_name": cfg.agent_name,
            "agent_import_path": cfg.agent_import_path,
            "agent_kwargs": dict(cfg.agent_kwargs),
            "agent_kind": cfg.agent_kind,
            "agent_timeout_sec": cfg.agent_timeout_sec,
            "environment_import_path": cfg.environment_import_path,
            "environment_type": cfg.environment_type,
            "environment_kwargs": dict(cfg.environment_kwargs),
            "verifier_import_path": cfg.verifier_import_path,
            "verifier_kwargs": dict(cfg.verifier_kwargs),
            "trial_timeout_sec": cfg.trial_timeout_sec,
            "delete_environment": cfg.delete_environment,
        }
        self._remote = ray.remote(
            num_cpus=cfg.ray_num_cpus, max_retries=0, max_calls=cfg.ray_max_calls
        )(_trial_task)

    def counters(self) -> dict[str, int]:
        keys = [f"trials/attempts_{o}" for o in TrialOutcome]
        keys += [f"trials/final_{o}" for o in TrialOutcome]
        keys += ["trials/retries", "groups/total"] + [f"groups/masked_{r}" for r in MaskReason]
        return {key: self._counts[key] for key in keys}

    def _limits(self) -> tuple[asyncio.Semaphore, _RateLimiter]:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop = loop
            self._semaphore = asyncio.Semaphore(self.cfg.max_concurrent_trials)
            self._rate = _RateLimiter(self.cfg.trials_per_second)
        return self._semaphore, self._rate

    async def _attempt(
        self, task: str, sampling_client: Any, extra_kwargs: Mapping[str, Any]
    ) -> TrajectoryResult:
        queued = time.monotonic()
        spec = {**self._spec_base, "task": task}
        spec["agent_kwargs"] = {**spec["agent_kwargs"], **extra_kwargs}
        semaphore, rate = self._limits()
        async with semaphore:
            await rate.wait()
            queue_sec = time.monotonic() - queued
            ref = self._remote.remote(spec, sampling_client)
            try:
                result: TrajectoryResult = await asyncio.wait_for(
                    ref, timeout=self.cfg.trial_timeout_sec + RAY_GRACE_SEC
                )
            except Exception as exc:  # lost worker, Ray error, or the task outlived its grace
                ray.cancel(ref, force=True)
                result = TrajectoryResult(
                    outcome=TrialOutcome.INFRA_ERROR,
                    reward=None,
                    trajectory=None,
                    timings=TrialTimings(),
                    error=_error_text(type(exc).__name__, str(exc)),
                    attempts=1,
                    trial_name="",
                )
        self._counts[f"trials/attempts_{result.outcome}"] += 1
        return replace(result, timings=replace(result.timings, queue_sec=queue_sec))

    async def _trajectory(
        self, task: str, sampling_client: Any, extra_kwargs: Mapping[str, Any]
    ) -> TrajectoryResult:
        errors: list[str] = []
        for attempt in range(1, self.cfg.max_infra_retries + 2):
            result = await self._attempt(task, sampling_client, extra_kwargs)
            if not result.outcome.infra:
                break
            if attempt <= self.cfg.max_infra_retries:
                self._counts["trials/retries"] += 1
                errors.append(result.error or "")
        result = replace(result, attempts=attempt, attempt_errors=tuple(errors))
        self._counts[f"trials/final_{result.outcome}"] += 1
        return result

    async def run_group(
        self,
        task: Path | str,
        n: int,
        sampling_client: Any,
        agent_kwargs: Sequence[Mapping[str, Any]] | None = None,
    ) -> GroupResult:
        """Run `n` trials of the task directory `task` with the given sampling client.

        `agent_kwargs`, if given, holds one mapping per trial merged over the config's agent
        kwargs (e.g. a per-trial sampling seed and the sampler version).
        """
        if agent_kwargs is not None and len(agent_kwargs) != n:
            raise ConfigError(
                f"agent_kwargs: expected {n} mappings (one per trial), got {len(agent_kwargs)}"
            )
        task_path = Path(task).absolute()
        if not (task_path / "task.toml").is_file():
            raise ConfigError(f"task={str(task)!r} is not a Harbor task directory (no task.toml)")
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"n must be a positive integer, got {n!r}")
        if not ray.is_initialized():
            raise ConfigError("Ray is not initialized; call ray.init(...) before run_group")
        if (refused := self._refused_group(task_path, n)) is not None:
            return refused  # no trial can run it: never retried
        results = tuple(
            await asyncio.gather(
                *(
                    self._trajectory(str(task_path), sampling_client, extra)
                    for extra in (agent_kwargs or [{}] * n)
                )
            )
        )
        outcomes = Counter(r.outcome for r in results)
        mask_reason = None
        if any(outcome.infra for outcome in outcomes):
            mask_reason = MaskReason.INFRA
        elif outcomes[TrialOutcome.AGENT_TIMEOUT] >= self.cfg.agent_timeouts_to_mask_group:
            mask_reason = MaskReason.AGENT_TIMEOUTS
        self._counts["groups/total"] += 1
        if mask_reason is not None:
            self._counts[f"groups/masked_{mask_reason}"] += 1
        return GroupResult(task=str(task_path), results=results, mask_reason=mask_reason)


    def _refused_group(self, task_path: Path, n: int) -> GroupResult | None:
        """`n` task_config results when the environment cannot run the task (`tasks_check`,
        cached per task), else None."""
        if task_path not in self._refused:
            from oneloop.agents.tasks_check import check_task, is_container_free

            free = is_container_free(self.cfg.environment_type, self.cfg.environment_import_path)
            self._refused[task_path] = "; ".join(check_task(task_path, free)) or None
        if (reason := self._refused[task_path]) is None:
            return None
        result = TrajectoryResult(
            TrialOutcome.TASK_CONFIG, None, None, TrialTimings(), f"task refused: {reason}", 0, ""
        )
        self._counts[f"trials/final_{TrialOutcome.TASK_CONFIG}"] += n
        self._counts["groups/total"] += 1
        self._counts[f"groups/masked_{MaskReason.TASK_CONFIG}"] += 1
        return GroupResult(str(task_path), (result,) * n, MaskReason.TASK_CONFIG)


_RUNNERS: dict[str, TrialRunner] = {}


def _config_key(cfg: TrialRunnerConfig) -> str:
    def default(value: Any) -> Any:
        return str(value) if isinstance(value, Path | datetime) else repr(value)

    return json.dumps(asdict(cfg), sort_keys=True, default=default)


def runner_for(cfg: TrialRunnerConfig) -> TrialRunner:
    """The process-wide runner of this config (one cap and one rate limit per config)."""
    key = _config_key(cfg)
    if key not in _RUNNERS:
        _RUNNERS[key] = TrialRunner(cfg)
    return _RUNNERS[key]


async def run_group(
    task: Path | str, n: int, sampling_client: Any, cfg: TrialRunnerConfig
) -> GroupResult:
    """Run `n` trials of `task` through the shared runner of `cfg`; see `TrialRunner`."""
    return await runner_for(cfg).run_group(task, n, sampling_client)
