"""report.md (tables) and PNG plots of a `stats.summary`; shared by `oneloop eval` and `inspect`.

Plots are drawn on the Agg canvas directly (no pyplot state, no display), one file each, into
`<run_dir>/plots/`: outcomes, tools (calls split into ok / failed), categories (pass@1, pass@k),
time (LLM / environment / other), and for inspect the per-step series.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

PLOTS_DIR = "plots"
DEFINITIONS = """\
- **pass@k** (per task): unbiased estimator `1 - C(n-c, k) / C(n, k)` over the task's n scored
  samples with c passes (reward >= pass threshold); **Pass@k** is its mean over tasks with
  n >= k. Masked trajectories (infra error after retries, agent timeout) are not scored.
- **non-model error rate**: attempts that ended in an infrastructure/harness error (environment
  start, MCP connect, stdio server crash, missing verifier result, exception) / all attempts.
- **failed tool call**: MCP status not ok (`is_error`, timeout, exception, unknown tool), or an ok
  result whose text matches an error pattern (`pattern:<regex>`).
- **repair rate**: failed calls followed later in the same trajectory by a successful call of the
  same tool / failed calls. *Parse repairs* are the agent's repair messages for unparsable calls.
- **time**: LLM = sampling; environment = env start + agent setup + MCP connect + tool calls +
  verifier; other = the remainder of each trial's wall time (queueing excluded).
