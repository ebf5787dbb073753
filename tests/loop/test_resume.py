"""A run stopped twice between checkpoints, then resumed: first by SIGTERM mid-step (a
scheduler's preemption), then by kill -9. SIGTERM ends the process within 60 s with status 143,
its Ray processes gone and every logged step checkpointed; after both, `--resume` loses no task,
trains none twice, and each step it redoes has the loss and tokens of an uninterrupted run with
the same seed (S = 0, deterministic settings), and its final weights bit for bit. The tiny model
solves no task here, so every reward and RL loss is 0: a 2-step SFT warm start leaves Adam's
moments nonzero, so every RL step still moves the weights, and the weights carry the comparison
(restored weights and optimizer state, each step applied once)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
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
    "sft.steps=2",
    "sft.batch_size=2",
    "model.base_model=oneloop/tiny-qwen3",
    "eval=null",
]
SIGTERM_EXIT_S = 60  # issue 21: a SIGTERMed `oneloop train` ends within 60 s


def checkpoint_steps(run_dir: Path) -> list[int]:
    path = run_dir / "checkpoints.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line)["step"] for line in lines]


def step_weights(run_dir: Path, backend: Path, step: int) -> dict[str, np.ndarray]:
    """The trainer weights of the run's checkpoint at `step` (its checkpoints.jsonl line): the
    megatron engine's `model.safetensors` or the torch engine's `trainable.safetensors`."""
    from safetensors.numpy import load_file

    lines = (run_dir / "checkpoints.jsonl").read_text().splitlines()
    (path,) = [json.loads(x)["trainer_path"] for x in lines if json.loads(x)["step"] == step]
    (weights,) = (backend / path.removeprefix("tinker://")).glob("*.safetensors")
    return load_file(str(weights))


def assert_step_weights_equal(
    run_dir: Path, backend: Path, reference: Path, ref_backend: Path, step: int
) -> None:
    """The resumed run's weights at `step` equal the reference run's bit for bit, and that step
    moved the reference's weights (else the comparison would hold trivially)."""
    mine, theirs = step_weights(run_dir, backend, step), step_weights(reference, ref_backend, step)
    before = step_weights(reference, ref_backend, step - 1)
    moved = max(float(np.abs(theirs[k] - before[k]).max()) for k in theirs)
    gap = max(float(np.abs(mine[k] - theirs[k]).max()) for k in theirs)
    print(f"RESULT step {step} weights: max |resumed - reference| = {gap}; the step moved {moved}")
    assert sorted(mine) == sorted(theirs) and moved > 0 and gap == 0.0


def start_and_wait_for_checkpoint(command: list[str], run_dir: Path, after: int, log: Path):
    """Start the run; return it once checkpoints.jsonl holds a step past `after`."""
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if any(step > after for step in checkpoint_steps(run_dir)):
            break
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended before it could be stopped: {log.read_text()}"
    return proc


@pytest.mark.timeout(1500)
def test_sigterm_and_kill_then_resume_match_an_uninterrupted_run(tmp_path, train_script):
    reference = tmp_path / "reference"
    train_script.run(reference, tmp_path / "ref-backend", *DETERMINISTIC)

    run_dir, backend = tmp_path / "stopped", tmp_path / "stopped-backend"
    command = train_script.command(run_dir, backend, *DETERMINISTIC)
    log = tmp_path / "sigterm.log"
    proc = start_and_wait_for_checkpoint(command, run_dir, 0, log)
    ray_processes = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGTERM)  # the process alone, as a scheduler sends it
    assert proc.wait(timeout=SIGTERM_EXIT_S) == 128 + signal.SIGTERM, log.read_text()[-4000:]
    stderr = log.read_text()
    assert "oneloop train: stopped by SIGTERM; --resume continues after step" in stderr, stderr
    assert "Traceback" not in stderr and "SIGABRT" not in stderr, stderr[-4000:]
    _, alive = psutil.wait_procs(ray_processes, timeout=30)
    assert not alive, [p.pid for p in alive]  # Ray was shut down, not orphaned
    # Mid-step: a step is logged only with its checkpoint (none half-done), and the run stopped
    # before its end.
    stopped_at = checkpoint_steps(run_dir)[-1]
    rl_checkpoints = [step for step in checkpoint_steps(run_dir) if step > 0]  # 0: after SFT
    assert sorted(train_script.steps(run_dir)) == rl_checkpoints
    assert stopped_at < 3

    proc = start_and_wait_for_checkpoint(
        [*command, "--resume"], run_dir, stopped_at, tmp_path / "kill.log"
    )
    os.killpg(proc.pid, signal.SIGKILL)  # kill -9, workers included
    proc.wait(timeout=60)
    killed_at = checkpoint_steps(run_dir)[-1]
    assert stopped_at < killed_at < 3

    resumed = subprocess.run(
        [*command, "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, res = train_script.steps(reference), train_script.steps(run_dir)
    assert sorted(res) == [1, 2, 3]
    for step in range(stopped_at + 1, 4):
        assert res[step]["train/loss"] == ref[step]["train/loss"], step
        assert res[step]["train/tokens"] == ref[step]["train/tokens"], step
    consumed = json.loads((run_dir / "checkpoints.jsonl").read_text().splitlines()[-1])["consumed"]
    assert len(consumed) == len(set(consumed)) == 3 * 2, "a task was lost or trained twice"
    trained: dict[str, set[int]] = {}  # per-step outputs of redone steps were cut on resume
    for line in (run_dir / "logprob_gaps.jsonl").read_text().splitlines():
        row = json.loads(line)
        trained.setdefault(row["sample_id"], set()).add(row["step"])
    assert sorted(trained) == sorted(consumed) and all(len(s) == 1 for s in trained.values())
    assert_step_weights_equal(run_dir, backend, reference, tmp_path / "ref-backend", step=3)
