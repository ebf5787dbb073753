"""Shared by the GPU tests: the device model directory and a figures sink ($OUT/<name>.json)."""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "device"))

from build_random_qwen3 import build  # noqa: E402


def model_dir(tmp_root: Path, shape: str = "0.6b") -> Path:
    """`ONELOOP_GPU_MODEL_DIR` if set, else a random Qwen3 of `shape` built under `tmp_root`."""
    given = os.environ.get("ONELOOP_GPU_MODEL_DIR")
    return Path(given) if given else build(shape, tmp_root / f"qwen3-{shape}")


def record(name: str, figures: dict) -> None:
    """Print the figures and write them to $OUT/<name>.json when OUT is set."""
    text = json.dumps(figures, indent=1, sort_keys=True, default=float)
    print(f"FIGURES {name} {text}")
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(text)
