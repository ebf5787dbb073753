"""The training loop: one async RL loop against the Tinker client surface, on either backend.

Reads top to bottom (`train`): check capabilities → tasks and SFT data → connect → trainer (fresh
or resumed) → SFT warm start → held-out eval → RL steps (take B groups → datums →
forward_backward + optim_step submitted back to back → publish new weights → log → checkpoint) →
held-out eval → plots.
Rollouts run concurrently in `RolloutPool` under the staleness gate; the trainer only waits when no
B groups are ready (`time/wait_for_rollouts`); while it waits it prints progress every
`logging.wait_progress_s` and warns when most finished groups are dropped for zero variance.
Departure from textbook GRPO: groups are trained in finish order, sorted by sample id within a
step so a step's batch does not depend on timing.

Stopping: run under `oneloop.loop.signals.run_stoppable` (the CLI does), SIGTERM/SIGINT cancel the
run at its next await; a checkpoint is never cut (`deferred_stop`), so the step in progress is
either checkpointed or abandoned, and `--resume` redoes it.
"""

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types

from oneloop.agents.demo_tasks.demonstrations import DEMONSTRATIONS_FILE, write_demonstrations
from oneloop.agents.demo_tasks.generator import Difficulty, TaskSplits, generate_tasks
from oneloop.agents.gateway.trial import default_agent_import_path
from oneloop.agents.providers import container_free_warning, preflight_environment
from oneloop.agents.tasks_check import screen_tasks
from oneloop.agents.trials import TrialRunner, TrialRunnerConfig, runner_for
from oneloop.backends import capabilities, connect
from oneloop.backends.capabilities import Capabilities
from oneloop.backends.ray_runtime import init_ray
from oneloop.errors import CapabilityError, ConfigError
from oneloop.loop.advantages import (
    ScoredGroup,
    build_datums,
    logprob_gap,
    logprob_gap_per_datum,
)
from oneloop.loop.checkpoints import LoopState, append_checkpoint, last_checkpoint
from oneloop.loop.config import TrainConfig
from oneloop.loop.data import TaskSource
from oneloop.loop.metrics import (
    BackendCounters,
    MetricsLogger,
    routing_metrics,
    truncate_after,
)
from oneloop.loop.plots import write_plots
from oneloop.loop.rollouts import RolloutPool, report_wait
from oneloop.loop.sft import (
    Conversation,
    read_conversations,
    render_conversations,
    sft_warm_start,
)
from oneloop.loop.signals import deferred_stop, reclaim_signals
from oneloop.loop.staleness import StalenessGate

log = logging.getLogger(__name__)

STEP_FILES = ("metrics.jsonl", "logprob_gaps.jsonl", "trajectories.jsonl")
"""Per-step JSONL outputs (each line has its step); a resume cuts the steps after its checkpoint,
which it redoes."""


@dataclass
class Run:
    """What the loop holds for one run (built by `setup`)."""

    cfg: TrainConfig
    service: Any
    trainer: Any
    tokenizer_path: str
    sft_data: list[Conversation]
    train_tasks: list[Path]
    eval_tasks: list[Path]
    state: LoopState
    logger: MetricsLogger
    kind: str
    refused: dict[str, float] = field(default_factory=dict)
    """Tasks refused at startup as task-configuration outcomes (`tasks/refused_task_config_*`),
    in the step-0 line and the summary."""


async def train(cfg: TrainConfig, *, resume: bool = False) -> dict[str, float]:
    """Run SFT (if configured) and `algo.max_steps` RL steps; returns the final summary."""
    started = time.monotonic()
    run = await setup(cfg, resume)
    status = "errored"
    try:
        summary = await _run(run, {"setup": time.monotonic() - started})
        status = "success"
        return summary
    except asyncio.CancelledError:
        status = "interrupted"
        raise
    finally:
        run.logger.close()
        await asyncio.wait_for(run.service.close(status), cfg.timeouts.sync_s)


