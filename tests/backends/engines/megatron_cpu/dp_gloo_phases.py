"""The phase of the megatron data-parallel check on Ray rank actors (test_megatron_dp_gloo).

    .venv/bin/python tests/backends/engines/megatron_cpu/dp_gloo_phases.py --work DIR

One process: a tiny random Qwen3 in fp32 (speed switches off), the same datums and AdamParams
through
- `ref`: the one-process engine (dp = tp = 1, in this process);
- on a real two-node Ray cluster on this host (`tests/two_node_ray.py`, two CPUs a node), the
  group `megatron.group.MegatronRayGroup` with its ranks as Ray actors on gloo:
  `dp2`: dp = 2, two CPUs a rank (one rank fits a node: one rank on each node), a checkpoint with
  the optimizer after step 1; `dp2tp2`: dp = 2 × tp = 2, four ranks (one TP block a node);
  then one of its rank actors is killed in the middle of a call (the call must fail, naming
  the rank and its node, well within its bound); `resumed`: a new dp = 2 group loads the step-1
  checkpoint and runs step 2 (nothing trained twice).
- the one-process engine loads the dp = 2 checkpoint: the weights load, the optimizer state is
  refused (saved at another layout) before anything loads.
Loss, grad norm and weights after each of two optim_steps, and the figures, go to DIR/figures.json;
test_megatron_dp_gloo.py asserts the tolerances. The CUDA-on-CPU shims (`cpu_megatron`) are
installed at the top level here, so the rank actors, which import this file, get them too.
"""

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import cpu_megatron as cm
import numpy as np

cm.cuda_calls_on_cpu(allocations=True)

ADAMS = [
    dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.0),
    dict(learning_rate=5e-4, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, grad_clip_norm=1.0),
]  # fmt: skip
LENGTHS = ((20, 13, 7, 16, 9, 11), (18, 5, 12, 14, 10, 8))  # the datums of step 1, step 2
TIMEOUT_S = 120.0  # every group call's bound here


def _data(step: int) -> list:
    return cm.random_data(np.random.default_rng(step), LENGTHS[step], cm.ones)


def _weights(engine) -> dict[str, np.ndarray]:
    return {k: v.float().numpy().copy() for k, v in engine.hf_weights().items()}


def _train(engine, steps: range, out: dict, tag: str, save: Path | None = None) -> None:
    cm.train_steps(engine, steps, out, tag, data=_data, adams=ADAMS, weights=_weights, save=save)


def _kill_mid_call(engine, rank: int) -> dict:
    """Kill rank `rank`'s actor while a forward_backward runs; how the call failed."""
    import ray

    big = cm.random_data(np.random.default_rng(9), [200] * 160, cm.ones)  # seconds of work
    killer = threading.Timer(0.3, lambda: ray.kill(engine._actors[rank]))
    start = time.monotonic()
    killer.start()
    try:
        engine.forward_backward(big, "cross_entropy", None, False)
        message = ""
    except RuntimeError as error:
        message = str(error)
    failed_after = time.monotonic() - start
    killer.join()
    refused = ""
    try:
        engine.optim_step(ADAMS[0])
    except RuntimeError as error:
        refused = str(error)
    node = engine.where[rank][1]
    return {"message": message, "failed_after_s": failed_after, "node_ip": node, "refused": refused}


def _run(work: Path) -> None:
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup
    from oneloop.backends.megatron_local.engines.megatron.speed import MegatronSpeed
    from oneloop.backends.megatron_local.engines.megatron.trainer import (
        MegatronParallel,
        MegatronTrainerEngine,
    )

    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests/: two_node_ray
    from two_node_ray import two_node_cluster

    model = cm.tiny_qwen3(work / "model")
    common = dict(dtype="float32", device="cpu", threads=1, speed=MegatronSpeed.off())
    out: dict = {}
    clock = [time.monotonic()]

    def lap(name: str) -> None:
        figures[f"seconds_{name}"] = round(time.monotonic() - clock[0], 1)
        clock[0] = time.monotonic()

    figures: dict = {}
    ref = MegatronTrainerEngine(model, LoraSpec(0), parallel=MegatronParallel(), **common)
    _train(ref, range(2), out, "ref")
    env = {"env_vars": {"PYTHONPATH": str(cm.HERE), "OMP_NUM_THREADS": "1"}}
    lap("ref")
    with two_node_cluster(head_cpus=2, worker_cpus=2, runtime_env=env) as nodes:
        group = dict(timeout_s=TIMEOUT_S, setup=cm.phase_setup(), gpus_per_rank=0, **common)
        dp2 = MegatronRayGroup(
            model, LoraSpec(0), parallel=MegatronParallel(dp=2), cpus_per_rank=2, **group
        )
        lap("cluster_and_dp2_build")
        figures["dp2_nodes"] = [nodes.name(n) for n in dp2.node_ids()]
        figures["dp2_strategy"] = dp2.strategy
        _train(dp2, range(2), out, "dp2", save=work / "ckpt_dp2_step1")
        dp2.close()
        lap("dp2_train")
        dp2tp2 = MegatronRayGroup(
            model, LoraSpec(0), parallel=MegatronParallel(dp=2, tp=2), cpus_per_rank=1, **group
        )
        figures["dp2tp2_nodes"] = [nodes.name(n) for n in dp2tp2.node_ids()]
        lap("dp2tp2_build")
        _train(dp2tp2, range(2), out, "dp2tp2")
        lap("dp2tp2_train")
        kill = _kill_mid_call(dp2tp2, 3)
        figures.update({f"kill_{k}": v for k, v in kill.items()})
        resumed = MegatronRayGroup(
            model, LoraSpec(0), parallel=MegatronParallel(dp=2), cpus_per_rank=2, **group
        )
        resumed.load_state(work / "ckpt_dp2_step1", with_optimizer=True)
        figures["resumed_steps_after_load"] = resumed.steps
        _train(resumed, range(1, 2), out, "resumed")
        figures["resumed_steps_after_step2"] = resumed.steps
        resumed.close()
        lap("kill_and_resume")
    try:
        ref.load_state(work / "ckpt_dp2_step1", with_optimizer=True)
        figures["dp1_loads_dp2_optimizer"] = "loaded"
    except ValueError as error:
        figures["dp1_loads_dp2_optimizer"] = str(error)
    ref.load_state(work / "ckpt_dp2_step1", with_optimizer=False)
    figures["dp1_loads_dp2_weights_gap"] = cm.weights_gap(_weights(ref), out["dp2/weights0"])
    for tag in ("dp2", "dp2tp2"):
        for step in range(2):
            figures[f"{tag}_loss{step}"] = out[f"{tag}/loss{step}"]
            figures[f"{tag}_grad_norm{step}"] = out[f"{tag}/grad_norm{step}"]
    figures.update(cm.run_gaps(out, ("dp2", "dp2tp2"), steps=2))
    figures["ref_weights_moved"] = cm.weights_gap(out["ref/weights1"], _weights_of(model))
    resumed, uninterrupted = out["resumed/weights1"], out["dp2/weights1"]
    figures["resumed_weights1_gap_vs_dp2"] = cm.weights_gap(resumed, uninterrupted)
    (work / "figures.json").write_text(json.dumps(figures, indent=1))


def _weights_of(model: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    weights = load_file(str(model / "model.safetensors"))
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return {k: v.astype(np.float32) for k, v in weights.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, required=True, help="where the figures go")
    args = parser.parse_args()
    _run(args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
