"""The GPU runbook keeps working after a move: every tests/gpu module and benchmarks/gpu_* script
imports from paths that exist (CI, no GPU; not marked `gpu`).

The modules are imported by gpu_module_import_check.py in a process of their own (one for all of
them: the imports cost seconds each on CI's two cores), with the GPU packages this machine lacks
(vLLM; megatron-core without the megatron-cpu group) stubbed in that process only; then every
`oneloop` module and name each file imports, in function bodies too, must resolve. A stale path
fails here instead of on the device.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = Path(__file__).resolve().parent / "gpu_module_import_check.py"
MODULES = sorted([*ROOT.glob("tests/gpu/*.py"), *ROOT.glob("benchmarks/gpu_*.py")])


@pytest.fixture(scope="module")
def import_report() -> dict[str, list[str]]:
    """{path: what of it failed to import} for every module in `MODULES`, from one subprocess."""
    done = subprocess.run(
        [sys.executable, str(CHECK), *map(str, MODULES)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_runbook_modules_are_found() -> None:
    names = {p.name for p in MODULES}
    assert {"gpu_figures.py", "test_megatron_engine.py", "gpu_mfu.py"} <= names, names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_gpu_module_imports_resolve(path: Path, import_report: dict[str, list[str]]) -> None:
    failures = import_report[str(path)]
    assert not failures, "\n".join(failures)
