"""Backend parity end to end: the same short deterministic run (S = 0, fixed seeds) through
`--backend local` and through `--backend tinker --base-url <oneloop serve on localhost>` gives
identical metrics and identical trained tokens."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DETERMINISTIC = [
    "algo.max_steps=2",
    "algo.groups_per_step=2",
    "algo.group_size=2",
    "algo.max_staleness=0",
    "algo.filter_zero_variance=false",
    "tasks.demo.n_train=4",
    "tasks.demo.n_eval=2",
    "agent.max_turns=2",
    "agent.max_tokens_per_turn=12",
    "checkpoint.every_steps=2",
    "logging.console=false",
    "sft.steps=2",
    "sft.batch_size=2",
    "eval=null",
    "model.lora_rank=32",
    "model.base_model=oneloop/tiny-qwen3",
]
COMPARED = (
    "train/loss",
    "train/tokens",
    "train/datums",
    "train/reward_mean",
    "train/logprob_gap_mean",
    "train/grad_norm",
    "rollout/reward_mean",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(run_dir: Path, backend_dir: Path, *extra: str) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "train.py"),
        "--config",
        "demo-cpu",
        "--run-dir",
        str(run_dir),
        f"backend.run_dir={backend_dir}",
        *DETERMINISTIC,
        *extra,
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]


def step_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r.get(k) for k in ("step", *COMPARED)} for r in rows if "train/loss" in r]


def trained_tokens(run_dir: Path) -> list:
    rows = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    return [(r["sample_id"], r["reward"], [s["text"] for s in r["segments"]]) for r in rows]


@pytest.mark.timeout(1500)
def test_local_and_tinker_backends_train_identically(tmp_path):
    train(tmp_path / "local", tmp_path / "local-backend")
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oneloop.cli",
            "serve",
            "--port",
            str(port),
            "--run-dir",
            str(tmp_path / "serve-backend"),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TINKER_API_KEY": "tml-local-test"},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=2)
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-3000:]
                assert time.monotonic() < deadline, "oneloop serve did not come up"
                time.sleep(0.5)
        train(
            tmp_path / "tinker",
            tmp_path / "unused",
            "--backend",
            "tinker",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--api-key",
            "tml-local-test",
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
    local, remote = step_metrics(tmp_path / "local"), step_metrics(tmp_path / "tinker")
    assert [r["step"] for r in local] == [1, 2]
    assert local == remote
    assert trained_tokens(tmp_path / "local") == trained_tokens(tmp_path / "tinker")
