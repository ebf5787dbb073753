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
    segments: [{kind, trained, tokens, text}]   (trained = the loss mask: sampled tokens)
    digest (the first sampled segment's TITO digest: joins the loop's logprob_gaps.jsonl rows)

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


def _segments(trajectory: Mapping[str, Any] | None, decode: Decode | None) -> list[dict]:
    if not trajectory:
        return []
    out = []
    for segment in trajectory.get("segments") or []:
        tokens = segment.get("tokens") or []
        row = {"kind": segment.get("kind"), "trained": segment.get("kind") == "sampled"}
        row["tokens"] = len(tokens)
        if decode is not None:
            row["text"] = decode(tokens)
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
) -> dict[str, Any]:
    stats = dict(agent_stats or {})
    calls = []
    for call in stats.get("tool_calls") or []:
        failure = call_failure(call, patterns)
        calls.append(dict(call) | {"failed": failure is not None, "failure": failure})
    segments = _segments(trajectory, decode)
    digests = [s.get("digest") for s in (trajectory or {}).get("segments") or [] if s.get("digest")]
    masked = outcome == TrialOutcome.AGENT_TIMEOUT or TrialOutcome(outcome).infra
    infra = (attempts - 1) + (1 if TrialOutcome(outcome).infra else 0)
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
        metadata = (result.agent_result.metadata or {}) if result.agent_result else {}
        kwargs = result.config.agent.kwargs or {}
        agent_timings = metadata.get(METADATA_TIMINGS) or {}
        timings = {
            "env_start_sec": _seconds(result.environment_setup),
            "agent_setup_sec": _seconds(result.agent_setup),
            "agent_sec": _seconds(result.agent_execution),
            "verifier_sec": _seconds(result.verifier),
            "total_sec": _seconds(result),  # started_at .. finished_at of the whole trial
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
            agent_stats={k: v for k, v in metadata.items() if k != METADATA_TRAJECTORY},
            trajectory=metadata.get(METADATA_TRAJECTORY),
            timings=timings,
            patterns=patterns,
            decode=decode,
            pass_threshold=pass_threshold,
            step=int(version) if version is not None else None,
        )


def _seconds(timing: Any) -> float:
    """Seconds between a Harbor timing's (or result's) started_at and finished_at; 0 if unset."""
    started, finished = getattr(timing, "started_at", None), getattr(timing, "finished_at", None)
    if started is None or finished is None:
        return 0.0
    return max(0.0, (finished - started).total_seconds())


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