"""


def fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    # A `|` inside a cell (a regex, a tool result) would split it: escape it.
    lines += ["| " + " | ".join(fmt(v).replace("|", "\\|") for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _tool_table(rows: Mapping[str, Mapping[str, Any]], what: str) -> str:
    ordered = sorted(rows.items(), key=lambda item: (item[1]["success_rate"], item[0]))
    return table(
        [what, "calls", "failed", "success rate", "failure reasons", "mean sec"],
        [
            (
                name,
                row["calls"],
                row["failed"],
                row["success_rate"],
                ", ".join(f"{k} ×{v}" for k, v in row["failures"].items()) or "–",
                row["sec"] / row["calls"],
            )
            for name, row in ordered
        ],
    )


def summary_markdown(summary: Mapping[str, Any]) -> str:
    """The sections of one summary (scores, categories, outcomes, tools, agent, time)."""
    k = summary["k"]
    s, o, a, t, rep = (
        summary["scores"],
        summary["outcomes"],
        summary["agent"],
        summary["time"],
        summary["repairs"],
    )
    parts = ["## Scores\n", table(["metric", "value"], [
        ("Pass@1", s["pass@1"]), (f"Pass@{k}", s[f"pass@{k}"]), ("reward mean", s["reward_mean"]),
        ("tasks", s["tasks"]), ("tasks scored", s["tasks_scored"]),
        (f"tasks with >= {k} scored samples", s["tasks_with_k"]),
    ])]  # fmt: skip
    parts += ["\n## Per category\n", table(
        ["category", "tasks", "Pass@1", f"Pass@{k}", "reward mean"],
        [(name, c["tasks"], c["pass@1"], c[f"pass@{k}"], c["reward_mean"])
         for name, c in summary["categories"].items()],
    )]  # fmt: skip
    parts += ["\n## Outcomes\n", table(
        ["outcome", "trajectories"], [(name, n) for name, n in o["final"].items()]
    )]  # fmt: skip
    parts.append(
        f"\n**Non-model error rate: {fmt(o['non_model_error_rate'])}** "
        f"({o['infra_attempts']} infra-error attempts / {o['attempts']} attempts); "
        f"masked trajectories: {o['masked']}; agent-timeout rate: {fmt(o['agent_timeout_rate'])}\n"
    )
    if o["infra_error_classes"]:
        parts += ["\n", table(["infra error", "attempts"], list(o["infra_error_classes"].items()))]
    parts += ["\n## Tools (worst first)\n", _tool_table(summary["tools"], "tool")]
    parts += ["\n## MCP servers\n", _tool_table(summary["servers"], "server")]
    parts.append(
        f"\nRepair rate: {fmt(rep['repair_rate'])} ({rep['repaired']} of {rep['failed_calls']} "
        f"failed calls); parse repairs: {rep['parse_repairs']}\n"
    )
    parts += ["\n## Agent\n", table(["metric", "value"], [
        ("turns (mean / max)", f"{fmt(a['turns_mean'])} / {a['turns_max']}"),
        ("tokens per trajectory (mean / max)", f"{fmt(a['tokens_mean'])} / {a['tokens_max']}"),
        ("prompt / sampled / observation tokens",
         f"{a['prompt_tokens']} / {a['sampled_tokens']} / {a['observation_tokens']}"),
        ("context-budget warnings", a["context_warnings"]),
        ("truncated trajectories", a["truncated"]),
        ("agent outcomes", ", ".join(f"{k2} ×{v}" for k2, v in a["agent_outcomes"].items())),
    ])]  # fmt: skip
    total = t["total_sec"] or 1.0
    parts += ["\n## Time (summed over trajectories)\n", table(
        ["part", "seconds", "share"],
        [(name, t[f"{name}_sec"], t[f"{name}_sec"] / total) for name in ("llm", "env", "other")],
    )]  # fmt: skip
    return "".join(parts)


def write_report(
    run_dir: Path, title: str, header: Sequence[tuple[str, Any]], body: str, extra: str = ""
) -> Path:
    """`run_dir/report.md`: title, run facts, the body sections, extra sections, definitions."""
    facts = table(["setting", "value"], list(header))
    text = f"# {title}\n\n{facts}\n{body}{extra}\n## Definitions\n\n{DEFINITIONS}"
    path = Path(run_dir) / "report.md"
    path.write_text(text)
    return path


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)


def _bars(ax: Any, labels: Sequence[str], series: Mapping[str, Sequence[float]]) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.legend(fontsize=8)


def write_plots(run_dir: Path, summary: Mapping[str, Any]) -> list[Path]:
    """outcomes.png, tools.png, categories.png, time.png under `run_dir/plots/`."""
    out = Path(run_dir) / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    written = []
    k = summary["k"]
    panels: list[tuple[str, str, list[str], dict[str, list[float]]]] = []
    final = summary["outcomes"]["final"]
    panels.append(("outcomes", "Outcome classes", list(final), {"count": list(final.values())}))
    tools = summary["tools"]
    names = sorted(tools)
    panels.append(("tools", "Tool calls", names, {
        "ok": [tools[n]["calls"] - tools[n]["failed"] for n in names],
        "failed": [tools[n]["failed"] for n in names],
    }))  # fmt: skip
    cats = summary["categories"]
    panels.append(("categories", "Scores per category", list(cats), {
        "Pass@1": [cats[c]["pass@1"] or 0.0 for c in cats],
        f"Pass@{k}": [cats[c][f"pass@{k}"] or 0.0 for c in cats],
    }))  # fmt: skip
    t = summary["time"]
    panels.append(("time", "Time split (s)", ["llm", "env", "other"], {
        "seconds": [t["llm_sec"], t["env_sec"], t["other_sec"]],
    }))  # fmt: skip
    for stem, title, labels, series in panels:
        fig = Figure(figsize=(6, 3.5))
        ax = fig.add_subplot()
        if labels:
            _bars(ax, labels, series)
        ax.set_title(title)
        path = out / f"{stem}.png"
        _save(fig, path)
        written.append(path)
    return written


def write_series_plot(
    run_dir: Path, stem: str, title: str, steps: Sequence[int], series: Mapping[str, list]
) -> Path:
    """One line plot over steps (None values are skipped)."""
    out = Path(run_dir) / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    for name, values in series.items():
        points = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_title(title)
    ax.set_xlabel("step (sampler version)")
    if series:
        ax.legend(fontsize=8)
    path = out / f"{stem}.png"
    _save(fig, path)
    return path
