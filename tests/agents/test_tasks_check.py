"""Tasks refused before any trial (`oneloop tasks check`, the runner, the loop's startup screen)
and `oneloop eval --agent oracle`."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import ray

from oneloop.agents.demo_tasks import generate_tasks
from oneloop.agents.environment import NO_CONTAINER_IMPORT_PATH
from oneloop.agents.tasks_check import main as tasks_main
from oneloop.agents.tasks_check import screen_tasks
from oneloop.agents.trials import MaskReason, TrialOutcome, TrialRunner, TrialRunnerConfig
from oneloop.diagnostics.eval_cli import main as eval_main


@pytest.fixture(scope="module")
def ray_runtime():
    """A local Ray runtime, left running: the session's `local_service` may live on it (Ray's
    exit hook shuts it down), and later modules reuse it instead of paying a start."""
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)


def set_task_field(task: Path, table: str, line: str) -> None:
    """Add `line` to `[table]` of the task's task.toml (appended when there is no such table)."""
    toml = (task / "task.toml").read_text()
    head = f"[{table}]\n"
    toml = toml.replace(head, head + line + "\n", 1) if head in toml else toml + head + line + "\n"
    (task / "task.toml").write_text(toml)


def make_tasks(root: Path) -> dict[str, Path]:
    """Demo tasks in Harbor's format under `root/train/`, then broken in the ways a task written
    for Docker is: one good, one whose reference solution is wrong, and five refused."""
    splits = generate_tasks(root, n_train=7, n_eval=0, seed=21)
    paths = [t.path for t in splits.train]
    tasks = dict(zip(
        ["good", "wrong_solution", "user", "no_network", "dockerfile", "no_tests", "steps"],
        paths, strict=True,
    ))  # fmt: skip
    (tasks["wrong_solution"] / "solution" / "solve.sh").write_text(
        "#!/bin/sh\necho 424242 > /logs/agent/answer.txt\n"
    )
    set_task_field(tasks["user"], "agent", 'user = "agent"')
    set_task_field(tasks["no_network"], "environment", 'network_mode = "no-network"')
    (tasks["dockerfile"] / "environment" / "Dockerfile").write_text(
        "FROM ubuntu:24.04\nLABEL a=b\nRUN apt-get update && \\\n  apt-get install -y curl\n"
        "WORKDIR /app\n"
    )
    shutil.rmtree(tasks["no_tests"] / "tests")
    set_task_field(tasks["steps"], "[steps]", 'name = "one"')  # no steps/one/instruction.md
    return tasks


REASONS = {
    "user": "agent.user='agent'",
    "no_network": "network_mode='no-network'",
    "dockerfile": "FROM (line 1), RUN (line 3)",
    "no_tests": "tests/test.sh",
    "steps": "steps/one",
}


def test_tasks_check_refuses_with_one_line_each_and_the_oracle_finds_the_broken_task(
    ray_runtime, tmp_path, capsys
):
    tasks = make_tasks(tmp_path / "tasks")
    code = tasks_main([
        "check", str(tmp_path / "tasks"), "--oracle", "--trials-dir", str(tmp_path / "trials"),
    ])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    refused = [line for line in out if line.startswith("refused ")]
    assert len(refused) == len(REASONS), out
    for name, reason in REASONS.items():
        (line,) = [line for line in refused if f"{tasks[name]}:" in line]
        assert reason in line, line
    assert "2 of 7 tasks accepted" in "\n".join(out)
    zeros = [line for line in out if line.startswith("oracle 0 ")]
    assert len(zeros) == 1 and str(tasks["wrong_solution"]) in zeros[0], out
    # A container environment honours users, networks and Dockerfiles: only layout problems.
    assert tasks_main(["check", str(tmp_path / "tasks"), "--environment", "docker"]) == 1
    out = capsys.readouterr().out
    assert out.count("refused ") == 2 and "5 of 7 tasks accepted" in out

    # The loop's startup screen: one task_config line per refused task, the rest kept.
    lines: list[str] = []
    kept = screen_tasks(list(tasks.values()), None, NO_CONTAINER_IMPORT_PATH, lines.append)
    assert kept == [tasks["good"], tasks["wrong_solution"]]
    assert len(lines) == len(REASONS) and all(x.startswith("task_config: refused") for x in lines)


def test_refused_tasks_are_task_config_outcomes_never_retried_and_eval_oracle_pass_at_1(
    ray_runtime, tmp_path, capsys
):
    tasks = make_tasks(tmp_path / "tasks")
    runner = TrialRunner(
        TrialRunnerConfig(
            trials_dir=tmp_path / "runner-trials",
            agent_import_path=None,
            agent_name="oracle",
            environment_kwargs={"root_base_dir": str(tmp_path / "roots")},
            max_infra_retries=2,
        )
    )
    for name in ("user", "no_network"):
        group = asyncio.run(asyncio.wait_for(runner.run_group(tasks[name], 2, None), 60))
        assert group.mask_reason is MaskReason.TASK_CONFIG
        assert [r.outcome for r in group.results] == [TrialOutcome.TASK_CONFIG] * 2
        assert all(r.attempts == 0 and REASONS[name] in (r.error or "") for r in group.results)
    counts = runner.counters()
    assert counts["trials/final_task_config"] == 4 and counts["groups/masked_task_config"] == 2
    assert (
        counts["trials/retries"] == 0
        and sum(v for k, v in counts.items() if k.startswith("trials/attempts_")) == 0
    )
    assert not (tmp_path / "runner-trials").exists()  # no trial ever started

    # `oneloop eval --agent oracle`: Pass@1 = the fraction of tasks whose solution passes: 1 of
    # the 2 runnable ones; the refused task is its own class, outside Pass@1 like masked ones.
    for name in ("dockerfile", "no_tests", "steps", "no_network"):
        shutil.rmtree(tasks[name])
    run_dir = tmp_path / "eval"
    code = eval_main([
        "--agent", "oracle", "--run-dir", str(run_dir), "--concurrency", "4",
        f"tasks.dir={tmp_path / 'tasks'}", "sft=null",
    ])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Pass@1 0.500" in captured.out
    assert captured.err.count("task_config: refused") == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["settings"]["agent"] == "oracle"
    assert summary["outcomes"]["final"]["task_config"] == 1
    assert summary["outcomes"]["final"]["ok"] == 2
    rows = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(r["passed"] for r in rows) == [False, False, True]
