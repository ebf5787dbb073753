"""Reading a Harbor `TrialResult` the same way for single-step and multi-step tasks.

Harbor 0.25 runs a task with `[[steps]]` as a `MultiStepTrial`: the agent's context, timings and
exception of each step go to `result.step_results[i]`, and the top-level `agent_result`,
`agent_execution` and `verifier` stay empty; only the chosen reward is copied to the top-level
`verifier_result`. Every consumer here (the trial runner's classifier and timings, the
`oneloop inspect` / `eval` records) reads a trial through `agent_view` and `phase_seconds`, so
a multi-step trial is never counted as a run of 0 turns.

Trajectories: ONE TITO TRAJECTORY PER STEP. Harbor calls the agent's `run` afresh for each step
(with a new `AgentContext` and only that step's instruction); the conversation does not carry
over unless the agent supports `resume`, which ours does not. Each step's tokens were therefore
sampled from a prompt that starts with that step's instruction, and concatenating the steps into
one sequence would train on contexts the sampler never saw (the logprobs would not match). Each
step's trajectory is kept verbatim, in step order; the trial's reward (Harbor's multi-step reward
strategy) is the reward of each of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Keys of the agent metadata summed over steps (counters) and merged per tool.
SUMMED_KEYS = ("turns", "repairs", "context_warnings")
# Step agent outcomes that decide the trial's agent outcome, most important first.
OUTCOME_PRIORITY = ("infra_error", "context_overflow", "length_cap")


@dataclass(frozen=True)
class AgentView:
    """The agent's side of one trial, steps merged.

    `metadata`: single-step: the agent's metadata minus the trajectory; multi-step: counters
    summed over steps, timings summed per key, tool stats summed per tool and field, tool calls
    concatenated, the outcome the most important step outcome (`OUTCOME_PRIORITY`, else the last
    step's), plus `steps`: each step's own metadata (minus its trajectory) with its `step_name`.
    `trajectories`: the TITO trajectory JSON of each step that reported one, in step order.
    `missing`: names of steps whose agent ran but reported no trajectory while another step did.
    """

    metadata: dict[str, Any]
    trajectories: tuple[Mapping[str, Any], ...]
    missing: tuple[str, ...] = ()
    step_names: tuple[str, ...] = ()


def seconds(timing: Any) -> float:
    """Seconds between a Harbor timing's started_at and finished_at; 0 if either is unset."""
    started, finished = getattr(timing, "started_at", None), getattr(timing, "finished_at", None)
    if started is None or finished is None:
        return 0.0
    return max(0.0, (finished - started).total_seconds())


def phase_seconds(result: Any) -> tuple[float, float]:
    """(agent seconds, verifier seconds) of a trial: the top-level phases, plus the sums over
    `step_results` for a multi-step trial."""
    agent = seconds(result.agent_execution)
    verifier = seconds(result.verifier)
    for step in result.step_results or []:
        agent += seconds(step.agent_execution)
        verifier += seconds(step.verifier)
    return agent, verifier


def step_exception(result: Any) -> Any:
    """The first exception a trial recorded: the trial's own, else the first step's."""
    if result.exception_info is not None:
        return result.exception_info
    for step in result.step_results or []:
        if step.exception_info is not None:
            return step.exception_info
    return None


def agent_view(result: Any, trajectory_key: str) -> AgentView:
    """The agent's metadata and trajectories of a Harbor `TrialResult` (see `AgentView`)."""
    steps = result.step_results or []
    if not steps:
        metadata = dict((result.agent_result.metadata or {}) if result.agent_result else {})
        trajectory = metadata.pop(trajectory_key, None)
        return AgentView(metadata, (trajectory,) if isinstance(trajectory, dict) else ())
    per_step: list[dict[str, Any]] = []
    trajectories: list[Mapping[str, Any]] = []
    ran_without: list[str] = []
    for step in steps:
        if step.agent_result is None:
            continue  # the step stopped before its agent ran (setup or health check failed)
        metadata = dict(step.agent_result.metadata or {})
        trajectory = metadata.pop(trajectory_key, None)
        if isinstance(trajectory, dict):
            trajectories.append(trajectory)
        else:
            ran_without.append(step.step_name)
        per_step.append({"step_name": step.step_name, **metadata})
    merged = merge_step_metadata(per_step)
    missing = tuple(ran_without) if trajectories else ()
    names = tuple(step.step_name for step in steps)
    return AgentView(merged, tuple(trajectories), missing, names)


def merge_step_metadata(per_step: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One metadata dict for a multi-step trial (see `AgentView.metadata`)."""
    if not per_step:
        return {}
    merged: dict[str, Any] = {"steps": [dict(m) for m in per_step]}
    for key in SUMMED_KEYS:
        if any(key in m for m in per_step):
            merged[key] = sum(int(m.get(key) or 0) for m in per_step)
    timings: dict[str, float] = {}
    tool_stats: dict[str, dict[str, Any]] = {}
    calls: list[Any] = []
    for m in per_step:
        for name, value in (m.get("timings") or {}).items():
            timings[name] = timings.get(name, 0.0) + float(value)
        for tool, stats in (m.get("tool_stats") or {}).items():
            into = tool_stats.setdefault(tool, {})
            for field, value in stats.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    into[field] = into.get(field, 0) + value
                else:
                    into[field] = value
        calls += [
            dict(call) | {"step_name": m.get("step_name")} for call in m.get("tool_calls") or []
        ]
    if timings:
        merged["timings"] = timings
    if tool_stats:
        merged["tool_stats"] = tool_stats
    if any("tool_calls" in m for m in per_step):
        merged["tool_calls"] = calls
    outcomes = [m.get("outcome") for m in per_step if m.get("outcome") is not None]
    decisive = [o for o in OUTCOME_PRIORITY if o in outcomes]
    if decisive or outcomes:
        merged["outcome"] = decisive[0] if decisive else outcomes[-1]
    for key in ("sampler_key",):
        if per_step[-1].get(key) is not None:
            merged[key] = per_step[-1][key]
    return merged
