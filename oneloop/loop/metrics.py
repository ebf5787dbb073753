"""The one metrics sink: one namespaced dict per step to JSONL, console, W&B and TensorBoard.

`MetricsLogger.log(step, metrics)` appends `{"step": step, **metrics}` as one line of
`run_dir/metrics.jsonl` (flushed and fsynced, so a crash loses at most the line being written),
prints a compact progress line, and forwards to W&B / TensorBoard when enabled. Those two
import lazily; enabled but not installed is a `ConfigError` naming the config key.
`read_metrics` reads the file back, skipping a torn last line; `truncate_after` drops the steps
after a checkpoint on resume (atomic rewrite). Keys are namespaced `area/name`
(`rollout/reward_mean`, `train/loss`, `time/wait_for_rollouts`, `staleness/hist_0`).
`BackendCounters` turns a backend's own event counters (the optional `ReportsBackendMetrics`
hook of its ServiceClient) into per-step `backend/...` metrics.
"""

import asyncio
import json
import math
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from oneloop.errors import ConfigError

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"

# Console progress line: (metric key, label, format). Missing keys are left out.
_CONSOLE_FIELDS = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("staleness/max", "stale max", "{:.0f}"),
    ("rollout/in_flight", "in flight", "{:.0f}"),
    ("time/trainer_busy_frac", "trainer busy", "{:.0%}"),
)


class MetricsLogger:
    """Fans one metrics dict per step out to every enabled sink; steps strictly increase."""

    def __init__(
        self,
        run_dir: Path,
        *,
        console: bool = True,
        wandb: dict[str, Any] | None = None,
        tensorboard: bool = False,
        resume: bool = False,
    ) -> None:
        """`wandb`: kwargs for `wandb.init` (project, name, ...), None = off (config key
        `logging.wandb`). `tensorboard`: event files under run_dir/tb (`logging.tensorboard`).
        `resume`: append to an existing metrics.jsonl (call `truncate_after` first), else start
        a fresh file."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / METRICS_FILE
        self._last_step: int | None = None
        # Optional sinks first: a missing package must fail before the file is touched.
        self._wandb_run = _start_wandb(run_dir, wandb, resume) if wandb is not None else None
        self._tb_writer = _start_tensorboard(run_dir) if tensorboard else None
        self._console = None
        if console:
            from rich.console import Console

            self._console = Console(highlight=False)
        if resume:
            _repair_torn_tail(self.path)
            records = read_metrics(self.path) if self.path.exists() else []
            self._last_step = max((r["step"] for r in records), default=None)
        self._file = self.path.open("a" if resume else "w", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
        """Append one record for `step` and fan it out; `step` must exceed the last logged one."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step {step} <= last logged step {self._last_step} in {self.path}: one metrics "
                "dict per step (on resume, truncate_after(checkpoint_step) first)"
            )
        record = {"step": step, **_clean(metrics)}
        line = json.dumps(record) + "\n"
        self._file.write(line)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._last_step = step
        values = {k: v for k, v in record.items() if k != "step"}
        if self._console is not None:
            self._console.print(_progress_line(step, values), soft_wrap=True)
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)
        if self._tb_writer is not None:
            for key, value in values.items():
                self._tb_writer.add_scalar(key, value, step)
            self._tb_writer.flush()

    def close(self) -> None:
        """Close the file and finish the optional sinks; calling it again does nothing."""
        if not self._file.closed:
            self._file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@runtime_checkable
class ReportsBackendMetrics(Protocol):
    """Optional hook of a ServiceClient: counters of backend events the loop cannot see.

    `backend_metrics()` returns cumulative counts since the client started, keyed `backend/...`;
    it may block briefly (the loop calls it in a thread, once per step, with a timeout).
    Implementations: `megatron_local.service_client.LocalServiceClient`
    (`backend/sampler_restarts`). The tinker SDK's ServiceClient has no such hook (also against
    `oneloop serve`), so a `--backend tinker` run logs no `backend/` keys: absent means not
    reported, not zero.
    """

    def backend_metrics(self) -> dict[str, float]: ...


class BackendCounters:
    """Per-step deltas of a backend's cumulative counters (`ReportsBackendMetrics`)."""

    def __init__(self, service: object) -> None:
        self._source = service if isinstance(service, ReportsBackendMetrics) else None
        self._last: dict[str, float] = {}

    async def step_metrics(self, timeout_s: float) -> dict[str, float]:
        """Counts since the previous call ({} when the backend reports none)."""
        if self._source is None:
            return {}
        async with asyncio.timeout(timeout_s):
            totals = await asyncio.to_thread(self._source.backend_metrics)
        out = {key: float(value) - self._last.get(key, 0.0) for key, value in totals.items()}
        self._last = {key: float(value) for key, value in totals.items()}
        return out


GATEWAY_COUNTERS = ("requests", "continued", "new_segments", "history_rewrites",
                    "unchosen_choices", "sample_timeouts", "sample_errors")  # fmt: skip
"""Per-trial counters of the OpenAI gateway (`agent.kind: openai_gateway`) summed into
`rollout/gateway_<name>`; `new_segments` beyond one per trial are history rewrites."""