async def _run(run: Run, phases: dict[str, float]) -> dict[str, float]:
    """SFT, eval before, RL, eval after; `phases` collects each one's wall seconds (this process;
    a resumed run times only what it ran), reported in the summary as `time/phase_<name>_s`."""
    cfg = run.cfg
    before: dict[str, float] = {}
    mark = time.monotonic()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name], mark = now - mark, now

    if not run.state.sft_done and cfg.sft is not None:
        figures = await warm_start(run)  # sets sft_done: read run.state after it returns
        run.state = _replace(run.state, warm_start=figures)
        lap("sft")
        await checkpoint(run, 0)  # a crash from here on does not redo the warm start
    if cfg.eval is not None and not run.state.eval_before:
        run.state = _replace(run.state, eval_before=await evaluate(run, "eval_before"))
        lap("eval_before")
        if run.state.trainer_path:  # the warm start's checkpoint, now with the eval's figures
            append_checkpoint(cfg.run_dir, run.state)
    if run.state.step == 0:  # step 0, the model RL starts from (a resume at 0 logs it anew)
        before.update({k: v for k, v in run.refused.items() if v})
        before.update(run.state.warm_start)
        before.update(run.state.eval_before)
        if before:
            run.logger.log(0, before)
    summary = await rl(run)
    lap("rl")
    if cfg.eval is not None:
        after = await evaluate(run, "eval_after")
        run.logger.log(cfg.algo.max_steps + 1, after)
        summary.update(after)
        summary.update(run.state.eval_before)
        lap("eval_after")
    summary.update({f"time/phase_{name}_s": seconds for name, seconds in phases.items()})
    summary.update(run.refused)
    write_plots(cfg.run_dir)
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    return summary


async def setup(cfg: TrainConfig, resume: bool) -> Run:
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    rollout = cfg.rollout
    preflight_environment(  # a missing SDK, credential or daemon fails here, before SFT
        rollout.environment_type,
        None if rollout.environment_type else rollout.environment_import_path,
        "rollout.environment",
    )
    env_import = None if rollout.environment_type else rollout.environment_import_path
    warning = container_free_warning(cfg.tasks.dir, rollout.environment_type, env_import)
    if warning is not None:
        log.warning(warning)
    caps = capabilities(cfg.backend)  # before Ray or any actor starts
    kind = (
        "inflight"
        if cfg.algo.sampler_kind == "auto" and "inflight" in caps.sampler_kinds
        else ("snapshot" if cfg.algo.sampler_kind == "auto" else cfg.algo.sampler_kind)
    )
    check_capabilities(caps, cfg, kind)
    splits, train_tasks, eval_tasks = task_dirs(cfg)
    if cfg.eval is not None and cfg.eval.agent != "mcp":
        raise ConfigError(
            f"eval.agent={cfg.eval.agent!r}: the training loop evaluates its own model (mcp); "
            "run other agents with `oneloop eval --agent`"
        )
    # Tasks the environment cannot run are refused here, one line each, never tried (issue 24).
    screened = [
        screen_tasks(t, rollout.environment_type, env_import, log.warning, "tasks.dir")
        for t in (train_tasks, eval_tasks)
    ]
    refused = {
        f"tasks/refused_task_config_{split}": float(len(given) - len(kept))
        for split, given, kept in zip(("train", "eval"), (train_tasks, eval_tasks), screened,
                                      strict=True)  # fmt: skip
    }
    train_tasks, eval_tasks = screened
    previous = last_checkpoint(cfg.run_dir) if resume else None
    sft_data: list[Conversation] = []
    if cfg.sft is not None and not (previous is not None and previous.sft_done):
        # Read and checked before the backend starts: a bad file fails in seconds.
        path = await sft_data_path(cfg, splits)
        sft_data = await asyncio.to_thread(read_conversations, path)
        log.info("sft.data: %d conversations from %s", len(sft_data), path)
    service = connect(cfg.backend)
    init_ray(include_dashboard=False, configure_logging=False)  # tinker: Ray runs the trials
    reclaim_signals()  # ray.init replaced the SIGTERM handler with one that aborts the driver
    if previous is not None:
        trainer = await asyncio.wait_for(
            service.create_training_client_from_state_with_optimizer(previous.trainer_path),
            cfg.timeouts.sync_s,
        )
        state = previous
    else:
        trainer = await asyncio.wait_for(
            service.create_lora_training_client(
                cfg.model.base_model,
                rank=cfg.model.lora_rank,
                seed=cfg.model.seed,
                train_unembed=cfg.model.train_unembed,
            ),
            cfg.timeouts.sync_s,
        )
        state = LoopState(step=0, trainer_path="", cursor=0, sft_done=cfg.sft is None)
    if resume:  # no checkpoint yet: the run starts over, its step-0 line (SFT, eval) included;
        # a checkpoint at step 0 (the warm start's) logs its step-0 line again from the state
        keep = state.step if previous is not None and state.step > 0 else -1
        for name in STEP_FILES:
            truncate_after(cfg.run_dir / name, keep)
    logger = MetricsLogger(
        cfg.run_dir,
        console=cfg.logging.console,
        wandb=cfg.logging.wandb,
        tensorboard=cfg.logging.tensorboard,
        resume=resume,
    )
    tokenizer_path = trainer.get_info().model_data.tokenizer_id or cfg.model.base_model
    return Run(
        cfg, service, trainer, tokenizer_path, sft_data, train_tasks, eval_tasks, state, logger,
        kind, refused,
    )


