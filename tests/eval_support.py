"""Shared by test_eval and test_inspect: a tiny model taught to use the demo tools, the task
directories it was taught on (plain and with injected faults), and `oneloop eval` runs over them.

The tiny model learns two demo episodes (one `+` and one `-` question) by SFT through the same
Tinker seam and the same demonstrations the loop's warm start uses, so in eval it really calls
`add` / `subtract` / `submit_answer` through a real MCP server. Expensive steps (SFT, eval runs)
are cached under pytest's session base temp, so each runs once per session whichever module asks.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

from oneloop.agents.demo_tasks import Difficulty, generate_tasks

# Full fine-tuning at 3e-3 until both episodes' first turns are reproduced greedily: 80 steps did
# for the pair the generator gave before differences were kept >= 0 (6 + 32, 17 - 25); the pair
# since (40 + 32, 17 - 13) greedily never called `add` after 80 and does after 160.
SFT_STEPS = 160
SFT_LEARNING_RATE = 3e-3
TASK_SEED = 3
FAULTS_SCRIPT = Path(__file__).with_name("eval_faults.py")
ERROR_TOOL = "add"  # always fails with the MCP is_error flag
TRACEBACK_TOOL = "subtract"  # returns a traceback text as a success (caught by a pattern)


def _tasks(work: Path):
    splits = generate_tasks(work / "family", 40, 0, TASK_SEED, difficulties=(Difficulty.EASY,))
    plus = next(t for t in splits.train if " + " in t.question.text)
    minus = next(t for t in splits.train if " - " in t.question.text)
    return [plus, minus]


def _task_dir(tasks, root: Path, faulty: bool) -> Path:
    for task in tasks:
        target = root / "train" / task.path.name
        shutil.copytree(task.path, target)
        if faulty:
            toml = target / "task.toml"
            args = json.dumps([
                str(FAULTS_SCRIPT), "--answer-path", "/logs/agent/answer.txt",
                "--error-tool", ERROR_TOOL, "--traceback-tool", TRACEBACK_TOOL,
            ])  # fmt: skip
            text, count = re.subn(r"(?m)^args = .*$", f"args = {args}", toml.read_text())
            assert count == 1, "task.toml layout changed: no single `args =` line"
            toml.write_text(text)
    (root / "eval").mkdir(parents=True, exist_ok=True)
    return root


def taught(local_service, base: Path) -> dict:
    """{checkpoint, backend_dir, tasks_dir, faulty_tasks_dir, tasks}; SFT once per session."""
    cache = base / "eval-taught"
    done = cache / "taught.json"
    if done.is_file():
        return json.loads(done.read_text())
    from oneloop.agents.demo_tasks.demonstrations import demo_tool_specs, demonstration
    from oneloop.agents.renderer import ChatRenderer
    from oneloop.loop.sft import sft_warm_start
    from oneloop.tiny.model import TINY_MODEL_NAME, build_tiny_model

    shutil.rmtree(cache, ignore_errors=True)
    tasks = _tasks(cache)
    renderer = ChatRenderer.from_pretrained(build_tiny_model())
    tools = demo_tool_specs()
    demos = [demonstration(task, renderer, tools, None) for task in tasks]

    async def sft() -> str:
        trainer = await asyncio.wait_for(
            local_service.create_lora_training_client(TINY_MODEL_NAME, rank=0, seed=0), 300
        )
        await sft_warm_start(
            trainer, demos, SFT_STEPS, len(demos), SFT_LEARNING_RATE, 0, 600, lambda *_: None
        )
        saved = await asyncio.wait_for(trainer.save_weights_for_sampler("eval-taught"), 300)
        return saved.path

    info = {
        "checkpoint": asyncio.run(sft()),
        "backend_dir": str(local_service.run_dir),
        "tasks_dir": str(_task_dir(tasks, cache / "tasks", faulty=False)),
        "faulty_tasks_dir": str(_task_dir(tasks, cache / "faulty-tasks", faulty=True)),
        "tasks": [{"name": t.path.name, "answer": t.question.answer} for t in tasks],
    }
    done.write_text(json.dumps(info))
    return info


def common_args(info: dict, run_dir: Path, tasks_dir: str) -> list[str]:
    return [
        "--model-path", info["checkpoint"], "--run-dir", str(run_dir),
        f"backend.run_dir={info['backend_dir']}", "backend.local.torch_threads=1",
        "model.base_model=oneloop/tiny-qwen3", f"tasks.dir={tasks_dir}", "sft=null",
        "agent.max_turns=3", "agent.max_tokens_per_turn=40", "logging.console=false",
    ]  # fmt: skip


def eval_run(local_service, base: Path, name: str) -> tuple[Path, dict]:
    """Run (once per session) one of the named eval runs; returns (run dir, taught info).

    `plain`: the taught tasks, k=2 at temperature 1. `faults`: the faulty server tasks in the
    flaky environment (every other start fails), k=2, greedy, concurrency 2, 4 retries.
    """
    from oneloop.diagnostics.eval_cli import main

    info = taught(local_service, base)
    run_dir = base / f"eval-run-{name}"
    if (run_dir / "summary.json").is_file():
        return run_dir, info
    shutil.rmtree(run_dir, ignore_errors=True)
    if name == "plain":
        args = common_args(info, run_dir, info["tasks_dir"])
        args += ["--samples-per-task", "2", "--concurrency", "4", "--temperature", "1.0"]
    else:
        counter = base / "flaky-starts.txt"
        counter.unlink(missing_ok=True)
        args = common_args(info, run_dir, info["faulty_tasks_dir"])
        args += [
            "--samples-per-task", "2", "--concurrency", "2", "--temperature", "0",
            "rollout.environment_import_path=tests.eval_faults:FlakyStartEnvironment",
            f"rollout.environment_kwargs.counter_path={counter}",
            # Starts alternate fail/succeed and each success ends one of the 4 trajectories, so
            # one trajectory fails at most 4 times in a row: 4 retries always reach a success.
            "rollout.max_infra_retries=4",
        ]  # fmt: skip
    assert main(args) == 0
    return run_dir, info
