"""`oneloop inspect RUN_DIR`: harness diagnostics of a training or an eval run, over time.

Reads what the run left behind:

* an eval run (`oneloop eval`): its `trajectories.jsonl` records;
* a training run: every Harbor trial under `trials/` (one record per attempt, classified as the
  trial runner classifies it; `step` = the sampler version the trial sampled with, none for the
  loop's held-out evaluations), `metrics.jsonl` and `logprob_gaps.jsonl` (one row per trained
  trajectory: mean/max |trainer - sampler| logprob, written by the loop's train step).

Writes `inspect.json` (every number) and `inspect.md`: the overall diagnostics as in `oneloop
eval`'s report; a per-step table (pass@1, non-model error rate, tool failure and repair rates,
context-budget warnings, truncations); the worst tools with a failing result each; the
trajectories with warnings or truncations; the trajectories with the largest trainer-vs-sampler
logprob gap; and `plots/inspect_steps.png`. It prints the path.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from oneloop.diagnostics import records as rec
from oneloop.diagnostics import report, stats
from oneloop.errors import ConfigError

TRIALS_DIR = "trials"
GAPS_FILE = "logprob_gaps.jsonl"
EVAL_STEP = "eval"  # the label of records without a sampler version


def load_records(
    run_dir: Path, patterns: Sequence[Any], pass_threshold: float
) -> tuple[str, list[dict[str, Any]]]:
    """("eval" | "train", records) of a run directory; ConfigError if it is neither."""
    trajectories = run_dir / "trajectories.jsonl"
    if (run_dir / "summary.json").is_file() and trajectories.is_file():
        rows = rec.read_records(trajectories)
        if all("tool_calls" in row for row in rows):
            for row in rows:  # re-judge calls with this run's patterns
                for call in row["tool_calls"]:
                    call["failure"] = rec.call_failure(call, patterns)
                    call["failed"] = call["failure"] is not None
                row["passed"] = not row["masked"] and (row["reward"] or 0.0) >= pass_threshold
            return "eval", rows
    if (run_dir / TRIALS_DIR).is_dir():
        decode = _decoder(run_dir)
        rows = list(
            rec.records_from_trials_dir(
                run_dir / TRIALS_DIR,
                patterns=patterns,
                decode=decode,
                pass_threshold=pass_threshold,
            )
        )
        return "train", rows
    raise ConfigError(
        f"RUN_DIR {run_dir}: neither an eval run (summary.json + trajectories.jsonl) nor a "
        f"training run ({TRIALS_DIR}/ with Harbor trial directories)"
    )


def _decoder(run_dir: Path) -> rec.Decode | None:
    """Decode with the tokenizer the trials' agent used (from the first trial's config)."""
    for config in sorted((run_dir / TRIALS_DIR).glob("*/config.json")):
        path = (
            json.loads(config.read_text()).get("agent", {}).get("kwargs", {}).get("tokenizer_path")
        )
        if path and Path(path).exists():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
            return lambda tokens: tokenizer.decode(list(tokens))
    return None


def _step_key(record: Mapping[str, Any]) -> Any:
    return EVAL_STEP if record.get("step") is None else int(record["step"])


def per_step(records: Sequence[Mapping[str, Any]], k: int) -> dict[Any, dict[str, Any]]:
    groups: dict[Any, list[Mapping[str, Any]]] = defaultdict(list)
    for record in records:
        groups[_step_key(record)].append(record)
    ordered = sorted(groups, key=lambda s: (s == EVAL_STEP, s if s != EVAL_STEP else 0))
    out = {}
    for step in ordered:
        rows = groups[step]
        calls = [c for r in rows for c in r["tool_calls"]]
        out[step] = {
            "trajectories": len(rows),
            "pass@1": stats.scores(rows, k)["pass@1"],
            "non_model_error_rate": stats.outcomes(rows)["non_model_error_rate"],
            "tool_calls": len(calls),
            "tool_failure_rate": sum(c["failed"] for c in calls) / len(calls) if calls else None,
            "repair_rate": stats.repairs(rows)["repair_rate"],
            "context_warnings": sum(int(r["context_warnings"]) for r in rows),
            "truncated": sum(1 for r in rows if r["outcome"] == "truncated"),
            "turns_mean": stats.agent(rows)["turns_mean"],
        }
    return out


def worst_tools(records: Sequence[Mapping[str, Any]], top: int) -> list[dict[str, Any]]:
    """Tools with failures, lowest success rate first, each with one failing call to read."""
    rows = stats.tools(records)
    failing = [(name, row) for name, row in rows.items() if row["failed"]]
    failing.sort(key=lambda item: (item[1]["success_rate"], -item[1]["failed"], item[0]))
    out = []
    for name, row in failing[:top]:
        example = next(
            (r["trial_name"], c)
            for r in records
            for c in r["tool_calls"]
            if c["tool"] == name and c["failed"]
        )
        out.append({"tool": name, **row, "example_trial": example[0], "example": example[1]})
    return out


def largest_gaps(run_dir: Path, records: Sequence[Mapping[str, Any]], top: int) -> list[dict]:
    path = run_dir / GAPS_FILE
    if not path.is_file():
        return []
    by_digest = {r["digest"]: r for r in records if r.get("digest")}
    rows = rec.read_records(path)
    rows.sort(key=lambda row: -float(row["gap_mean"]))
    out = []
    for row in rows[:top]:
        match = by_digest.get(row.get("digest"))
        out.append(row | {"trial_name": match["trial_name"] if match else None})
    return out


def _excerpt(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def diagnose(
    kind: str, run_dir: Path, records: Sequence[Mapping[str, Any]], k: int, top: int
) -> dict[str, Any]:
    """Every number `inspect` reports (also written to inspect.json)."""
    flagged = [r for r in records if r["context_warnings"] or r["outcome"] == "truncated"]
    return {
        "kind": kind,
        "k": k,
        "summary": stats.summary(records, k),
        "steps": per_step(records, k),
        "worst_tools": worst_tools(records, top),
        "flagged": [
            {"trial_name": r["trial_name"], "step": _step_key(r), "outcome": r["outcome"],
             "agent_outcome": r["agent_outcome"], "context_warnings": r["context_warnings"],
             "tokens": r["tokens"]["total"]}
            for r in flagged[:top]
        ],
        "largest_gaps": largest_gaps(run_dir, records, top) if kind == "train" else None,
        "train_steps": train_steps(run_dir) if kind == "train" else [],
    }  # fmt: skip


METRIC_COLUMNS = (
    "train/logprob_gap_mean", "train/logprob_gap_max", "train/kl_sample_train",
    "rollout/reward_mean", "rollout/trajectories_masked", "time/rollout_llm_s",
    "time/rollout_env_s",
)  # fmt: skip
ROUTING_COLUMNS = (
    "train/logprob_gap_replay_mean", "train/logprob_gap_free_mean", "train/routing_differ_frac",
)  # fmt: skip
"""Routing replay (R3) columns, shown when the run logged them (MoE models, algo.routing_replay)."""


GATEWAY_COLUMNS = ("rollout/gateway_requests", "rollout/gateway_new_segments",
                   "rollout/gateway_history_rewrites")  # fmt: skip
"""OpenAI-gateway columns, shown when the run logged them (`agent.kind: openai_gateway`)."""


def train_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The RL step lines of metrics.jsonl, reduced to METRIC_COLUMNS (and ROUTING_COLUMNS when
    the run logged them)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [row for row in rec.read_records(path) if "train/loss" in row]
    replay = any(ROUTING_COLUMNS[-1] in row for row in rows)
    columns = METRIC_COLUMNS + (ROUTING_COLUMNS if replay else ())
    if any(GATEWAY_COLUMNS[0] in row for row in rows):
        columns += GATEWAY_COLUMNS
    return [{"step": row["step"]} | {c: row.get(c) for c in columns} for row in rows]


def inspect_markdown(data: Mapping[str, Any]) -> str:
    steps, worst, flagged, gaps = (
        data["steps"], data["worst_tools"], data["flagged"], data["largest_gaps"]
    )  # fmt: skip
    parts = [report.summary_markdown(data["summary"])]
    parts += ["\n## Per step (sampler version)\n", report.table(
        ["step", "trajectories", "Pass@1", "non-model error rate", "tool calls",
         "tool failure rate", "repair rate", "context warnings", "truncated", "turns"],
        [(step, s["trajectories"], s["pass@1"], s["non_model_error_rate"], s["tool_calls"],
          s["tool_failure_rate"], s["repair_rate"], s["context_warnings"], s["truncated"],
          s["turns_mean"]) for step, s in steps.items()],
    )]  # fmt: skip
    parts.append("\n## Worst tools\n")
    parts.append(report.table(
        ["tool", "calls", "failed", "success rate", "a failing call (trial)", "its result"],
        [(w["tool"], w["calls"], w["failed"], w["success_rate"], w["example_trial"],
          _excerpt(w["example"].get("result") or "")) for w in worst],
    ) if worst else "No failed tool calls.\n")  # fmt: skip
    parts.append("\n## Context-budget warnings and truncations\n")
    parts.append(report.table(
        ["trial", "step", "outcome", "agent outcome", "warnings", "tokens"],
        [(f["trial_name"], f["step"], f["outcome"], f["agent_outcome"], f["context_warnings"],
          f["tokens"]) for f in flagged],
    ) if flagged else "None.\n")  # fmt: skip
    if data["train_steps"]:
        columns = [c for c in data["train_steps"][0] if c != "step"]
        parts += ["\n## Training steps (metrics.jsonl)\n", report.table(
            ["step", *columns],
            [[row["step"], *(row[c] for c in columns)] for row in data["train_steps"]],
        )]  # fmt: skip
    parts.append("\n## Largest trainer-vs-sampler logprob gaps\n")
    if gaps is None:
        parts.append("Not available for an eval run: no trainer pass computed logprobs.\n")
    else:
        parts.append(report.table(
            ["step", "sample", "index", "gap mean", "gap max", "tokens", "reward", "trial"],
            [(g["step"], g["sample_id"], g["index"], g["gap_mean"], g["gap_max"],
              int(g["tokens"]), g["reward"], g["trial_name"]) for g in gaps],
        ) if gaps else f"No {GAPS_FILE} in the run directory.\n")  # fmt: skip
    return "".join(parts)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="oneloop inspect", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="a training or `oneloop eval` run directory")
    parser.add_argument("--k", type=int, default=None, help="pass@k's k (default: eval's k or 1)")
    parser.add_argument("--top", type=int, default=10, help="rows in the worst-of tables")
    parser.add_argument("--pass-threshold", type=float, default=1.0, help="pass = reward >= this")
    parser.add_argument(
        "--error-pattern",
        action="append",
        default=None,
        help=f"error-text regex (repeatable; default {list(rec.DEFAULT_ERROR_PATTERNS)})",
    )
    args = parser.parse_intermixed_args(argv)
    try:
        run_dir = args.run_dir
        if not run_dir.is_dir():
            raise ConfigError(f"RUN_DIR {run_dir}: not a directory")
        given = rec.DEFAULT_ERROR_PATTERNS if args.error_pattern is None else args.error_pattern
        patterns = rec.compile_patterns(p for p in given if p)
        kind, records = load_records(run_dir, patterns, args.pass_threshold)
        k = args.k or _eval_k(run_dir) or 1
        if k < 1 or args.top < 1:
            raise ConfigError("--k and --top: must be >= 1")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    data = diagnose(kind, run_dir, records, k, args.top)
    (run_dir / "inspect.json").write_text(json.dumps(data, indent=1, default=str))
    body, steps = inspect_markdown(data), data["steps"]
    header = [("run", str(run_dir)), ("kind", kind), ("records", len(records)), ("k", k)]
    (run_dir / "inspect.md").write_text(
        f"# oneloop inspect\n\n{report.table(['setting', 'value'], header)}\n{body}\n"
        f"## Definitions\n\n{report.DEFINITIONS}"
    )
    numbered = [s for s in steps if s != EVAL_STEP]
    if numbered:
        names = ("pass@1", "non_model_error_rate", "tool_failure_rate", "repair_rate")
        series = {name: [steps[s][name] for s in numbered] for name in names}
        report.write_series_plot(run_dir, "inspect_steps", "Diagnostics per step", numbered, series)
    print(f"inspect: {len(records)} {kind} records -> {run_dir / 'inspect.md'}")
    return 0


def _eval_k(run_dir: Path) -> int | None:
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("k")
