"""Step time of the megatron trainer as a Ray-placed group of one rank vs the one-process engine, on
one GPU (issue 18: the Ray-placed group's step-time overhead at DP = 1, goal ray / one-process
<= 1.02).

- `one_process`: `megatron.trainer.MegatronTrainerEngine` in this process, the engine
  `engines.factory.make_trainer_engine` builds for a one-rank trainer (the trainer actor holds it);
- `ray_group`: `megatron.group.MegatronRayGroup` at dp = tp = pp = 1: one rank actor
  (`parallel.tp.MegatronTpRank`) in a placement group, every call a Ray call to it and rank 0's
  result back on the host. Both are driven from this process, so the difference is the group's own
  cost (the client -> trainer-actor hop the product adds is the same for both).

Same random Qwen3 (default the 1.7 B shape of benchmarks/gpu_train.py), bf16, same datums, same
micro-batch budget; each step a forward_backward (cross_entropy) and an optim_step (AdamW). Both
engines are built side by side (the rank actor shares this GPU) and stepped in blocks, `--block`
steps of one engine back to back, then of the other (order swapped every round, `--rounds`), after
`--warmup` steps each, so drift in clocks or allocator state hits both alike. A block's first step
is not timed: a group call returns once rank 0's results are on the host, and work the rank queued
after them (the end of the optimizer step) runs on into whatever comes next, which this process
cannot synchronise; back to back, each timed step carries one such tail, as in a training run.
(Alternating single steps let one engine's tail land in the other's timed step: the first two
device runs gave ray / one-process 1.020 and 0.967.) Per workload (`--workloads`, BATCHxSEQ
tokens) prints RESULT lines: median step seconds of each, the ratio ray / one-process and the
difference in ms; writes $OUT/gpu_megatron_group.json when OUT is set.

    python3 benchmarks/gpu_megatron_group.py [--shape 1.7b] [--workloads 4x4096,8x512] [--rounds 4]
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "device" / "runbook"))
sys.path.insert(0, str(ROOT))

from build_random_qwen3 import build  # noqa: E402
from gpu_train import ADAM, make_batch  # noqa: E402

from oneloop.backends.megatron_local.engines.base import LoraSpec  # noqa: E402


def step_seconds(engine, data: list) -> float:
    """Wall seconds of one forward_backward + optim_step, the GPU idle at both ends."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.forward_backward(data, "cross_entropy", None, forward_only=False)
    engine.optim_step(ADAM)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def compare(
    engines: dict, data: list, rounds: int, block: int, warmup: int
) -> dict[str, list[float]]:
    """Each engine's step times: `warmup` untimed steps each, then `rounds` rounds of one block per
    engine (the order swapped every round), a block one untimed step and `block` timed ones."""
    for engine in engines.values():
        for _ in range(warmup):
            step_seconds(engine, data)
    times: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            step_seconds(engines[name], data)  # absorbs the tail of the other engine's last step
            times[name] += [step_seconds(engines[name], data) for _ in range(block)]
    return times


def summary(workload: str, tokens: int, times: dict[str, list[float]]) -> dict:
    one, ray_ = statistics.median(times["one_process"]), statistics.median(times["ray_group"])
    return {
        "workload": workload,
        "tokens_per_step": tokens,
        "one_process_step_s_median": round(one, 5),
        "ray_group_step_s_median": round(ray_, 5),
        "ray_over_one_process": round(ray_ / one, 4),
        "ray_minus_one_process_ms": round(1e3 * (ray_ - one), 2),
        "one_process_step_s": [round(t, 5) for t in times["one_process"]],
        "ray_group_step_s": [round(t, 5) for t in times["ray_group"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="1.7b")
    parser.add_argument(
        "--workloads", default="4x4096,8x512", help="comma-separated BATCHxSEQ per step"
    )
    parser.add_argument("--rounds", type=int, default=4, help="blocks per engine")
    parser.add_argument("--block", type=int, default=4, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per engine first")
    parser.add_argument("--microbatch-tokens", type=int, default=8192, help="token budget")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/qwen3-bench"))
    args = parser.parse_args()
    import ray

    from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup
    from oneloop.backends.megatron_local.engines.megatron.trainer import (
        MegatronParallel,
        MegatronTrainerEngine,
    )

    path = build(args.shape, args.model_dir / args.shape)
    common = dict(dtype="bfloat16", device="cuda", max_tokens_per_microbatch=args.microbatch_tokens)
    built = time.perf_counter()
    one_process = MegatronTrainerEngine(path, LoraSpec(0), **common)
    results: dict = {"shape": args.shape, "build_s": {}}
    results["build_s"]["one_process"] = round(time.perf_counter() - built, 1)
    ray.init(address="local", num_gpus=1, include_dashboard=False)
    built = time.perf_counter()
    group = MegatronRayGroup(path, LoraSpec(0), parallel=MegatronParallel(), **common)
    results["build_s"]["ray_group"] = round(time.perf_counter() - built, 1)
    engines = {"one_process": one_process, "ray_group": group}
    results["workloads"] = []
    for workload in args.workloads.split(","):
        batch, seq = (int(x) for x in workload.split("x"))
        data = make_batch(batch, seq)
        times = compare(engines, data, args.rounds, args.block, args.warmup)
        result = summary(workload, batch * seq, times)
        results["workloads"].append(result)
        for key in ("one_process_step_s_median", "ray_group_step_s_median",
                    "ray_over_one_process", "ray_minus_one_process_ms"):  # fmt: skip
            print(f"RESULT {workload} {key} = {result[key]}", flush=True)
    group.close()
    ray.shutdown()
    results["max_mem_gib_this_process"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print("RESULT " + json.dumps(results), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_megatron_group.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
