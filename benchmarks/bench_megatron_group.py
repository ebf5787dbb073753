"""Step time of the megatron trainer's Ray rank actors vs the spawned-process group they replaced,
and data-parallel scaling, on CPU (gloo, real megatron-core, a tiny fp32 Qwen3).

    .venv/bin/python benchmarks/bench_megatron_group.py [--steps 8] [--datums 16] [--tokens 96]

Side by side in one run, same sizes (tp = 2, two ranks), same datums, each step a forward_backward
and an optim_step:
- `spawned`: the old `megatron.group.MegatronGroupEngine` (rank 0 in this process, rank 1 a
  spawned worker over a pipe), loaded from git commit `--commit` (the last one that had it) into a
  temporary directory;
- `ray`: `megatron.group.MegatronRayGroup` (both ranks Ray actors in one placement group).
Both groups are built, then stepped alternately, the order swapped every round (spawned, ray, ray,
spawned, ...), after a warm-up step each: on a shared machine the load drifts by more than the 5 %
in question between one half of a run and the next (timing one group after the other gave ratios
0.85 to 2.05 on the same code), and alternating puts both under the same load. Ray runs while the
spawned group steps, as it did in the product (the spawned group lived inside a Ray trainer actor).
Then DP scaling: the Ray group at dp = 1 (one rank actor) vs dp = 2 (two) on the same datums, one
after the other. Prints RESULT lines: median step seconds of each, the ratios (goal: ray / spawned
<= 1.05) and the Ray group's fixed cost per step in ms (two fanned-out calls; it shrinks as a share
of larger steps: try --datums 64 --tokens 256).
CPU is not the target (CUDA-on-CPU shims from tests/backends/engines/megatron_cpu/cpu_megatron.py,
installed at the top level here so the spawned worker and the rank actors get them too).
"""

import argparse
import functools
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = str(Path(__file__).resolve().parent)
CPU_CHECKS = str(ROOT / "tests" / "backends" / "engines" / "megatron_cpu")
sys.path[:0] = [p for p in (CPU_CHECKS, HERE) if p not in sys.path]

import cpu_megatron as cm  # noqa: E402
import numpy as np  # noqa: E402

cm.cuda_calls_on_cpu(allocations=True)
OLD_MODULE = "old_megatron_group"
ADAM = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


def _import_bench() -> None:
    """Run in each rank actor first: this file's top level installs the shims there."""
    for path in (CPU_CHECKS, HERE):
        if path not in sys.path:
            sys.path.insert(0, path)
    importlib.import_module("bench_megatron_group")


def _step(engine, data: list) -> float:
    start = time.perf_counter()
    engine.forward_backward(data, "cross_entropy", None, False)
    engine.optim_step(ADAM)
    return time.perf_counter() - start


def _steps(engine, data: list, steps: int) -> list[float]:
    return [_step(engine, data) for _ in range(steps + 1)][1:]  # the first is a warm-up


def _alternated(engines: dict, data: list, steps: int) -> dict[str, list[float]]:
    """`steps` timed steps of each engine, one at a time, the order swapped every round."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    order = list(engines)
    for name in order:
        _step(engines[name], data)  # warm-up
    for _ in range(steps):
        for name in order:
            times[name].append(_step(engines[name], data))
        order.reverse()
    return times


def _old_group(commit: str, directory: Path):
    source = subprocess.run(
        ["git", "show", f"{commit}:oneloop/backends/megatron_local/engines/megatron/group.py"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    (directory / f"{OLD_MODULE}.py").write_text(source)
    sys.path.insert(0, str(directory))  # the spawned worker inherits the path
    return importlib.import_module(OLD_MODULE).MegatronGroupEngine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per engine")
    parser.add_argument("--commit", default="8f19431", help="a commit with the spawned group")
    parser.add_argument("--datums", type=int, default=16, help="datums per forward_backward")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per datum")
    args = parser.parse_args()
    import ray

    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup
    from oneloop.backends.megatron_local.engines.megatron.speed import MegatronSpeed
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel

    work = Path(tempfile.mkdtemp(prefix="bench-megatron-group-"))
    model = cm.tiny_qwen3(work / "model")
    data = cm.random_data(np.random.default_rng(0), [args.tokens] * args.datums, cm.ones)
    kwargs = dict(dtype="float32", device="cpu", threads=1, speed=MegatronSpeed.off())
    results: dict[str, float] = {}
    spawned_class = _old_group(args.commit, work)
    spawned = spawned_class(model, LoraSpec(0), parallel=MegatronParallel(tp=2), **kwargs)
    os.environ["OMP_NUM_THREADS"] = "1"
    env = {"env_vars": {"OMP_NUM_THREADS": "1"}}
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=env)
    setup = functools.partial(_import_bench)
    group = dict(gpus_per_rank=0, setup=setup, timeout_s=600, **kwargs)
    ray_tp2 = MegatronRayGroup(model, LoraSpec(0), parallel=MegatronParallel(tp=2), **group)
    times = _alternated({"spawned": spawned, "ray": ray_tp2}, data, args.steps)
    spawned.close()
    ray_tp2.close()
    results["spawned_tp2_step_s"] = statistics.median(times["spawned"])
    results["ray_tp2_step_s"] = statistics.median(times["ray"])
    for name, parallel in (("dp1", MegatronParallel(dp=1)), ("dp2", MegatronParallel(dp=2))):
        engine = MegatronRayGroup(model, LoraSpec(0), parallel=parallel, **group)
        results[f"ray_{name}_step_s"] = statistics.median(_steps(engine, data, args.steps))
        engine.close()
    ray.shutdown()
    results["ray_over_spawned_tp2"] = results["ray_tp2_step_s"] / results["spawned_tp2_step_s"]
    results["ray_minus_spawned_tp2_ms"] = 1e3 * (
        results["ray_tp2_step_s"] - results["spawned_tp2_step_s"]
    )
    results["dp2_speedup_over_dp1"] = results["ray_dp1_step_s"] / results["ray_dp2_step_s"]
    for key, value in results.items():
        print(f"RESULT {key} = {value:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
