"""benchmarks/gpu_mfu.py's profile traces an op's time to its input shapes and to the frame of our
code that called it (the device run reads the rows; here the same on CPU time)."""

import importlib.util
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

ROOT = Path(__file__).resolve().parents[2]


def _gpu_mfu():
    spec = importlib.util.spec_from_file_location("gpu_mfu", ROOT / "benchmarks" / "gpu_mfu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.add_(y)


def test_op_origins_name_shapes_and_the_calling_frame(monkeypatch) -> None:
    gpu_mfu = _gpu_mfu()
    monkeypatch.setattr(gpu_mfu, "ORIGIN_FRAMES", ("test_gpu_mfu_origins",))
    big, small = torch.ones(512, 1024), torch.ones(8, 8)
    with gpu_mfu.profiler([ProfilerActivity.CPU], origins=True) as prof:
        for _ in range(3):
            _residual(big, big)
        _residual(small, small)
        torch.cat([small, small])  # not asked for
    rows = gpu_mfu.op_origins(prof, ["aten::add_"], 5, "self_cpu_time_total")
    shapes = [r for r in rows if r["by"] == "input shapes"]
    callers = [r for r in rows if r["by"] == "caller"]
    assert {r["op"] for r in rows} == {"aten::add_"}, rows
    assert shapes[0]["calls"] == 3 and "[512, 1024]" in shapes[0]["where"], shapes
    assert any("[8, 8]" in r["where"] and r["calls"] == 1 for r in shapes), shapes
    assert sum(r["calls"] for r in callers) == 4, callers
    assert all("_residual" in r["where"] for r in callers), callers
