"""PNG plots of a run's metrics.jsonl: reward, staleness, trainer-vs-sampler gap, timings.

`write_plots(run_dir)` reads `run_dir/metrics.jsonl` and writes one PNG per plot into
`run_dir/plots/`, skipping a plot none of whose keys were logged. It draws on the Agg canvas
directly (no pyplot, so no global backend state and no display needed) and replaces each file
atomically, so a viewer never sees a half-written image while the run re-plots.
"""

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from oneloop.loop.metrics import METRICS_FILE, read_metrics

PLOTS_DIR = "plots"


def _reward_keys(keys: Sequence[str]) -> list[str]:
    return [k for k in ["rollout/reward_mean"] if k in keys] + sorted(
        k for k in keys if k.startswith("eval/")
    )


def _fixed(*wanted: str) -> Callable[[Sequence[str]], list[str]]:
    return lambda keys: [k for k in wanted if k in keys]


def _timing_keys(keys: Sequence[str]) -> list[str]:
    return sorted(k for k in keys if k.startswith("time/"))


# (file stem, title, y label, which logged keys it draws)
_PLOTS: tuple[tuple[str, str, str, Callable[[Sequence[str]], list[str]]], ...] = (
    ("reward", "Reward", "reward", _reward_keys),
    ("staleness", "Staleness", "steps", _fixed("staleness/mean", "staleness/max")),
    (
        "logprob_gap",
        "Trainer vs sampler logprobs",
        "nats",
        _fixed("train/logprob_gap_mean", "train/logprob_gap_max", "train/kl_sample_train"),
    ),
    ("timings", "Timings", "seconds", _timing_keys),
)


def write_plots(run_dir: Path) -> list[Path]:
    """Write the PNGs whose keys appear in run_dir/metrics.jsonl; return the paths written."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir} to plot")
    records = read_metrics(metrics_path)
    logged = sorted({key for record in records for key in record if key != "step"})
    out_dir = run_dir / PLOTS_DIR
    written: list[Path] = []
    for stem, title, ylabel, select in _PLOTS:
        keys = select(logged)
        if not keys:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{stem}.png"
        _plot(path, title, ylabel, keys, records)
        written.append(path)
    return written


def _series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    points = sorted(
        (r["step"], float(r[key]))
        for r in records
        if isinstance(r.get(key), int | float) and math.isfinite(r[key])
    )
    return [s for s, _ in points], [v for _, v in points]


def _plot(path: Path, title: str, ylabel: str, keys: list[str], records: Sequence[dict]) -> None:
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    # Fractions (time/trainer_busy_frac) share the timing plot on their own 0..1 axis.
    fractions = [k for k in keys if k.endswith("_frac")]
    frac_axes = axes.twinx() if fractions and len(fractions) < len(keys) else None
    for index, key in enumerate(keys):
        steps, values = _series(records, key)
        on_frac = key in fractions
        target = frac_axes if frac_axes is not None and on_frac else axes
        target.plot(
            steps,
            values,
            color=f"C{index}",  # one colour cycle across both axes
            linestyle="--" if target is not axes else "-",
            marker="." if len(steps) < 50 else None,
            label=key,
        )
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if frac_axes is not None:
        frac_axes.set_ylabel("fraction")
        frac_axes.set_ylim(0.0, 1.05)
        more_handles, more_labels = frac_axes.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    axes.legend(handles, labels, fontsize="small", loc="best")
    tmp = path.with_name(path.name + ".tmp")
    figure.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
