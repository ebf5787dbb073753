"""Kill -9 between checkpoints, then --resume: no task lost or trained twice, and the next step's
loss equals that of an uninterrupted run with the same seed (S = 0, deterministic settings)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DETERMINISTIC = [
    "algo.max_steps=3",
    "algo.groups_per_step=2",
    "algo.group_size=2",
    "algo.max_staleness=0",
    "algo.filter_zero_variance=false",
    "tasks.demo.n_train=6",
    "tasks.demo.n_eval=2",
    "agent.max_turns=2",
    "agent.max_tokens_per_turn=12",
    "checkpoint.every_steps=1",
    "logging.console=false",
    "sft=null",
    "model.base_model=oneloop/tiny-qwen3",
    "eval=null",
]


@pytest.mark.timeout(1500)
def test_kill_and_resume_matches_uninterrupted_run(tmp_path, train_script):
    reference = tmp_path / "reference"
    train_script.run(reference, tmp_path / "ref-backend", *DETERMINISTIC)

    crashed = tmp_path / "crashed"
    proc = subprocess.Popen(
        train_script.command(crashed, tmp_path / "crash-backend", *DETERMINISTIC),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    checkpoints = crashed / "checkpoints.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if checkpoints.is_file() and checkpoints.read_text().count("\n") >= 1:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # kill -9, workers included
    proc.wait(timeout=60)
    killed_at = json.loads(checkpoints.read_text().splitlines()[-1])["step"]
    assert killed_at < 3

    resumed = subprocess.run(
        train_script.command(crashed, tmp_path / "crash-backend", *DETERMINISTIC, "--resume"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, res = train_script.steps(reference), train_script.steps(crashed)
    assert sorted(res) == [1, 2, 3]
    for step in range(killed_at + 1, 4):
        assert res[step]["train/loss"] == ref[step]["train/loss"], step
        assert res[step]["train/tokens"] == ref[step]["train/tokens"], step
    final = json.loads(checkpoints.read_text().splitlines()[-1])
    consumed = final["consumed"]
    assert len(consumed) == len(set(consumed)) == 3 * 2, "a task was lost or trained twice"
