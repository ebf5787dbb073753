"""Issue 18, run level: a real `oneloop train` run whose megatron trainer has two rank actors
(dp = 2, gloo, CPU) loses one of them in the middle of a call, then `--resume` continues.

Three runs of `scripts/train.py --config demo-cpu`. The model is the tiny Qwen3 with a two-step
SFT warm start, which leaves Adam's moments nonzero, so every RL step moves the weights even
though every reward is 0. Then two RL steps at S = 0, with a checkpoint after every step. Ray
starts each run's workers with `megatron_run_hook`, which puts the factory's megatron group on
the CPU (the product runs megatron on CUDA only).
- reference: the run uninterrupted. It runs alongside the killed one; both mostly wait.
- killed: once step 1 is checkpointed, the first rank actor seen inside a group call (process
  title `ray::MegatronRankActor.call`) gets SIGKILL, as the OOM killer would send it. The run
  must exit 1 well within the group's call bound. It prints the group's error naming the rank,
  its node, its pid and the call, then the resume point, with no traceback. Its Ray processes
  must be gone, and step 2 must not be checkpointed. (Its metrics line may be there already: the
  loop logs a step and then checkpoints it, and a kill inside that checkpoint's save_state leaves
  the line and a partial checkpoint directory that no checkpoints.jsonl line names.)
- resumed: `--resume` rebuilds the group from the step-1 checkpoint and runs step 2. Every step is
  logged once (resume cuts the lines past its checkpoint) and every task is trained once. Step
  2's loss, token count and sampled tokens equal the reference's, and so do its step-2 weights,
  bit for bit. That needs the step-1 weights and the optimizer state restored and exactly one
  optim_step applied. The loss is 0 in both runs (every reward is 0), and the trainer-vs-sampler
  logprob gap is only rounding in both (under 1e-6, and not bitwise equal across runs), so the
  weights carry the comparison.
"""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from cpu_megatron import HERE, megatron_core_installed
from megatron_run_hook import HOOK

from tests.loop.test_resume import DETERMINISTIC, assert_step_weights_equal, checkpoint_steps

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[4]
# test_resume's small deterministic run (a 2-step SFT warm start: its momentum moves the weights
# even where every reward is 0), with 2 RL steps, on a dp = 2 megatron trainer
RUN = [
    *(o for o in DETERMINISTIC if not o.startswith("algo.max_steps=")),
    "algo.max_steps=2",
    "backend.local.trainer_engine=megatron",
    "backend.local.megatron.dp=2",
    "backend.local.gpus_per_trainer=2",  # the product's rule: one per rank (none used on CPU)
    "backend.local.megatron.speed.compile_logprobs=false",  # Inductor: ~30 s a rank on 2 cores
    "backend.local.megatron.speed.swiglu_fusion=false",
    "backend.local.torch_threads=1",
]
RUN_S = 600  # one run, from start to its end, on CI's two shared cores
KILL_EXIT_S = 60  # kill to exit: the call fails at once, well before the group's 600 s bound
RANK_LINE = re.compile(
    r"^rank (\d+) \(dp \d+, pp 0, cp 0, tp 0\) on node (\S+) \((\w+)\), pid (\d+) during (\w+): "
    r"died: (.*)$",
    re.MULTILINE,
)


def run_env() -> dict[str, str]:
    """The test's environment plus Ray's job runtime env: `megatron_run_hook` in every worker."""
    path = os.pathsep.join(p for p in (str(ROOT), str(HERE), os.environ.get("PYTHONPATH")) if p)
    job = {"runtime_env": {"worker_process_setup_hook": HOOK}}
    return {**os.environ, "PYTHONPATH": path, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}


def start(command: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=run_env(),
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
    )


def rank_actors(proc: subprocess.Popen) -> list[int]:
    """The pids of the run's megatron rank actor processes (idle or inside a call)."""
    pids = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith("ray::MegatronRankActor"):
                pids.append(child.pid)
        except psutil.Error:  # gone meanwhile
            continue
    return pids