def check_capabilities(caps: Capabilities, cfg: TrainConfig, kind: str) -> None:
    """Raise CapabilityError, prefixed with the config key's dotted path, for the first knob of
    `cfg` the backend cannot honour (`kind`: the sampler kind `algo.sampler_kind` resolved to)."""
    knobs: list[tuple[str, dict[str, Any]]] = [
        ("algo.loss_fn", {"loss_fns": [cfg.algo.loss_fn]}),
        ("sft", {"loss_fns": ["cross_entropy"] if cfg.sft else []}),  # the warm start's loss
        ("model.lora_rank", {"lora_rank": cfg.model.lora_rank}),
        ("algo.sampler_kind", {"sampler_kind": kind, "lora_rank": cfg.model.lora_rank}),
        ("model.base_model", {"base_model": cfg.model.base_model}),
    ]
    for path, knob in knobs:
        try:
            caps.check(**knob)
        except CapabilityError as error:
            raise CapabilityError(f"{path}: {error}") from None


async def sft_data_path(cfg: TrainConfig, splits: TaskSplits | None) -> Path:
    """The chat-conversation JSONL the warm start reads: `sft.data`, or for `sft.data: demo` the
    demonstrations of the generated demonstration tasks (`tasks.demo.n_demonstrations`), else of
    the training tasks, written beside them (`DEMONSTRATIONS_FILE`)."""
    assert cfg.sft is not None
    if cfg.sft.data != "demo":
        return Path(cfg.sft.data)
    if splits is None:  # the config validator rejects `demo` with tasks.dir; kept for callers
        raise ConfigError("sft.data: 'demo' needs the generated demo tasks (tasks.dir null)")
    path = cfg.run_dir / "tasks" / DEMONSTRATIONS_FILE
    fractions = dict(cfg.tasks.demo.wrong_tool_fraction)
    # In a thread: writing calls the calculator MCP server in process (its own event loop).
    return await asyncio.to_thread(
        write_demonstrations,
        path,
        splits.demonstrations or splits.train,
        fractions,
        cfg.agent.system_prompt,
    )


def task_dirs(cfg: TrainConfig) -> tuple[TaskSplits | None, list[Path], list[Path]]:
    """(demo splits or None, train task dirs, held-out task dirs) of `cfg.tasks`."""
    if cfg.tasks.dir is not None:
        root = cfg.tasks.dir
        train = sorted(p for p in (root / "train").glob("*") if (p / "task.toml").is_file())
        held = sorted(p for p in (root / "eval").glob("*") if (p / "task.toml").is_file())
        if not train:
            raise ConfigError(f"tasks.dir: no Harbor tasks under {root / 'train'}")
        return None, train, held
    demo = cfg.tasks.demo
    demo_warm_start = cfg.sft is not None and cfg.sft.data == "demo"
    splits = generate_tasks(
        cfg.run_dir / "tasks",
        demo.n_train,
        demo.n_eval,
        demo.seed,
        difficulties=tuple(Difficulty(d) for d in demo.difficulties),
        # drawn after train and eval, so those do not change with it; only for a demo warm start
        n_demonstrations=(demo.n_demonstrations or 0) if demo_warm_start else 0,
    )
    return splits, [t.path for t in splits.train], [t.path for t in splits.eval]


