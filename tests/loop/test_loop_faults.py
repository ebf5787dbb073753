"""The loop keeps going through broken rollouts: failing environments, verifiers that write no
reward, an MCP server that crashes mid-trial and one that hangs (the trial hits its agent timeout)
are retried or masked, the tasks dropped after three tries, and every event is counted in
metrics.jsonl, the crash in a class of its own. A sampler actor killed mid-run is restarted by
Ray, the run finishes its steps without losing or repeating a task, and the restart is counted
(`backend/sampler_restarts`)."""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from oneloop.agents.demo_tasks.generator import Difficulty, Fault, generate_tasks
from oneloop.agents.demo_tasks.server import CRASH_EXIT_CODE
from oneloop.agents.environment import STDIO_EXIT_PREFIX
from oneloop.loop.data import TaskSource
from tests.agents.test_tasks_check import set_task_field

ROOT = Path(__file__).resolve().parents[2]


def with_mcp_server(task_dir: Path, code: str, agent_timeout_sec: float | None = None) -> None:
    """Replace the task's stdio MCP server by `python -c code` (a crash, a hang)."""
    toml = task_dir / "task.toml"
    text = re.sub(
        r"^args = .*$", f"args = {json.dumps(['-c', code])}", toml.read_text(), flags=re.M
    )
    if agent_timeout_sec is not None:
        text = re.sub(r"(\[agent\]\ntimeout_sec = )[0-9.]+", rf"\g<1>{agent_timeout_sec}", text)
    toml.write_text(text)


def with_server_flags(task_dir: Path, *flags: str) -> None:
    """Add fault-injection flags to the task's own (real) MCP server's arguments."""
    toml = task_dir / "task.toml"
    (line,) = re.findall(r"^args = (.*)$", toml.read_text(), flags=re.M)
    args = json.dumps([*json.loads(line), *flags])
    toml.write_text(re.sub(r"^args = .*$", f"args = {args}", toml.read_text(), flags=re.M))


