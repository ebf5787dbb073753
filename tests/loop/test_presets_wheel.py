"""Presets ship with the package: a wheel built from the tree holds every preset, and the preset
lookup finds them when that wheel is installed outside the source tree (issue 17).

Regression: the lookup looked two folders above the package (`scripts/configs/`), which a wheel
install does not have.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from oneloop.loop.config import preset_names

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "oneloop" / "loop" / "presets"
PROBE = """
import json, oneloop
from oneloop.loop.config import load_config, preset_names, resolve_config_path
names = preset_names()
for name in names:
    assert load_config(name).run_dir is not None
print(json.dumps({"file": oneloop.__file__, "names": names,
                  "paths": [str(resolve_config_path(n)) for n in names]}))
"""


def uv() -> str:
    """The uv that `./run` installs into .tools/ (else one on PATH)."""
    local = ROOT / ".tools" / "bin" / "uv"
    found = str(local) if local.is_file() else shutil.which("uv")
    if found is None:
        pytest.fail("uv not found (./run installs it into .tools/bin/uv)")
    return found


def run_uv(args: list[str]) -> None:
    """`uv <args>` with this venv's Python: offline first (hatchling from uv's cache), then with
    the registry (CI has registry network)."""
    env = {**os.environ, "UV_PYTHON": sys.executable, "UV_PYTHON_DOWNLOADS": "never"}
    offline = subprocess.run(
        [uv(), *args], cwd=ROOT, env={**env, "UV_OFFLINE": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    if offline.returncode == 0:
        return
    online = subprocess.run([uv(), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert online.returncode == 0, offline.stderr[-2000:] + online.stderr[-2000:]


@pytest.mark.timeout(660)
def test_wheel_ships_every_preset_and_the_installed_lookup_finds_them(tmp_path: Path) -> None:
    expected = sorted(p.stem for p in PRESETS.glob("*.yaml"))
    assert expected and preset_names() == expected
    dist = tmp_path / "dist"
    run_uv(["build", "--wheel", "--out-dir", str(dist)])
    (wheel,) = dist.glob("oneloop-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"oneloop/loop/presets/{n}.yaml" for n in expected} <= names

    target = tmp_path / "site"
    run_uv(["pip", "install", "--no-deps", "--target", str(target), str(wheel)])
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # -s: no user site; -P: the working directory is not put on sys.path; PYTHONPATH puts the
    # installed wheel ahead of the venv's editable install of the source tree.
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run(
        [sys.executable, "-s", "-P", "-c", PROBE], cwd=outside, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["file"]).is_relative_to(target), found["file"]
    assert found["names"] == expected
    assert all(Path(p).is_relative_to(target) for p in found["paths"]), found["paths"]