def _runner(run: Run, temperature: float) -> TrialRunner:
    cfg = run.cfg
    staleness_cap = (cfg.algo.max_staleness + 1) * cfg.algo.groups_per_step * cfg.algo.group_size
    cap = min(cfg.rollout.max_concurrency, staleness_cap)
    return runner_for(trial_runner_config(cfg, run.tokenizer_path, temperature, cap))


def trial_runner_config(
    cfg: TrainConfig, tokenizer_path: str, temperature: float, max_concurrent_trials: int
) -> TrialRunnerConfig:
    """The trial runner config of `cfg` (agent, environment, limits); shared with `oneloop eval`."""
    agent, rollout = cfg.agent, cfg.rollout
    return TrialRunnerConfig(
        trials_dir=cfg.run_dir / "trials",
        agent_kind=agent.kind,
        agent_import_path=default_agent_import_path(agent.kind, agent.import_path),
        agent_kwargs={
            "tokenizer_path": tokenizer_path,
            "sampler_key": "set-by-runner",
            "max_turns": agent.max_turns,
            "max_tokens_per_turn": agent.max_tokens_per_turn,
            "context_window": agent.context_window,
            "tool_timeout_s": agent.tool_timeout_s,
            "tool_result_max_chars": agent.tool_result_max_chars,
            "temperature": temperature,
            "top_p": agent.top_p,
            "system_prompt": agent.system_prompt,
        },
        environment_import_path=(
            None if rollout.environment_type is not None else rollout.environment_import_path
        ),
        environment_type=rollout.environment_type,
        environment_kwargs=dict(rollout.environment_kwargs),
        verifier_import_path=rollout.verifier_import_path,
        verifier_kwargs=dict(rollout.verifier_kwargs),
        max_concurrent_trials=max_concurrent_trials,
        trials_per_second=rollout.trials_per_second,
        trial_timeout_sec=rollout.trial_timeout_s,
        max_infra_retries=rollout.max_infra_retries,
    )


async def warm_start(run: Run) -> dict[str, float]:
    """`sft.steps` cross_entropy steps on the conversations of `sft.data`, rendered with the
    model's chat template as the agent lays out its trajectories."""
    cfg = run.cfg
    assert cfg.sft is not None and run.sft_data
    from oneloop.agents.renderer import ChatRenderer

    renderer = ChatRenderer.from_pretrained(run.tokenizer_path)
    demos = await asyncio.to_thread(render_conversations, run.sft_data, renderer)
    losses: list[float] = []
    rates: list[float] = []

    def record(step: int, metrics: dict[str, float]) -> None:
        losses.append(metrics["sft/loss_per_token"])
        rates.append(metrics["sft/learning_rate"])
        if cfg.logging.console:
            print(f"sft {step + 1}/{cfg.sft.steps} | loss/token {losses[-1]:.4f}", flush=True)

    await sft_warm_start(
        run.trainer,
        demos,
        cfg.sft.steps,
        cfg.sft.batch_size,
        cfg.sft.learning_rate,
        cfg.algo.seed,
        cfg.timeouts.train_s,
        record,
        cfg.sft.lr_schedule,
    )
    run.state = _replace(run.state, sft_done=True)
    return {
        "sft/loss_first": losses[0],
        "sft/loss_last": losses[-1],
        "sft/steps": float(len(losses)),
        "sft/learning_rate_last": rates[-1],
        "sft/examples": float(len(demos)),
    }


