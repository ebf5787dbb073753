"""Trajectory records: one JSON object per trajectory, the unit every diagnostic counts.

`oneloop eval` writes one record per trajectory (its final attempt) to `trajectories.jsonl`;
`oneloop inspect` reads those back, or rebuilds records from a training run's Harbor trial
directories (`<run>/trials/*/result.json`, one record per attempt). Fields:

    task, task_path, category, sample, trial_name, step (sampler version; None outside training)
    outcome (TrialOutcome), reward (None when masked), masked, passed
    attempts, infra_attempts (attempts that ended in an infra error), error, attempt_errors
    agent_outcome, turns, repairs, context_warnings
    tokens: {prompt, sampled, observation, total}
    timings: TrialTimings as a dict (seconds)
    tool_calls: [{tool, server, arguments, status, result, sec, failed, failure}]
    segments: [{kind, trained, tokens, text, step_name}]   (trained = the loss mask: sampled
        tokens; a multi-step trial lists every step's segments in step order, `step_name` set)
    digest (the first sampled segment's TITO digest: joins the loop's logprob_gaps.jsonl rows)
    steps: the step names of a multi-step task ([] otherwise); turns, repairs, tool calls and
        timings are the sums over the steps (`oneloop.agents.trial_steps`)

A `task_config` outcome (a task refused before any trial) has 0 attempts and counts apart.

A tool call failed when the MCP status is not `ok` (the `is_error` flag, a timeout, an exception,
an unknown tool) or, for an `ok` call, when its result text matches one of the error patterns
(harness quirks such as a tool that prints a traceback but reports success).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from oneloop.agents.trial_steps import agent_view, phase_seconds, seconds
from oneloop.agents.trials import METADATA_TRAJECTORY, TrajectoryResult, TrialOutcome
from oneloop.errors import ConfigError

# Default error-text patterns: text no healthy tool returns on success.
DEFAULT_ERROR_PATTERNS = (r"Traceback \(most recent call last\)",)
UNCATEGORIZED = "uncategorized"
Decode = Callable[[Sequence[int]], str]


def compile_patterns(patterns: Iterable[str]) -> list[re.Pattern[str]]:
    """Compile error-text patterns; a bad one is a ConfigError naming it."""
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise ConfigError(f"--error-pattern {pattern!r}: not a valid regex ({exc})") from None
    return compiled


def call_failure(call: Mapping[str, Any], patterns: Sequence[re.Pattern[str]]) -> str | None:
    """Why a recorded tool call failed (`is_error`, `timeout`, ..., `pattern:<regex>`), or None."""
    status = call.get("status") or "unknown"
    if status != "ok":
        return str(status)
    text = call.get("result") or ""
    for pattern in patterns:
        if pattern.search(text):
            return f"pattern:{pattern.pattern}"
    return None


def task_metadata(task_dir: Path) -> dict[str, Any]:
    """The `[metadata]` table of a Harbor task's task.toml ({} when absent)."""
    path = Path(task_dir) / "task.toml"
    try:
        return dict(tomllib.loads(path.read_text()).get("metadata") or {})
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def task_category(task_dir: Path) -> str:
    return str(task_metadata(task_dir).get("category") or UNCATEGORIZED)


def _segments(
    trajectories: Sequence[Mapping[str, Any]], decode: Decode | None, steps: Sequence[str]
) -> list[dict]:
    out = []
    names: Sequence[str | None] = steps if len(steps) == len(trajectories) else [None] * len(
        trajectories
    )
    for trajectory, step_name in zip(trajectories, names, strict=True):
        for segment in trajectory.get("segments") or []:
            tokens = segment.get("tokens") or []
            row = {"kind": segment.get("kind"), "trained": segment.get("kind") == "sampled"}
            row["tokens"] = len(tokens)
            if decode is not None:
                row["text"] = decode(tokens)
            if step_name is not None:
                row["step_name"] = step_name
            out.append(row)
    return out


