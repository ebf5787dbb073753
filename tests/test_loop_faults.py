"""The loop keeps going through broken rollouts: failing environments, verifiers that write no
reward, an MCP server that crashes and one that hangs (the trial hits its agent timeout) are
retried or masked, the tasks dropped after three tries, and every event is counted in
metrics.jsonl. (A crashed sampler actor is covered in test_local_backend.)"""

import json
import re
import shutil
from pathlib import Path

import pytest

from oneloop.agents.demo_tasks.generator import Difficulty, Fault, generate_tasks

ROOT = Path(__file__).resolve().parents[1]


def with_mcp_server(task_dir: Path, code: str, agent_timeout_sec: float | None = None) -> None:
    """Replace the task's stdio MCP server by `python -c code` (a crash, a hang)."""
    toml = task_dir / "task.toml"
    text = re.sub(r"^args = .*$", f"args = {json.dumps(['-c', code])}", toml.read_text(), flags=re.M)
    if agent_timeout_sec is not None:
        text = re.sub(r"(\[agent\]\ntimeout_sec = )[0-9.]+", rf"\g<1>{agent_timeout_sec}", text)
    toml.write_text(text)


@pytest.mark.timeout(1500)
def test_run_survives_broken_tasks_and_counts_them(tmp_path, train_script):
    tasks = tmp_path / "tasks"
    good = generate_tasks(tmp_path / "good", 6, 1, 0, difficulties=(Difficulty.EASY,))
    broken_env = generate_tasks(tmp_path / "env", 1, 1, 1, fault=Fault.ENV_START_FAIL)
    no_reward = generate_tasks(tmp_path / "reward", 1, 1, 2, fault=Fault.NO_REWARD)
    for split in ("train", "eval"):
        (tasks / split).mkdir(parents=True)
    for task in (*good.train, *broken_env.train, *no_reward.train):
        shutil.copytree(task.path, tasks / "train" / f"{task.path.name}-{task.fault}")
    mcp = generate_tasks(tmp_path / "mcp", 2, 0, 3, difficulties=(Difficulty.EASY,))
    crashed = tasks / "train" / "mcp-server-crash"
    shutil.copytree(mcp.train[0].path, crashed)
    with_mcp_server(crashed, "import sys; sys.exit(3)")
    hung = tasks / "train" / "mcp-server-hang"
    shutil.copytree(mcp.train[1].path, hung)
    with_mcp_server(hung, "import time; time.sleep(3600)", agent_timeout_sec=5.0)
    for task in good.eval:
        shutil.copytree(task.path, tasks / "eval" / task.path.name)
    run_dir = tmp_path / "run"
    train_script.run(
        run_dir,
        tmp_path / "backend",
        f"tasks.dir={tasks}",
        "sft=null",
        "model.base_model=oneloop/tiny-qwen3",
        "eval=null",
        "algo.max_steps=3",
        "algo.groups_per_step=2",
        "algo.group_size=2",
        "algo.max_staleness=1",
        "algo.filter_zero_variance=false",
        "rollout.max_infra_retries=1",
        "agent.max_turns=1",
        "agent.max_tokens_per_turn=8",
        "logging.console=false",
    )
    lines = train_script.rows(run_dir)
    totals: dict[str, float] = {}
    for line in lines:
        for key, value in line.items():
            if key.startswith("rollout/"):
                totals[key] = totals.get(key, 0.0) + value
    assert [x["step"] for x in lines if "train/loss" in x] == [1, 2, 3]
    assert totals.get("rollout/groups_masked_infra_error_after_retries", 0) >= 1, totals
    assert totals.get("rollout/outcome_infra_error", 0) >= 1, totals
    assert totals.get("rollout/outcome_agent_timeout", 0) >= 1, totals  # the hung MCP server
    results = [json.loads(p.read_text()) for p in (run_dir / "trials").glob("*/result.json")]
    errors = " ".join(json.dumps(r.get("exception_info")) for r in results)
    assert "mcp-server-crash" in " ".join(r.get("trial_name", "") for r in results)
    assert "AgentTimeoutError" in errors, errors[:2000]
    checkpoint = json.loads((run_dir / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert len(checkpoint["consumed"]) == len(set(checkpoint["consumed"]))