async def evaluate(run: Run, prefix: str) -> dict[str, float]:
    """Held-out success rate of the current weights (greedy by default)."""
    cfg = run.cfg
    assert cfg.eval is not None
    tasks = run.eval_tasks[: cfg.eval.n_tasks] if cfg.eval.n_tasks else run.eval_tasks
    sampler = await asyncio.wait_for(
        run.trainer.save_weights_and_get_sampling_client(kind="snapshot"), cfg.timeouts.sync_s
    )
    runner = _runner(run, cfg.eval.temperature)
    k = cfg.eval.samples_per_task
    groups = await asyncio.gather(
        *(
            runner.run_group(t, k, sampler, agent_kwargs=[{"seed": 1000 + i} for i in range(k)])
            for t in tasks
        )
    )
    rewards = [float(r.reward or 0.0) for g in groups for r in g.results]
    infra = sum(1 for g in groups for r in g.results if r.masked)
    metrics = {
        f"{prefix}/success_rate": sum(r > 0 for r in rewards) / max(len(rewards), 1),
        f"{prefix}/reward_mean": sum(rewards) / max(len(rewards), 1),
        f"{prefix}/masked": float(infra),
        f"{prefix}/n": float(len(rewards)),
    }
    return metrics


async def rl(run: Run, runner: Any = None) -> dict[str, float]:
    """RL steps until `algo.max_steps`; `runner` (default: Harbor trials) runs rollout groups."""
    cfg, algo = run.cfg, run.cfg.algo
    source = TaskSource(run.train_tasks, algo.seed, run.state.cursor, set(run.state.consumed))
    gate = StalenessGate(algo.max_staleness, algo.groups_per_step, start_step=run.state.step)
    sampler = await publish(run)
    producers = max(
        1,
        min(
            cfg.rollout.max_concurrency // algo.group_size,
            (algo.max_staleness + 1) * algo.groups_per_step,
        ),
    )
    pool = RolloutPool(
        runner or _runner(run, cfg.agent.temperature),
        source,
        gate,
        group_size=algo.group_size,
        producers=producers,
        filter_zero_variance=algo.filter_zero_variance,
        group_timeout_s=cfg.timeouts.group_s,
        seed=algo.seed,
        max_zero_variance_in_a_row=algo.max_zero_variance_in_a_row,
    )
    pool.publish(sampler, run.state.step)
    backend = BackendCounters(run.service)  # backend/... events (e.g. sampler restarts)
    summary: dict[str, float] = {}
    try:
        for step in range(run.state.step, algo.max_steps):
            started = time.monotonic()
            groups = await pool.take(
                algo.groups_per_step,
                cfg.timeouts.wait_for_rollouts_s,
                report=lambda progress, step=step: report_wait(
                    step + 1, progress, cfg.logging.console, algo.max_zero_variance_in_a_row
                ),
                progress_every_s=cfg.logging.wait_progress_s,
            )
            waited = time.monotonic() - started
            staleness = gate.consume(len(groups), [g.version for g in groups])
            metrics = await train_step(run, sorted(groups, key=lambda g: g.sample_id), step + 1)
            source.mark_consumed([g.sample_id for g in groups])
            synced = time.monotonic()
            sampler = await publish(run)
            gate.advance()
            pool.publish(sampler, step + 1)
            now = time.monotonic()
            metrics.update(pool.drain_metrics())
            metrics.update(await backend.step_metrics(cfg.timeouts.sync_s))
            metrics.update(gate.metrics())
            metrics["staleness/batch_max"] = float(max(staleness, default=0))
            metrics.update(
                {
                    "time/wait_for_rollouts": waited,
                    "time/sync": now - synced,
                    "time/step": now - started,
                    "time/trainer_busy_frac": 1.0 - waited / max(now - started, 1e-9),
                }
            )
            run.logger.log(step + 1, metrics)
            summary = metrics
            if (step + 1) % cfg.checkpoint.every_steps == 0 or step + 1 == algo.max_steps:
                await checkpoint(run, step + 1, source.cursor, sorted(source.consumed))
    finally:
        await pool.close()
    return summary


