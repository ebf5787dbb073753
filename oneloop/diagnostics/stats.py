"""Numbers over trajectory records (see `records`): pass@k, categories, outcome classes, tools.

Definitions (the report states them too):

* pass@k per task is the unbiased estimator of Chen et al. (2021), `1 - C(n-c, k) / C(n, k)`,
  over the task's n scored (unmasked) samples of which c passed; Pass@k is its mean over tasks
  with n >= k. A sample passes when its reward is >= the pass threshold.
* the non-model error rate is infra-error attempts / all attempts (an attempt is one Harbor
  trial; a retried trajectory counts each attempt). Agent timeouts are reported beside it, not in
  it: a model that loops can cause them.
* a tool call fails by MCP status (is_error, timeout, exception, unknown tool) or by an error
  pattern (`records.call_failure`); the repair rate is the share of failed calls followed, later
  in the same trajectory, by a successful call of the same tool.
* time: LLM = sampling; environment = environment start + agent setup + MCP connect + tool calls +
  verifier; other = the rest of the trial's wall time (queueing excluded).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from math import comb
from typing import Any

from oneloop.agents.trials import TrialOutcome

Record = Mapping[str, Any]
ENV_TIMINGS = ("env_start_sec", "agent_setup_sec", "mcp_connect_sec", "tool_sec", "verifier_sec")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with n samples, c of them passing (needs 1 <= k <= n)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def task_scores(records: Iterable[Record]) -> dict[str, tuple[int, int]]:
    """task -> (n scored samples, c passed)."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for record in records:
        entry = out[record["task_path"]]
        if not record["masked"]:
            entry[0] += 1
            entry[1] += int(bool(record["passed"]))
    return {task: (n, c) for task, (n, c) in out.items()}


def scores(records: Sequence[Record], k: int) -> dict[str, Any]:
    """Pass@1, Pass@k, mean reward and task counts over `records`."""
    per_task = task_scores(records)
    scored = [(n, c) for n, c in per_task.values() if n >= 1]
    with_k = [(n, c) for n, c in scored if n >= k]
    rewards = [float(r["reward"]) for r in records if not r["masked"] and r["reward"] is not None]
    return {
        "tasks": len(per_task),
        "tasks_scored": len(scored),
        "tasks_with_k": len(with_k),
        "pass@1": _mean([c / n for n, c in scored]),
        f"pass@{k}": _mean([pass_at_k(n, c, k) for n, c in with_k]),
        "reward_mean": _mean(rewards),
    }


def by_category(records: Sequence[Record], k: int) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        groups[record["category"]].append(record)
    return {name: scores(rows, k) for name, rows in sorted(groups.items())}


def outcomes(records: Sequence[Record]) -> dict[str, Any]:
    """Outcome classes (final), attempts, and the non-model error rate."""
    final = Counter(str(r["outcome"]) for r in records)
    attempts = sum(int(r["attempts"]) for r in records)
    infra = sum(int(r["infra_attempts"]) for r in records)
    errors: Counter[str] = Counter()
    for record in records:
        texts = list(record.get("attempt_errors") or [])
        if TrialOutcome(record["outcome"]).infra and record.get("error"):
            texts.append(record["error"])
        errors.update(_error_class(text) for text in texts)
    return {
        "trajectories": len(records),
        "final": {str(o): final.get(str(o), 0) for o in TrialOutcome},
        "attempts": attempts,
        "infra_attempts": infra,
        "non_model_error_rate": infra / attempts if attempts else None,
        "agent_timeout_rate": final.get(TrialOutcome.AGENT_TIMEOUT, 0) / len(records)
        if records
        else None,
        "masked": sum(1 for r in records if r["masked"]),
        "infra_error_classes": dict(errors.most_common()),
    }


def _error_class(text: str) -> str:
    """The first line of an error text with numbers as `N` (ids, ports, counts), for grouping."""
    head = text.strip().splitlines()[0] if text and text.strip() else "unknown"
    return re.sub(r"\d+", "N", head)[:120]


def _tool_rows(calls: Iterable[tuple[str, Record]]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for key, call in calls:
        row = rows.setdefault(key, {"calls": 0, "failed": 0, "failures": Counter(), "sec": 0.0})
        row["calls"] += 1
        row["sec"] += float(call.get("sec") or 0.0)
        if call["failed"]:
            row["failed"] += 1
            row["failures"][call["failure"]] += 1
    for row in rows.values():
        row["success_rate"] = 1.0 - row["failed"] / row["calls"]
        row["failures"] = dict(row["failures"].most_common())
    return rows


def tools(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """Per tool: calls, failed, success_rate, failure reasons, seconds."""
    return _tool_rows((c["tool"], c) for r in records for c in r["tool_calls"])


def servers(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """Per MCP server (calls to a tool no server offers count under `<unknown>`)."""
    return _tool_rows((c.get("server") or "<unknown>", c) for r in records for c in r["tool_calls"])


def repairs(records: Sequence[Record]) -> dict[str, Any]:
    """Failed calls later followed by a success of the same tool in the same trajectory."""
    failed = repaired = 0
    for record in records:
        calls = record["tool_calls"]
        for index, call in enumerate(calls):
            if not call["failed"]:
                continue
            failed += 1
            later = calls[index + 1 :]
            repaired += any(c["tool"] == call["tool"] and not c["failed"] for c in later)
    return {
        "failed_calls": failed,
        "repaired": repaired,
        "repair_rate": repaired / failed if failed else None,
        "parse_repairs": sum(int(r["repairs"]) for r in records),
    }


def agent(records: Sequence[Record]) -> dict[str, Any]:
    """Turns, tokens, context warnings, truncations, agent outcomes."""
    n = len(records)
    turns = [int(r["turns"]) for r in records]
    totals = [int(r["tokens"]["total"]) for r in records]
    return {
        "turns_mean": _mean(turns),
        "turns_max": max(turns, default=0),
        "tokens_mean": _mean(totals),
        "tokens_max": max(totals, default=0),
        "sampled_tokens": sum(int(r["tokens"]["sampled"]) for r in records),
        "prompt_tokens": sum(int(r["tokens"]["prompt"]) for r in records),
        "observation_tokens": sum(int(r["tokens"]["observation"]) for r in records),
        "context_warnings": sum(int(r["context_warnings"]) for r in records),
        "truncated": sum(1 for r in records if r["outcome"] == TrialOutcome.TRUNCATED),
        "agent_outcomes": dict(Counter(str(r.get("agent_outcome")) for r in records)),
        "trajectories": n,
    }


def time_split(records: Sequence[Record]) -> dict[str, float]:
    """Seconds summed over trajectories: llm, environment, other, total (queueing excluded)."""
    llm = env = total = 0.0
    for record in records:
        timings = record["timings"]
        llm += float(timings.get("llm_sec", 0.0))
        env += sum(float(timings.get(key, 0.0)) for key in ENV_TIMINGS)
        total += float(timings.get("total_sec", 0.0))
    total = max(total, llm + env)
    return {"llm_sec": llm, "env_sec": env, "other_sec": total - llm - env, "total_sec": total}


def summary(records: Sequence[Record], k: int) -> dict[str, Any]:
    """Every diagnostic of one set of records."""
    return {
        "k": k,
        "scores": scores(records, k),
        "categories": by_category(records, k),
        "outcomes": outcomes(records),
        "tools": tools(records),
        "servers": servers(records),
        "repairs": repairs(records),
        "agent": agent(records),
        "time": time_split(records),
    }
