"""`oneloop eval`: Harbor trials with a given model on either backend, no training, and a report.

Same config as training (`--config` YAML or preset plus dotted overrides; the agent, environment,
timeouts and tasks sections apply). The model is `--model-path tinker://...` (a sampler
checkpoint) or a base model (`--base-model`, default `model.base_model`). Every task of the chosen
split (or the first `--tasks N`) runs `--samples-per-task k` trials through the training loop's
trial runner at `--concurrency`. Outputs in the run directory:

    trajectories.jsonl   one record per trajectory (see `oneloop.diagnostics.records`)
    summary.json         every number of the report (see `oneloop.diagnostics.stats`)
    report.md            tables: scores, categories, outcomes + non-model error rate, tools,
                         MCP servers, repairs, turns/tokens, time split
    plots/*.png          outcomes, tools, categories, time
    trials/              Harbor's own trial directories

`--agent` (config `eval.agent`, default `mcp`) picks the Harbor agent: `mcp` (ours, sampling the
model), `oracle` (each task's reference solution: the pass to run before RL, its Pass@1 is the
fraction of tasks whose solution passes), any other Harbor built-in agent name, or a
`module:Class` import path. A Harbor agent other than ours needs no backend and no model here: it
brings its own (configure it through its own environment variables); the report is the same.
Tasks the environment cannot run (`oneloop tasks check`) are `task_config` records, never tried.

SIGTERM or SIGINT stops it cleanly (`oneloop.loop.signals`): trials are abandoned, the backend
and Ray are shut down, no report is written, and the exit status is 128 + the signal number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from oneloop.backends.ray_runtime import init_ray
from oneloop.diagnostics.records import DEFAULT_ERROR_PATTERNS
from oneloop.errors import ConfigError
from oneloop.loop.signals import Stopped, reclaim_signals, run_stoppable

SAMPLER_TIMEOUT_S = 600.0  # creating a sampling client may load weights
MCP_AGENT = "mcp"


@dataclass(frozen=True)
class EvalOptions:
    """What `oneloop eval` runs beyond the training config."""

    model_path: str | None  # tinker://<run>/sampler_weights/<name>
    base_model: str | None  # None = model.base_model
    tokenizer: str | None  # None = the model's own (resolved from the backend)
    concurrency: int  # trials at once
    samples_per_task: int  # k
    n_tasks: int | None  # None = every task of the split
    split: str  # train | eval
    temperature: float | None  # None = agent.temperature
    pass_threshold: float  # a sample passes when reward >= this
    error_patterns: tuple[str, ...]
    seed: int
    agent: str = MCP_AGENT  # mcp | oracle | a Harbor agent name | module:Class

    def __post_init__(self) -> None:
        checks = (
            ("--concurrency", self.concurrency, self.concurrency >= 1, "an integer >= 1"),
            ("--samples-per-task", self.samples_per_task, self.samples_per_task >= 1,
             "an integer >= 1"),
            ("--tasks", self.n_tasks, self.n_tasks is None or self.n_tasks >= 1,
             "an integer >= 1"),
            ("--temperature", self.temperature, self.temperature is None or self.temperature >= 0,
             "a number >= 0"),
        )  # fmt: skip
        for flag, value, ok, what in checks:
            if not ok:
                raise ConfigError(f"{flag}: must be {what}, got {value!r}")
        if self.model_path is not None and self.base_model is not None:
            raise ConfigError("--model-path and --base-model: give one, not both")
        if self.model_path is not None and not self.model_path.startswith("tinker://"):
            raise ConfigError(
                f"--model-path {self.model_path!r}: expected tinker://<run>/sampler_weights/<name>"
            )
        if self.split not in ("train", "eval"):
            raise ConfigError(f"--split {self.split!r}: expected train or eval")
        harbor_agent(self.agent)  # raises on a name that is neither


def harbor_agent(agent: str) -> tuple[str | None, str | None]:
    """(Harbor agent name, import path) of an `--agent` value; (None, None) for our MCP agent."""
    from harbor.models.agent.name import AgentName

    from oneloop.agents.trials import MCP_AGENT_IMPORT_PATH

    if agent in (MCP_AGENT, MCP_AGENT_IMPORT_PATH):
        return None, None
    if ":" in agent:
        module, _, name = agent.partition(":")
        if not module or not name.isidentifier():
            raise ConfigError(f"--agent {agent!r}: an import path is module.path:ClassName")
        return None, agent
    names = [a.value for a in AgentName]
    if agent not in names:
        raise ConfigError(
            f"--agent {agent!r}: expected mcp, module:Class, or a Harbor agent name "
            f"({', '.join(names[:8])}, ...)"
        )
    return agent, None


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="oneloop eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="demo-cpu", help="YAML file or preset name")
    parser.add_argument("--backend", choices=["local", "tinker"], help="overrides backend.backend")
    parser.add_argument("--base-url", help="tinker backend: service URL")
    parser.add_argument("--api-key", help="tinker backend: API key (else TINKER_API_KEY)")
    parser.add_argument("--model-path", help="tinker://<run>/sampler_weights/<name> to evaluate")
    parser.add_argument("--base-model", help="base model to evaluate (default model.base_model)")
    parser.add_argument("--tokenizer", help="tokenizer path/name (default: the model's)")
    parser.add_argument(
        "--concurrency", type=int, help="trials at once (default rollout.max_concurrency)"
    )
    parser.add_argument("--samples-per-task", type=int, default=1, help="k samples per task")
    parser.add_argument("--tasks", type=int, help="evaluate only the first N tasks of the split")
    parser.add_argument("--split", default="train", help="train (default) or eval")
    parser.add_argument("--run-dir", help="output directory (overrides run_dir)")
    parser.add_argument("--temperature", type=float, help="default agent.temperature")
    parser.add_argument("--pass-threshold", type=float, default=1.0, help="pass = reward >= this")
    parser.add_argument(
        "--error-pattern",
        action="append",
        default=None,
        help="regex: an ok tool result matching it counts as failed (repeatable; default: "
        f"{list(DEFAULT_ERROR_PATTERNS)}; pass '' for none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="base sampling seed")
    parser.add_argument(
        "--agent",
        help="mcp (default: eval.agent), oracle, a Harbor agent name, or module:Class",
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    args = parser.parse_intermixed_args(argv)  # overrides may follow flags
    overrides = list(args.overrides)
    for flag, key in (
        ("backend", "backend.backend"),
        ("base_url", "backend.tinker.base_url"),
        ("api_key", "backend.tinker.api_key"),
        ("run_dir", "run_dir"),
    ):
        if getattr(args, flag):
            overrides.append(f"{key}={getattr(args, flag)}")
    return args, overrides


def options_from(
    args: argparse.Namespace, default_concurrency: int, default_agent: str = MCP_AGENT
) -> EvalOptions:
    patterns = DEFAULT_ERROR_PATTERNS if args.error_pattern is None else args.error_pattern
    return EvalOptions(
        agent=args.agent or default_agent,
        model_path=args.model_path,
        base_model=args.base_model,
        tokenizer=args.tokenizer,
        concurrency=default_concurrency if args.concurrency is None else args.concurrency,
        samples_per_task=args.samples_per_task,
        n_tasks=args.tasks,
        split=args.split,
        temperature=args.temperature,
        pass_threshold=args.pass_threshold,
        error_patterns=tuple(p for p in patterns if p),
        seed=args.seed,
    )


def main(argv: list[str]) -> int:
    from oneloop.loop.config import load_config

    args, overrides = parse(argv)
    try:
        cfg = load_config(args.config, overrides)
        default_agent = cfg.eval.agent if cfg.eval is not None else MCP_AGENT
        options = options_from(args, cfg.rollout.max_concurrency, default_agent)
        summary = run_stoppable(
            run_eval(cfg, options), "oneloop eval", "trials are abandoned, no report is written"
        )
    except ConfigError as error:  # bad flags or config, or the environment preflight
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Stopped as stop:
        print(f"oneloop eval: {stop}; no report written", file=sys.stderr)
        return stop.exit_status
    scores = summary["scores"]
    k = options.samples_per_task
    print(
        f"eval: Pass@1 {_f(scores['pass@1'])} Pass@{k} {_f(scores[f'pass@{k}'])} "
        f"non-model error rate {_f(summary['outcomes']['non_model_error_rate'])} "
        f"-> {cfg.run_dir / 'report.md'}"
    )
    return 0


def _f(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


async def _sampling_client(service: Any, options: EvalOptions, base_model: str) -> Any:
    if options.model_path is not None:
        future = service.create_sampling_client(model_path=options.model_path)
    else:
        future = service.create_sampling_client(base_model=base_model)
    return await asyncio.wait_for(future, SAMPLER_TIMEOUT_S)


def tokenizer_path(service: Any, sampler: Any, explicit: str | None) -> str:
    """The tokenizer the agent renders with: explicit, else the sampler's base model resolved
    by the backend (local: its model directory; a tiny model: its built directory)."""
    if explicit:
        return explicit
    base = sampler.get_base_model()
    if hasattr(service, "resolve_model"):
        return str(service.resolve_model(base))
    from oneloop.tiny.model import build_tiny_model, named_tiny_specs

    if base in named_tiny_specs():
        return str(build_tiny_model(named_tiny_specs()[base]))
    return base


async def run_eval(cfg: Any, options: EvalOptions) -> dict[str, Any]:
    """Run the trials, write every output, return the summary (see module docstring)."""
    from oneloop.agents.providers import container_free_warning, preflight_environment
    from oneloop.agents.tasks_check import refusal_line, refusals
    from oneloop.diagnostics import records as rec
    from oneloop.diagnostics import report, stats
    from oneloop.loop.train import task_dirs

    rollout = cfg.rollout
    env_import = None if rollout.environment_type else rollout.environment_import_path
    preflight_environment(rollout.environment_type, env_import, "rollout.environment")
    warning = container_free_warning(cfg.tasks.dir, rollout.environment_type, env_import)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    patterns = rec.compile_patterns(options.error_patterns)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    _, train, held = task_dirs(cfg)
    tasks = (train if options.split == "train" else held)[: options.n_tasks]
    if not tasks:
        raise ConfigError(f"--split {options.split}: the config's tasks have no such tasks")
    # The same screen as the loop's: one line per refused task (reported as task_config rows).
    for task, reasons in refusals(tasks, rollout.environment_type, env_import).items():
        print(f"task_config: {refusal_line(task, reasons)}", file=sys.stderr)
    agent_name, agent_import = harbor_agent(options.agent)
    if agent_name is None and agent_import is None:
        groups, runner, decode, settings = await _run_mcp(cfg, options, tasks)
    else:
        groups, runner = await _run_harbor_agent(cfg, options, tasks, agent_name, agent_import)
        decode, settings = None, {"model": None, "temperature": None}
    k = options.samples_per_task
    rows = [
        rec.record_from_result(
            result,
            task=Path(group.task),
            sample=i,
            patterns=patterns,
            decode=decode,
            pass_threshold=options.pass_threshold,
        )
        for group in groups
        for i, result in enumerate(group.results)
    ]
    rec.write_records(cfg.run_dir / "trajectories.jsonl", rows)
    summary = stats.summary(rows, k)
    settings = {
        "agent": options.agent,
        **settings,
        "backend": cfg.backend.backend if agent_name is None and agent_import is None else None,
        "environment": rollout.environment_type or env_import,
        "split": options.split,
        "tasks": len(tasks),
        "samples_per_task": k,
        "concurrency": options.concurrency,
        "pass_threshold": options.pass_threshold,
        "error_patterns": list(options.error_patterns),
        "runner_counters": runner.counters(),
    }
    (cfg.run_dir / "summary.json").write_text(
        json.dumps({"settings": settings, **summary}, indent=1, sort_keys=True)
    )
    header = [(key, value) for key, value in settings.items() if key != "runner_counters"]
    report.write_report(cfg.run_dir, "oneloop eval", header, report.summary_markdown(summary))
    report.write_plots(cfg.run_dir, summary)
    return summary


def _batch_timeout(cfg: Any, options: EvalOptions, n_tasks: int) -> float:
    """Bounds the whole batch of waves (every trial is bounded by the runner already)."""
    rollout = cfg.rollout
    k = options.samples_per_task
    waves = math.ceil(n_tasks * k / options.concurrency) * (rollout.max_infra_retries + 1)
    return waves * (rollout.trial_timeout_s + 120.0) + 300.0


async def _run_groups(runner: Any, tasks: list[Path], options: EvalOptions, sampler: Any,
                      timeout: float) -> list[Any]:  # fmt: skip
    k = options.samples_per_task
    async with asyncio.timeout(timeout):
        return list(await asyncio.gather(*(
            runner.run_group(task, k, sampler, agent_kwargs=[
                {"seed": options.seed + 1000 * index + i} for i in range(k)
            ])
            for index, task in enumerate(tasks)
        )))  # fmt: skip


async def _run_mcp(
    cfg: Any, options: EvalOptions, tasks: list[Path]
) -> tuple[list[Any], Any, Any, dict[str, Any]]:
    """Our MCP agent sampling the model on the configured backend."""
    from transformers import AutoTokenizer

    from oneloop.agents.trials import TrialRunner
    from oneloop.backends import connect
    from oneloop.loop.train import trial_runner_config

    service = connect(cfg.backend)
    init_ray(include_dashboard=False, configure_logging=False)  # tinker: Ray runs the trials
    reclaim_signals()  # ray.init replaced the SIGTERM handler with one that aborts the driver
    status = "errored"
    try:
        base_model = options.base_model or cfg.model.base_model
        sampler = await _sampling_client(service, options, base_model)
        tokenizer = tokenizer_path(service, sampler, options.tokenizer)
        temperature = cfg.agent.temperature if options.temperature is None else options.temperature
        runner = TrialRunner(trial_runner_config(cfg, tokenizer, temperature, options.concurrency))
        timeout = _batch_timeout(cfg, options, len(tasks))
        groups = await _run_groups(runner, tasks, options, sampler, timeout)
        hf_tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, tokenizer)
        status = "success"
    finally:
        await asyncio.wait_for(service.close(status), 60.0)
    settings = {"model": options.model_path or base_model, "temperature": temperature}
    return groups, runner, lambda tokens: hf_tokenizer.decode(list(tokens)), settings


async def _run_harbor_agent(
    cfg: Any,
    options: EvalOptions,
    tasks: list[Path],
    agent_name: str | None,
    agent_import: str | None,
) -> tuple[list[Any], Any]:
    """Any other Harbor agent (oracle, a built-in, module:Class): no backend, no sampler."""
    from oneloop.agents.trials import TrialRunner
    from oneloop.loop.train import trial_runner_config

    if options.model_path is not None or options.base_model is not None:
        raise ConfigError(
            f"--model-path/--base-model: the {options.agent!r} agent brings its own model; "
            "these flags apply to --agent mcp only"
        )
    base = trial_runner_config(cfg, "-", 0.0, options.concurrency)
    runner = TrialRunner(
        replace(base, agent_name=agent_name, agent_import_path=agent_import, agent_kwargs={})
    )
    init_ray(include_dashboard=False, configure_logging=False)
    reclaim_signals()
    timeout = _batch_timeout(cfg, options, len(tasks))
    return await _run_groups(runner, tasks, options, None, timeout), runner