async def train_step(
    run: Run, groups: list[ScoredGroup], step: int | None = None
) -> dict[str, float]:
    """forward_backward and optim_step submitted back to back, then awaited (bounded)."""
    cfg, algo = run.cfg, run.cfg.algo
    datums, masks = build_datums(
        groups, algo.reduction, algo.std_normalize, algo.routing_replay
    )
    started = time.monotonic()
    fwd = run.trainer.forward_backward(datums, algo.loss_fn, algo.loss_fn_config or None)
    opt = run.trainer.optim_step(
        types.AdamParams(
            learning_rate=algo.learning_rate,
            weight_decay=algo.weight_decay,
            grad_clip_norm=algo.grad_clip_norm,
        )
    )
    async with asyncio.timeout(cfg.timeouts.train_s):
        output = await fwd
        optim = await opt
    metrics = {
        "train/loss": output.metrics.get("loss:sum", 0.0),
        "train/datums": float(len(datums)),
        "train/tokens": float(sum(d.model_input.length for d in datums)),
        "time/train": time.monotonic() - started,
    }
    metrics.update({f"train/{k.split(':')[0]}": v for k, v in (optim.metrics or {}).items()})
    metrics.update(logprob_gap(datums, masks, output))
    metrics.update(routing_metrics(output.metrics))
    rewards = [r for g in groups for r in g.rewards]
    metrics["train/reward_mean"] = sum(rewards) / len(rewards)
    _write_gaps(run, step, groups, logprob_gap_per_datum(datums, masks, output))
    _write_trajectories(run, step, groups)
    return metrics


async def publish(run: Run) -> Any:
    """New weights to the samplers: inflight where supported, snapshot otherwise."""
    return await asyncio.wait_for(
        run.trainer.save_weights_and_get_sampling_client(kind=run.kind), run.cfg.timeouts.sync_s
    )


async def checkpoint(
    run: Run, step: int, cursor: int = 0, consumed: list[str] | None = None
) -> None:
    """Trainer state, then its checkpoints.jsonl line; a stop signal waits for both. Step 0 is
    the warm start's checkpoint (no task handed out yet)."""
    with deferred_stop():
        saved = await asyncio.wait_for(
            run.trainer.save_state(f"step-{step:06d}", overwrite=True), run.cfg.timeouts.sync_s
        )
        run.state = _replace(
            run.state, step=step, trainer_path=saved.path, cursor=cursor, consumed=consumed or []
        )
        append_checkpoint(run.cfg.run_dir, run.state)
    write_plots(run.cfg.run_dir)


def _write_gaps(
    run: Run, step: int | None, groups: list[ScoredGroup], gaps: list[dict[str, float]]
) -> None:
    """One `logprob_gaps.jsonl` row per trained trajectory (datums are in group order); `digest`
    (its first sampled segment's) finds the trajectory among the Harbor trials (`oneloop
    inspect`)."""
    rows = [
        (group, index, trajectory, reward)
        for group in groups
        for index, (trajectory, reward) in enumerate(
            zip(group.trajectories, group.rewards, strict=True)
        )
    ]
    with (run.cfg.run_dir / "logprob_gaps.jsonl").open("a") as handle:
        for (group, index, trajectory, reward), gap in zip(rows, gaps, strict=True):
            sampled = trajectory.sampled_segments
            row = {"step": step, "sample_id": group.sample_id, "task": group.task}
            row |= {"version": group.version, "index": index, "reward": reward, **gap}
            row["digest"] = sampled[0].digest if sampled else None
            handle.write(json.dumps(row) + "\n")


def _write_trajectories(run: Run, step: int | None, groups: list[ScoredGroup]) -> None:
    limit = run.cfg.logging.trajectories_per_step
    if limit == 0:
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.tokenizer_path)
    with (run.cfg.run_dir / "trajectories.jsonl").open("a") as handle:
        for group in groups:
            for trajectory, reward in list(zip(group.trajectories, group.rewards, strict=True))[
                :limit
            ]:
                segments = [
                    {
                        "kind": s.kind,
                        "trained": s.kind == "sampled",
                        "text": tokenizer.decode(list(s.tokens)),
                    }
                    for s in trajectory.segments
                ]
                handle.write(
                    json.dumps(
                        {
                            "step": step,  # the optimizer step these trajectories trained
                            "sample_id": group.sample_id,
                            "version": group.version,
                            "reward": reward,
                            "segments": segments,
                        }
                    )
                    + "\n"
                )
            limit -= 1
            if limit <= 0:
                return


def _replace(state: LoopState, **changes: Any) -> LoopState:
    from dataclasses import replace

    return replace(state, **changes)
