"""The phases of the megatron hybrid check (test_megatron_hybrid_gloo): Qwen3.5 / 3.6 on the engine.

    cd tests/backends/engines/megatron_cpu
    ../../../../.venv/bin/python hybrid_gloo_phases.py --phase torch --work DIR
    ../../../../.venv/bin/python hybrid_gloo_phases.py --phase megatron --work DIR

Two tiny random hybrids: `oneloop/tiny-qwen3.5-moe` (3 Gated DeltaNet layers and 1 gated full-
attention layer, each with 8 experts top-2 and a gated shared expert) and `oneloop/tiny-qwen3.5`
(the same layers with a dense MLP), fp32. A tiny random model starts its zero-centred norms at 0,
its GDN output norm at 1: phase `torch` first moves every norm, A_log, dt_bias and router weight by
random amounts (a wrong norm mapping would then show), writes the models to DIR, and trains them on
the torch trainer engine (transformers' modules, the ones the sampler runs; its own process, without
the CUDA-on-CPU shims). Phase `megatron` trains the same models on the megatron engine: megatron-
core's GatedDeltaNet (its torch delta rule on CPU), gated attention and MoE layers from
`megatron.hybrid`; both as a Ray group on gloo of tp = 2 ranks (sequence parallel; the Gated
DeltaNet's heads split by section; the MoE model's experts whole, ep = 2 over the TP pair) and of
cp = 2 ranks (the MoE model at cp = 2 × dp = 2 × ep = 2), and the
MoE model also of dp = 2 × ep = 2 ranks and of pp = 2 × dp = 2 × ep = 2 ranks (two pipeline
stages, each its slice of the layer pattern, experts split over the replicas of each stage). The
groups' checkpoints (after step 1) load in one process. Two optim_steps; figures to
DIR/figures.json. `recompute`: the one-process engine with activation recompute.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import cpu_megatron as cm

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron's GDN fusers compile: ~30 s per run
if __name__ != "__main__" or "torch" not in sys.argv:  # the megatron phase and its rank actors
    cm.cuda_calls_on_cpu(allocations=True)
    cm.gloo_all_to_all()
    cm.gdn_without_fla()

ADAMS = [
    dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.0),
    dict(learning_rate=5e-4, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, grad_clip_norm=1.0),
]  # fmt: skip
# Step 1 holds a sequence past 64 tokens: two chunks of the chunked delta rule.
LENGTHS = ((70, 13, 7, 16, 9, 11), (18, 5, 12, 66, 10, 8))
BUDGET = 64  # padded tokens per micro-batch: at dp = 2 the replicas get unequal counts
MODELS = ("qwen3.5-moe", "qwen3.5")


def _train(engine, out: dict, tag: str, save: Path | None = None) -> None:
    cm.train_pad_free(engine, out, tag, LENGTHS, ADAMS, save)


def _perturbed(name: str, work: Path) -> Path:
    """The tiny model `name` with its norms, A_log, dt_bias, router and shared-expert gate moved
    by random amounts (seed 1), in DIR/name."""
    import torch
    from safetensors.torch import load_file, save_file

    from oneloop.tiny.model import build_tiny_model, named_tiny_specs

    source = build_tiny_model(named_tiny_specs()[f"oneloop/tiny-{name}"])
    target = work / name
    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    moved = ("norm", "A_log", "dt_bias", "mlp.gate.weight", "shared_expert_gate")
    for key, tensor in weights.items():
        if any(part in key for part in moved):
            weights[key] = tensor + 0.3 * torch.randn(tensor.shape, generator=generator)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _run_torch(work: Path) -> None:
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine

    common = dict(device="cpu", dtype="float32", threads=1, max_tokens_per_microbatch=BUDGET)
    for name in MODELS:
        model, out = _perturbed(name, work), {}
        if name == "qwen3.5-moe":  # routing replay (R3) through the hybrid's MoE layers
            replayed = TorchTrainerEngine(model, LoraSpec(0), **common)
            cm.replay_call(replayed, model, out, "torch", LENGTHS[0], ADAMS[0], backward=True)
        engine = TorchTrainerEngine(model, LoraSpec(0), **common)
        _train(engine, out, "torch")
        cm.save_run(work / f"torch-{name}.npz", out)


def _run(work: Path) -> None:
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup
    from oneloop.backends.megatron_local.engines.megatron.trainer import (
        MegatronParallel,
        MegatronTrainerEngine,
    )
    from oneloop.backends.megatron_local.engines.microbatch import pack_microbatches

    mega = dict(device="cpu", speed=cm.check_speed(), dtype="float32", threads=1,
                max_tokens_per_microbatch=BUDGET)  # fmt: skip
    figures: dict = {}
    for name in MODELS:
        model, out = work / name, cm.load_run(work / f"torch-{name}.npz")
        if name == "qwen3.5-moe":
            r3 = MegatronTrainerEngine(model, LoraSpec(0), parallel=MegatronParallel(), **mega)
            cm.replay_call(r3, model, out, "ref", LENGTHS[0], ADAMS[0], backward=True)
            del r3
        ref = MegatronTrainerEngine(model, LoraSpec(0), parallel=MegatronParallel(), **mega)
        figures[f"{name}/modules"] = sorted(
            {type(m).__name__ for m in ref.module.modules() if "Delta" in type(m).__name__
             or type(m).__name__.endswith(("Experts", "RMSNorm"))}
        )  # fmt: skip
        _train(ref, out, "ref")
        # activation recompute: each Gated DeltaNet / attention layer run again in the backward
        full = MegatronParallel(recompute="full")
        recompute = MegatronTrainerEngine(model, LoraSpec(0), parallel=full, **mega)
        calls = cm.count_layer_calls(recompute)
        _train(recompute, out, "recompute")
        figures[f"{name}/recompute_layer0_calls"] = calls[0]
        figures["microbatches"] = sum(len(pack_microbatches(list(n), BUDGET)) for n in LENGTHS)
        del recompute
        tags = ["torch", "recompute"]
        group = dict(timeout_s=cm.GROUP_TIMEOUT_S, setup=cm.phase_setup(), gpus_per_rank=0)
        cm.start_ray(4)
        if name == "qwen3.5-moe":
            ep2 = MegatronRayGroup(model, LoraSpec(0), parallel=MegatronParallel(dp=2, ep=2),
                                   **group, **mega)  # fmt: skip
            cm.replay_call(ep2, model, out, "ep2", LENGTHS[0], ADAMS[0], backward=False)
            _train(ep2, out, "ep2", save=work / "ckpt_ep2_step1")
            ep2.close()
            # the 397B layout's shape: pipeline stages (each its slice of the layer pattern) ×
            # data-parallel replicas, the experts split over the replicas of each stage
            staged = MegatronRayGroup(
                model, LoraSpec(0), parallel=MegatronParallel(pp=2, dp=2, ep=2), **group, **mega
            )
            cm.replay_call(staged, model, out, "pp2ep2", LENGTHS[0], ADAMS[0], backward=False)
            _train(staged, out, "pp2ep2", save=work / "ckpt_pp2ep2_step1")
            staged.close()
            tags += ["ep2", "pp2ep2"]
            figures[f"{name}/microbatch_counts_dp2"] = cm.microbatch_counts(LENGTHS, 2, BUDGET)
        moe = name == "qwen3.5-moe"
        layouts = {
            # context parallelism: each rank two chunks of every sequence (the Gated DeltaNet
            # trades them for half its heads over the CP pair, the gated attention gathers K/V);
            # MoE: dp 2 replicas (idle micro-batches of two tokens a rank), experts split ep 2
            "cp2": MegatronParallel(cp=2, dp=2, ep=2) if moe else MegatronParallel(cp=2),
            # tensor parallelism: the Gated DeltaNet's key / value heads, the gated attention's
            # query groups and the MLPs split over the TP pair (sequence parallel); MoE: experts
            # whole, EP over the same pair
            "tp2": MegatronParallel(tp=2, ep=2 if moe else 1),
        }
        for tag, parallel in layouts.items():
            ranks = MegatronRayGroup(model, LoraSpec(0), parallel=parallel, **group, **mega)
            if moe:
                cm.replay_call(ranks, model, out, tag, LENGTHS[0], ADAMS[0], backward=False)
            _train(ranks, out, tag, save=work / f"ckpt_{tag}_step1")
            ranks.close()
            tags.append(tag)
        if name == "qwen3.5-moe":
            r3 = cm.r3_gaps(out, ("ref", "ep2", "pp2ep2", "cp2", "tp2"))
            figures.update({f"{name}/{k}": v for k, v in r3.items()})
        for tag in tags[2:]:  # the groups' checkpoints load in one process
            ref.load_state(work / f"ckpt_{tag}_step1", with_optimizer=False)
            figures[f"{name}/one_process_loads_{tag}_weights_gap"] = cm.weights_gap(
                cm.fused_weights(ref), out[f"{tag}/weights0"]
            )
        figures.update({f"{name}/{k}": v for k, v in cm.run_gaps(out, tags, steps=2).items()})
        figures[f"{name}/weights_moved"] = cm.weights_gap(out["ref/weights1"], out["ref/weights0"])
        del ref
    (work / "figures.json").write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    sys.exit(cm.phase_main(__doc__, {"torch": _run_torch, "megatron": _run}))
