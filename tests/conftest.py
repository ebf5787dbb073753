"""Shared fixtures: one local Ray runtime and one local-backend ServiceClient per test session."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

import oneloop  # noqa: E402,F401  (sets the offline environment defaults)

# Property tests draw the same examples on every run (`derandomize`), so the suite's verdict on a
# commit does not depend on luck; what a random search found stays pinned as an `@example`.
# `ONELOOP_HYPOTHESIS=explore ./run tests` searches anew (random draws, as before).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("ONELOOP_HYPOTHESIS", "repeatable"))

# The files that take longest, longest first (`./run tests` prints the slowest; seconds from a
# full run on two cores). `./run tests` hands out whole files to two workers in collection
# order; started last, one of these would leave the other worker idle for minutes at the end.
SLOWEST_FILES = (
    "tests/backends/engines/megatron_cpu/test_megatron_run_kill_resume.py",  # 372
    "tests/backends/engines/megatron_cpu/test_megatron_pp_gloo.py",  # 286
    "tests/loop/test_loop_faults.py",  # 276
    "tests/backends/local/test_backend_parity.py",  # 239
    "tests/loop/test_resume.py",  # 235
    "tests/backends/engines/megatron_cpu/test_megatron_hybrid_gloo.py",  # 219
    "tests/loop/test_train_script.py",  # 200
    "tests/backends/engines/megatron_cpu/test_megatron_moe_gloo.py",  # 168
    "tests/backends/engines/megatron_cpu/test_megatron_dp_gloo.py",  # 148
    "tests/backends/engines/megatron_cpu/test_megatron_cp_gloo.py",  # 103
    "tests/agents/test_gateway_loop.py",  # 103
    "tests/backends/engines/test_moe_loop.py",  # 100
    "tests/diagnostics/test_inspect.py",  # 88
    "tests/backends/engines/megatron_cpu/test_megatron_tp_gloo.py",  # 90
    "tests/agents/test_gateway_trial.py",  # 78
    "tests/backends/engines/megatron_cpu/test_megatron_lora_tp_gloo.py",  # 72
)


def pytest_collection_modifyitems(session, config, items):
    """The slowest files first (in SLOWEST_FILES' order), then the rest as collected; each file's
    tests stay together and in order."""
    rank = {path: i for i, path in enumerate(SLOWEST_FILES)}

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the collected order within each rank


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from oneloop.tiny.model import build_tiny_model

    return build_tiny_model()


_SHARED_SERVICES: list = []  # the session's local_service once made


@pytest.fixture(scope="session")
def local_service(tmp_path_factory, tiny_model_path):
    """A local-backend ServiceClient on a real local Ray runtime (torch engines, CPU)."""
    from oneloop.backends import BackendConfig, connect

    run_dir = tmp_path_factory.mktemp("backend-runs")
    service = connect(
        BackendConfig(
            backend="local",
            run_dir=run_dir,
            local={"torch_threads": 1, "max_snapshots": 2},
        )
    )
    _SHARED_SERVICES.append(service)
    yield service
    _SHARED_SERVICES.remove(service)
    service.close()


def _release_trainers_started_meanwhile():
    """Around a test or a module: stop the shared service's trainer actors started inside it
    (each holds ~0.8 GB and polls a core; the session's suite made dozens that lived to its end)."""
    before = {run for s in _SHARED_SERVICES for run in s.live_training_runs}
    yield
    for service in _SHARED_SERVICES:
        for run in set(service.live_training_runs) - before:
            service.release_training_client(run)


@pytest.fixture(autouse=True)
def _trainers_of_the_test():
    yield from _release_trainers_started_meanwhile()


@pytest.fixture(autouse=True, scope="module")
def _trainers_of_the_module():
    yield from _release_trainers_started_meanwhile()


class TrainScript:
    """Runs `scripts/train.py --config demo-cpu` as a subprocess (the contract tests' way in)."""

    root = __import__("pathlib").Path(__file__).resolve().parents[1]

    def command(self, run_dir, backend_dir, *overrides: str) -> list[str]:
        import sys

        return [
            sys.executable,
            str(self.root / "scripts" / "train.py"),
            "--config",
            "demo-cpu",
            "--run-dir",
            str(run_dir),
            f"backend.run_dir={backend_dir}",
            *overrides,
        ]

    def run(self, run_dir, backend_dir, *overrides: str, timeout: float = 1200):
        """Run the script to completion (exit 0 asserted); the CompletedProcess, output captured."""
        import subprocess

        done = subprocess.run(
            self.command(run_dir, backend_dir, *overrides),
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return done

    @staticmethod
    def rows(run_dir) -> list[dict]:
        """metrics.jsonl lines of the run."""
        import json

        return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]

    def steps(self, run_dir) -> dict[int, dict]:
        """The RL step lines, by step."""
        return {r["step"]: r for r in self.rows(run_dir) if "train/loss" in r}


@pytest.fixture
def train_script() -> TrainScript:
    return TrainScript()