def _token_counts(segments: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    counts = {"prompt": 0, "sampled": 0, "observation": 0}
    for segment in segments:
        kind = segment["kind"] if segment["kind"] in counts else "observation"
        counts[kind] += segment["tokens"]
    return counts | {"total": sum(counts.values())}


def build_record(
    *,
    task: Path,
    sample: int,
    outcome: str,
    reward: float | None,
    attempts: int,
    error: str | None,
    attempt_errors: Sequence[str],
    trial_name: str,
    agent_stats: Mapping[str, Any] | None,
    trajectory: Mapping[str, Any] | None,
    timings: Mapping[str, float],
    patterns: Sequence[re.Pattern[str]],
    decode: Decode | None,
    pass_threshold: float,
    step: int | None = None,
    step_trajectories: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    stats = dict(agent_stats or {})
    trajectories = list(step_trajectories) or ([trajectory] if trajectory else [])
    steps = [str(s.get("step_name")) for s in stats.get("steps") or []]
    calls = []
    for call in stats.get("tool_calls") or []:
        failure = call_failure(call, patterns)
        calls.append(dict(call) | {"failed": failure is not None, "failure": failure})
    segments = _segments(trajectories, decode, steps)
    digests = [s.get("digest") for t in trajectories for s in t.get("segments") or []]
    digests = [d for d in digests if d]
    kind = TrialOutcome(outcome)
    masked = kind in (TrialOutcome.AGENT_TIMEOUT, TrialOutcome.TASK_CONFIG) or kind.infra
    infra = max(0, attempts - 1) + (1 if kind.infra else 0)
    return {
        "task": Path(task).name,
        "task_path": str(task),
        "category": task_category(Path(task)),
        "sample": sample,
        "trial_name": trial_name,
        "step": step,
        "outcome": str(outcome),
        "reward": reward,
        "masked": masked,
        "passed": (not masked) and reward is not None and reward >= pass_threshold,
        "attempts": attempts,
        "infra_attempts": infra,
        "error": error,
        "attempt_errors": list(attempt_errors),
        "agent_outcome": stats.get("outcome"),
        "turns": int(stats.get("turns") or 0),
        "repairs": int(stats.get("repairs") or 0),
        "context_warnings": int(stats.get("context_warnings") or 0),
        "tokens": _token_counts(segments),
        "timings": dict(timings),
        "tool_calls": calls,
        "segments": segments,
        "digest": digests[0] if digests else None,  # first sampled segment's (joins gap rows)
        "steps": steps,
    }


def record_from_result(
    result: TrajectoryResult,
    *,
    task: Path,
    sample: int,
    patterns: Sequence[re.Pattern[str]],
    decode: Decode | None,
    pass_threshold: float,
) -> dict[str, Any]:
    """The record of one trajectory the trial runner returned (final attempt + retry count)."""
    return build_record(
        task=task,
        sample=sample,
        outcome=result.outcome,
        reward=result.reward,
        attempts=result.attempts,
        error=result.error,
        attempt_errors=result.attempt_errors,
        trial_name=result.trial_name,
        agent_stats=result.agent_stats,
        trajectory=result.trajectory,
        step_trajectories=result.step_trajectories,
        timings=asdict(result.timings),
        patterns=patterns,
        decode=decode,
        pass_threshold=pass_threshold,
    )


def records_from_trials_dir(
    trials_dir: Path,
    *,
    patterns: Sequence[re.Pattern[str]],
    decode: Decode | None,
    pass_threshold: float,
) -> Iterator[dict[str, Any]]:
    """One record per Harbor trial directory (= one attempt), classified like the runner does.

    `step` is the sampler version the training loop passed to the agent (None for trials run
    outside the RL loop, e.g. its held-out evaluations).
    """
    from harbor.models.trial.result import TrialResult

    from oneloop.agents.trials import METADATA_TIMINGS, classify

    for path in sorted(Path(trials_dir).glob("*/result.json")):
        try:
            result = TrialResult.model_validate_json(path.read_text())
        except (OSError, ValueError):
            continue  # a trial still running or killed before Harbor wrote its result
        outcome, reward, error = classify(result, path.parent)
        view = agent_view(result, METADATA_TRAJECTORY)  # steps merged (multi-step tasks)
        metadata = view.metadata
        kwargs = result.config.agent.kwargs or {}
        agent_timings = metadata.get(METADATA_TIMINGS) or {}
        agent_sec, verifier_sec = phase_seconds(result)
        timings = {
            "env_start_sec": seconds(result.environment_setup),
            "agent_setup_sec": seconds(result.agent_setup),
            "agent_sec": agent_sec,
            "verifier_sec": verifier_sec,
            "total_sec": seconds(result),  # started_at .. finished_at of the whole trial
            **{k: float(v) for k, v in agent_timings.items()},
        }
        version = kwargs.get("sampler_version")
        yield build_record(
            task=Path(str(result.config.task.path)),
            sample=int(kwargs.get("seed") or 0),
            outcome=outcome,
            reward=reward,
            attempts=1,
            error=error,
            attempt_errors=(),
            trial_name=result.trial_name,
            agent_stats=metadata,
            trajectory=view.trajectories[0] if view.trajectories and not view.step_names else None,
            step_trajectories=view.trajectories if view.step_names else (),
            timings=timings,
            patterns=patterns,
            decode=decode,
            pass_threshold=pass_threshold,
            step=int(version) if version is not None else None,
        )


def write_records(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    with Path(path).open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not a JSON line ({exc})") from None
    return rows