def gateway_counts(agent_stats: Mapping[str, Any] | None) -> dict[str, int]:
    """`gateway_<name>` counts of one trial's gateway session ({} for other agents)."""
    gateway = (agent_stats or {}).get("gateway")
    if not isinstance(gateway, Mapping):
        return {}
    return {f"gateway_{k}": int(gateway.get(k, 0)) for k in GATEWAY_COUNTERS}


def routing_metrics(fwd_metrics: Mapping[str, float]) -> dict[str, float]:
    """Rollout routing replay (R3) lines of a step from the trainer's summed counts (MoE models
    whose datums carried routing): the mean |trainer − sampler| logprob of sampled tokens with
    replay and without it (one extra no-grad pass), and the fraction of (position, MoE layer)
    pairs whose own experts differ from the sampler's (1 − routing agreement). {} otherwise."""
    positions = fwd_metrics.get("routing/positions:sum", 0.0)
    if not positions:
        return {}
    out = {"train/routing_differ_frac": fwd_metrics.get("routing/differ:sum", 0.0) / positions}
    tokens = fwd_metrics.get("routing/gap_tokens:sum", 0.0)
    if tokens:
        out["train/logprob_gap_replay_mean"] = fwd_metrics["routing/gap_replay:sum"] / tokens
        out["train/logprob_gap_free_mean"] = fwd_metrics["routing/gap_free:sum"] / tokens
    return out


def read_metrics(path: Path) -> list[dict]:
    """All records of a metrics.jsonl, in file order.

    A last line without its newline that does not parse is a write torn by a crash and is
    skipped; any other unparsable line is corruption and raises ValueError naming the line.
    """
    return [record for _, record in _read_lines(Path(path))]


def truncate_after(path: Path, step: int) -> None:
    """Keep only records with `step <= step` (resume from that checkpoint); atomic rewrite.

    A missing file is left missing (the run crashed before its first log line).
    """
    path = Path(path)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"step must be an int, got {step!r}")
    if not path.exists():
        return
    kept = [line for line, record in _read_lines(path) if record["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# -- internals -------------------------------------------------------------------------------


def _clean(metrics: Mapping[str, float | int]) -> dict[str, float | int]:
    """Validate namespaced keys and real-number values; numpy scalars become Python numbers."""
    if not isinstance(metrics, Mapping):
        raise ValueError(f"metrics must be a mapping of key to number, got {type(metrics)}")
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or "/" not in key.strip("/"):
            raise ValueError(
                f"metric key {key!r} is not namespaced: use 'area/name' "
                "(rollout/, train/, time/, staleness/, eval/ ...)"
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"metric {key!r} must be a real number, got {value!r}")
        out[key] = int(value) if isinstance(value, numbers.Integral) else float(value)
    return out


def _read_lines(path: Path) -> list[tuple[str, dict]]:
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    # After the last "\n" is either "" or a line the writer never finished.
    complete, tail = lines[:-1], lines[-1]
    out: list[tuple[str, dict]] = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not a JSON line ({error})") from None
        out.append((line, _check_record(path, number, record)))
    if tail.strip():
        try:
            record = json.loads(tail)
        except json.JSONDecodeError:
            return out  # torn by a crash mid-write
        out.append((tail, _check_record(path, len(lines), record)))
    return out


def _check_record(path: Path, number: int, record: object) -> dict:
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(record, dict) or isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"{path}:{number}: a metrics record must be an object with an int 'step'")
    return record


def _repair_torn_tail(path: Path) -> None:
    """Before appending: end a complete unterminated record with "\\n", cut a torn one."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    try:
        json.loads(data[cut:])
    except (json.JSONDecodeError, UnicodeDecodeError):
        with path.open("r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
        return
    with path.open("ab") as f:
        f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _progress_line(step: int, values: Mapping[str, float | int]) -> str:
    parts = [f"[bold]step {step}[/bold]"]
    for key, label, fmt in _CONSOLE_FIELDS:
        value = values.get(key)
        if value is not None and math.isfinite(value):
            parts.append(f"{label} {fmt.format(value)}")
    return " | ".join(parts)


def _start_wandb(run_dir: Path, kwargs: dict[str, Any], resume: bool) -> Any:
    if not isinstance(kwargs, dict):
        raise ConfigError(
            f"logging.wandb must be a dict of wandb.init kwargs or None, got {kwargs!r}"
        )
    try:
        import wandb
    except ImportError as error:
        raise ConfigError(
            "logging.wandb is set but the `wandb` package is not installed: install it "
            "(uv add wandb) or set logging.wandb to null"
        ) from error
    kwargs = {"dir": str(run_dir), **kwargs}
    if resume:
        kwargs.setdefault("resume", "allow")
    return wandb.init(**kwargs)


def _start_tensorboard(run_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ConfigError(
            "logging.tensorboard is true but TensorBoard is not installed (torch.utils.tensorboard "
            "needs the `tensorboard` package): install it (uv add tensorboard) or set "
            "logging.tensorboard to false"
        ) from error
    return SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))