def trial_records(run_dir: Path, task: str) -> tuple[list[dict], list[list[str]]]:
    """result.json of each finished trial of the task directory named `task`, and the stdio
    exit records (one line per MCP server that exited nonzero) beside each."""
    results, exits = [], []
    for path in sorted((run_dir / "trials").glob(f"{task}__*/result.json")):
        results.append(json.loads(path.read_text()))
        records = (path.parent / "agent").glob(f"{STDIO_EXIT_PREFIX}*.txt")
        exits.append([record.read_text().strip() for record in records])
    return results, exits


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
    # The real calculator server answers the agent's connect (handshake and tools/list), then
    # dies while the agent works (the untrained policy calls no tool).
    with_server_flags(crashed, "--exit-after-tool-replies", "1")
    hung = tasks / "train" / "mcp-server-hang"
    shutil.copytree(mcp.train[1].path, hung)
    with_mcp_server(hung, "import time; time.sleep(3600)", agent_timeout_sec=5.0)
    for task in good.eval:
        shutil.copytree(task.path, tasks / "eval" / task.path.name)
    # A data order that hands out the crash task first, so its three groups (one per allowed
    # attempt) all finish inside the run's three steps and are counted exactly, and the other
    # faulty tasks among the first five, so they run before the good tasks run out.
    train = list((tasks / "train").iterdir())
    faults = {p for p in train if not p.name.endswith("-none")}
    assert len(faults) == 4, faults

    def first_epoch(seed: int) -> list[Path]:
        source = TaskSource(train, seed)
        return [source.next().task for _ in train]

    seed = next(
        s for s in range(1000) if (o := first_epoch(s))[0] == crashed and faults <= set(o[:5])
    )
    # Tasks the container-free environment cannot honour, an agent that must run as a non-root
    # user and an environment without network: refused at startup with one line each, counted,
    # never tried (issue 24). Added after the data order above was chosen: the loop drops them
    # before its TaskSource.
    refused = {"runs-as-agent-user": ("agent", 'user = "agent"'),
               "without-network": ("environment", 'network_mode = "no-network"')}  # fmt: skip
    for name, (table, field) in refused.items():
        shutil.copytree(good.train[0].path, tasks / "train" / name)
        set_task_field(tasks / "train" / name, table, field)
    run_dir = tmp_path / "run"
    done = train_script.run(
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
        f"algo.seed={seed}",
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
    assert done.stderr.count("task_config:") == 2
    assert all(name in done.stderr for name in refused), done.stderr[-3000:]
    assert [x["tasks/refused_task_config_train"] for x in lines if x["step"] == 0] == [2.0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tasks/refused_task_config_train"] == 2.0
    for name in refused:
        assert not list((run_dir / "trials").glob(f"{name}*"))  # never tried
    assert totals.get("rollout/outcome_agent_timeout", 0) >= 1, totals  # the hung MCP server
    # The mid-trial crash is counted in its own class: 3 groups (the task is dropped after its
    # third) of 2 trials...
    crashes = totals.get("rollout/outcome_mcp_server_crash", 0)
    infra = totals.get("rollout/outcome_infra_error", 0)  # the failing environment, no reward
    assert crashes == 6, totals
    assert infra >= 4 and infra % 2 == 0, totals  # a group of each at least
    # ... and every trial of a masked group in exactly one of the two infra classes.
    assert crashes + infra == 2 * totals["rollout/groups_masked_infra_error_after_retries"], totals
    # The crash task ran 12 times (6 trials, each retried once): each attempt crashed mid-trial,
    # after the agent had connected and sampled (no exception), leaving the server's exit status.
    results, exits = trial_records(run_dir, "mcp-server-crash")
    # At least those: a trial of the task still running when the run stopped after step 3 leaves
    # its record without being counted (seen in CI: 14 records for 6 counted trials; and 13, a
    # trial stopped between its first attempt and the retry, so the count need not be even).
    assert len(results) >= 2 * crashes, (totals, len(results))
    for result, records in zip(results, exits, strict=True):
        assert result["exception_info"] is None, result["exception_info"]
        assert result["agent_result"]["metadata"]["turns"] >= 1
        assert [r.split()[0] for r in records] == [str(CRASH_EXIT_CODE)], records
    # No other task's trial saw an MCP server exit.
    others = [p for p in (run_dir / "trials").glob("*/agent/" + STDIO_EXIT_PREFIX + "*.txt")
              if not p.parent.parent.name.startswith("mcp-server-crash__")]  # fmt: skip
    assert others == [], others
    results, _ = trial_records(run_dir, "mcp-server-hang")
    errors = " ".join(json.dumps(r.get("exception_info")) for r in results)
    assert "AgentTimeoutError" in errors, errors[:2000]
    checkpoint = json.loads((run_dir / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert len(checkpoint["consumed"]) == len(set(checkpoint["consumed"]))


def sampler_actor_pids(root: int) -> list[int]:
    """Processes of the local backend's sampler actor under `root` (the training process, whose
    `ray.init` started the raylet and its workers); Ray titles an actor's worker `ray::<Class>`."""
    pids = []
    for process in psutil.Process(root).children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue  # exited meanwhile
        if title.startswith("ray::SamplerActor"):
            pids.append(process.pid)
    return pids


def rl_rows(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    lines = metrics.read_text().split("\n")[:-1]  # the last piece may be a line being written
    return [row for row in map(json.loads, lines) if "train/loss" in row]


@pytest.mark.timeout(1500)
def test_run_survives_a_crashed_sampler_actor(tmp_path, train_script):
    """The sampler actor's process is SIGKILLed after step 1: Ray restarts it, the producers'
    sampling clients and the loop's next weight publish re-install weights on the new actor, the
    run trains all its steps, every task is accounted for, and the restart is counted."""
    run_dir, steps, groups_per_step = tmp_path / "run", 4, 2
    command = train_script.command(
        run_dir,
        tmp_path / "backend",
        "sft=null",
        "eval=null",
        "model.base_model=oneloop/tiny-qwen3",
        "tasks.demo.n_train=8",
        f"algo.max_steps={steps}",
        f"algo.groups_per_step={groups_per_step}",
        "algo.group_size=2",
        "algo.max_staleness=1",
        "algo.filter_zero_variance=false",
        "agent.max_turns=2",
        "agent.max_tokens_per_turn=8",
        "checkpoint.every_steps=1",
        "logging.console=false",
    )
    log = (tmp_path / "train.log").open("w")
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 1200
        while not rl_rows(run_dir / "metrics.jsonl"):
            assert process.poll() is None, (tmp_path / "train.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no RL step within 1200 s"
            time.sleep(0.2)
        pids = sampler_actor_pids(process.pid)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        killed_after = len(rl_rows(run_dir / "metrics.jsonl"))
        assert process.wait(timeout=1200) == 0, (tmp_path / "train.log").read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)
        log.close()
    assert killed_after < steps  # the crash hit the run mid-way, not after its last step
    rows = rl_rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all("backend/sampler_restarts" in r for r in rows)  # the local backend reports it
    assert sum(r["backend/sampler_restarts"] for r in rows) == 1, rows
    totals: Counter[str] = Counter()
    for row in rows:
        totals.update({k: v for k, v in row.items() if k.startswith("rollout/")})
    # The crash costs no trial: samples in flight are resubmitted to the restarted actor (a
    # sample that still failed would be an `infra_error` trial, retried, then a masked group).
    assert totals["rollout/outcome_infra_error"] == 0, totals
    assert totals["rollout/group_errors"] == 0, totals
    assert totals["rollout/tasks_dropped"] == 0, totals
    # Task accounting: each trained group's sample id trained at exactly one step; the last
    # checkpoint's consumed ids are exactly the trained ones plus groups seen without signal.
    trained: dict[str, set[int]] = {}
    for line in (run_dir / "logprob_gaps.jsonl").read_text().splitlines():
        row = json.loads(line)
        trained.setdefault(row["sample_id"], set()).add(row["step"])
    assert all(len(at) == 1 for at in trained.values()), trained
    assert len(trained) == steps * groups_per_step
    checkpoint = json.loads((run_dir / "checkpoints.jsonl").read_text().splitlines()[-1])
    consumed = checkpoint["consumed"]
    assert len(consumed) == len(set(consumed))
    assert set(trained) <= set(consumed)
    assert len(consumed) == len(trained) + totals["rollout/groups_zero_variance"], totals
    handed_out = {f"{i // 8}:{i % 8}" for i in range(checkpoint["cursor"])}
    assert set(consumed) <= handed_out
