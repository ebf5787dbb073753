"""The container-free environment's per-trial overlay of the host root: tasks cannot change the
host, and concurrent trials do not see each other's writes outside their private dirs."""

import asyncio
import hashlib
from pathlib import Path

import pytest
import ray

from oneloop.agents.demo_tasks import generate_tasks
from oneloop.agents.trials import TrialOutcome, TrialRunner, TrialRunnerConfig

PROBE = "oneloop-overlay-probe"
# Host paths a task writes to (fixed names: with a shared host root, trials would overwrite
# each other's file and read a foreign marker).
WRITTEN = (f"/usr/local/bin/{PROBE}", f"/etc/{PROBE}.conf", f"/root/{PROBE}")
SOLVE = """#!/bin/bash
set -e
marker=$(cat /proc/sys/kernel/random/uuid)
for f in {written}; do echo "$marker" > "$f"; done
echo "$marker" > /app/marker
sleep 1
for f in {written}; do [ "$(cat "$f")" = "$marker" ] || {{ echo "$f foreign"; exit 1; }}; done
echo {answer} > /logs/agent/answer.txt
"""
# The verifier also writes into the host directories (as `apt-get install` would), checks it
# still sees its own trial's files, then scores as usual.
TEST_PREFIX = """#!/bin/bash
for f in {written}; do
  if [ "$(cat "$f")" != "$(cat /app/marker)" ]; then
    mkdir -p /logs/verifier && echo 0 > /logs/verifier/reward.txt && exit 0
  fi
  echo verifier >> "$f"
done
echo '#!/bin/sh' > /usr/local/bin/{probe}-verifier && chmod +x /usr/local/bin/{probe}-verifier
"""


@pytest.fixture(scope="module")
def ray_runtime():
    """A local Ray runtime, left running: the session's `local_service` may live on it (Ray's
    exit hook shuts it down), and later modules reuse it instead of paying a start."""
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)


def _snapshot() -> dict[str, str]:
    """Names and content digests of the files a task writes into, plus the paths it writes."""
    out: dict[str, str] = {}
    for directory in ("/usr/local/bin", "/etc", "/root"):
        for entry in sorted(Path(directory).iterdir()):
            if entry.is_file() and not entry.is_symlink():
                out[str(entry)] = hashlib.blake2b(entry.read_bytes()).hexdigest()
            else:
                out[str(entry)] = "other"
    return out


def test_sixteen_trials_writing_to_usr_etc_root_score_normally_and_leave_the_host_unchanged(
    ray_runtime, tmp_path
):
    (task,) = generate_tasks(tmp_path / "tasks", n_train=1, n_eval=0, seed=8).train
    written = " ".join(WRITTEN)
    (task.path / "solution" / "solve.sh").write_text(
        SOLVE.format(written=written, answer=task.question.answer)
    )
    test = task.path / "tests" / "test.sh"
    prefix = TEST_PREFIX.format(written=written, probe=PROBE)
    test.write_text(prefix + test.read_text().split("\n", 1)[1])
    before = _snapshot()
    assert not any(Path(p).exists() for p in WRITTEN)
    runner = TrialRunner(
        TrialRunnerConfig(
            trials_dir=tmp_path / "trials",
            agent_import_path=None,
            agent_name="oracle",
            environment_kwargs={"root_base_dir": str(tmp_path / "roots")},
            trials_per_second=50.0,
            max_concurrent_trials=16,
            max_infra_retries=0,
        )
    )

    async def go():
        return await asyncio.wait_for(runner.run_group(task.path, 16, None), 300)

    group = asyncio.run(go())
    assert [r.outcome for r in group.results] == [TrialOutcome.OK] * 16, [
        r.error for r in group.results
    ]
    assert group.rewards == (1.0,) * 16  # each saw only its own writes, solver and verifier
    assert _snapshot() == before
    assert not any(Path(p).exists() for p in WRITTEN)
    assert not list((tmp_path / "roots").iterdir())  # scratch layers deleted with the trials