def inside_a_call(pid: int) -> bool:
    """Whether the rank actor `pid` runs a group call now (Ray titles it `ray::<class>.<method>`
    while a method runs)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as title:
            return title.read().startswith(b"ray::MegatronRankActor.call")
    except OSError:
        return False


def kill_a_rank_mid_call(proc: subprocess.Popen, run_dir: Path, log: Path) -> dict:
    """Once step 1 is checkpointed, SIGKILL the first rank actor seen inside a call; the pid, the
    run's processes at that moment, and when. A call on the tiny model lasts milliseconds, so
    the rank actors are found once and then only their titles are read, every millisecond."""
    deadline = time.monotonic() + RUN_S
    while (
        time.monotonic() < deadline and proc.poll() is None and 1 not in checkpoint_steps(run_dir)
    ):
        time.sleep(0.02)
    ranks = rank_actors(proc)
    checks = 0
    while time.monotonic() < deadline and proc.poll() is None:
        for pid in ranks:
            if inside_a_call(pid):
                os.kill(pid, signal.SIGKILL)  # at once: the call may end within milliseconds
                at = time.monotonic()
                family = psutil.Process(proc.pid).children(recursive=True)
                return {"pid": pid, "family": family, "at": at}
        time.sleep(0.001)  # a call lasts milliseconds; the run needs the cores meanwhile
        checks += 1
        if checks % 1000 == 0:
            ranks = rank_actors(proc) or ranks  # (a rank actor restarted: none in this run)
    proc.kill()
    raise AssertionError(f"no rank actor {ranks} was seen inside a call: {log.read_text()[-4000:]}")


def samples(run_dir: Path) -> dict[str, list]:
    """Per trained sample id: (step, index, digest of the sampled tokens) of each trajectory
    trained, one entry per logprob_gaps.jsonl line (a trajectory trained twice shows twice)."""
    out: dict[str, list] = {}
    for line in (run_dir / "logprob_gaps.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["sample_id"], []).append((row["step"], row["index"], row["digest"]))
    return {key: sorted(rows) for key, rows in out.items()}


def test_rank_killed_mid_call_then_resume_matches_an_uninterrupted_run(
    tmp_path, train_script
) -> None:
    assert megatron_core_installed(), "megatron-core missing: `uv sync` (group megatron-cpu)"
    reference, ref_backend = tmp_path / "reference", tmp_path / "ref-backend"
    ref_log = tmp_path / "reference.log"
    run_dir, backend = tmp_path / "killed", tmp_path / "killed-backend"
    command = train_script.command(run_dir, backend, *RUN)
    log = tmp_path / "killed.log"
    ref_proc = start(train_script.command(reference, ref_backend, *RUN), ref_log)
    started = time.monotonic()
    proc = start(command, log)
    try:
        kill = kill_a_rank_mid_call(proc, run_dir, log)
        status = proc.wait(timeout=KILL_EXIT_S)
        exit_s = time.monotonic() - kill["at"]
        assert ref_proc.wait(timeout=RUN_S) == 0, ref_log.read_text()[-4000:]
    finally:
        for p in (ref_proc, proc):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=60)
    stderr = log.read_text()
    failed = stderr[stderr.rfind("oneloop train: failed: ") :]
    print(f"RESULT killed run: killed after {kill['at'] - started:.1f} s, exit {status} "
          f"{exit_s:.1f} s later\nRESULT {failed}")  # fmt: skip
    assert status == 1, stderr[-4000:]
    assert exit_s < KILL_EXIT_S
    assert failed.startswith("oneloop train: failed: megatron group (local.megatron dp=2"), failed
    (rank,) = RANK_LINE.findall(failed)  # the one dead rank, named with its node and pid
    assert rank[0] in ("0", "1") and rank[1] == "127.0.0.1" and rank[3] == str(kill["pid"]), rank
    assert rank[4] in ("forward_backward", "optim_step", "sampler_weights", "save_state"), rank
    assert failed.rstrip().endswith(
        f"--resume continues after step 1 ({run_dir / 'checkpoints.jsonl'})"
    ), failed
    assert "Traceback" not in stderr, stderr[-4000:]
    _, alive = psutil.wait_procs(kill["family"], timeout=30)
    assert not alive, [p.pid for p in alive]  # the run's Ray processes went with it
    assert checkpoint_steps(run_dir) == [0, 1]

    resumed = subprocess.run(
        [*command, "--resume"], cwd=ROOT, env=run_env(), capture_output=True, text=True,
        timeout=RUN_S,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert checkpoint_steps(run_dir) == [0, 1, 2]
    assert [row["step"] for row in train_script.rows(run_dir)] == [0, 1, 2]
    ref, res = train_script.steps(reference), train_script.steps(run_dir)
    for key in ("train/loss", "train/tokens"):
        assert res[2][key] == ref[2][key], (key, res[2][key], ref[2][key])
    # Trainer vs sampler on the same weights: rounding only (~1e-7), not bitwise across runs.
    gaps = [row[2]["train/logprob_gap_mean"] for row in (res, ref)]
    assert max(gaps) < 1e-6, gaps
    consumed = json.loads((run_dir / "checkpoints.jsonl").read_text().splitlines()[-1])["consumed"]
    assert len(consumed) == len(set(consumed)) == 2 * 2, "a task was lost or trained twice"
    trained = samples(run_dir)
    assert sorted(trained) == sorted(consumed)
    assert all(len({step for step, _, _ in rows}) == 1 for rows in trained.values()), trained
    assert trained == samples(reference)  # the same tokens sampled, trained at the same steps
    assert_step_weights_equal(run_dir, backend, reference, ref_backend, step=2)
