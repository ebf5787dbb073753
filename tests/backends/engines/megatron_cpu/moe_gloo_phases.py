"""The phase of the megatron MoE check (test_megatron_moe_gloo): Qwen3-MoE on the engine itself.

    cd tests/backends/engines/megatron_cpu
    ../../../../.venv/bin/python moe_gloo_phases.py --phase torch --work DIR
    ../../../../.venv/bin/python moe_gloo_phases.py --phase megatron --work DIR

The tiny random Qwen3-MoE (`oneloop/tiny-qwen3-moe`, fp32), the same datums and AdamParams through
- phase `torch` (its own process, without the CUDA-on-CPU shims: installed before transformers is
  imported, they change its numerics): the torch trainer engine (transformers' Qwen3-MoE), the
  engine the sampler shares its model code with;
- phase `megatron`, `ref`: the megatron engine in this process (ep = dp = 1): megatron-core's MoE
  layers built from our `megatron.moe` mapping, experts as grouped GEMMs (`grouped_experts`);
  `sequential`: the same with megatron-core's SequentialMLP experts;
- `ep2`: `megatron.group.MegatronRayGroup` with dp = 2, ep = 2 (each rank holds half of every
  layer's experts; tokens dispatched all-to-all on gloo) on a local Ray runtime, with a token
  budget small enough that the two replicas get different micro-batch counts (the idle
  micro-batches keep the dispatch collectives paired), a checkpoint with the optimizer after
  step 1; `pp2`: the same as a group of two pipeline stages (one MoE layer each); `tp2`: tensor
  parallelism 2 with sequence parallelism, the experts whole and split ep 2 over the TP pair;
- `cp2`: context parallelism 2 (each rank two chunks of every sequence), ep 2 over the CP pair;
- `recompute`: the one-process engine with activation recompute (each decoder layer run again in
  the backward; its first layer's forwards counted); `pp2_recompute`: the two-stage group with
  recompute, its replayed call's gradient (each backward recomputing after other micro-batches'
  forwards, with its own forward's replay);
- `ref` loading the ep = 2 checkpoint: the weights load (experts gathered back into HF form),
  the optimizer state is refused (saved at another layout) before anything loads.
Loss, logprobs, grad norm and weights after each of two optim_steps go to DIR/figures.json;
test_megatron_moe_gloo.py asserts the tolerances. The CUDA-on-CPU shims and the gloo all-to-all
patch are installed at the top level here, so the rank actors, which import this file, get them.
"""

import json
import sys
from pathlib import Path

import cpu_megatron as cm
import numpy as np

if __name__ != "__main__" or "torch" not in sys.argv:  # the megatron phase and its rank actors
    cm.cuda_calls_on_cpu(allocations=True)
    cm.gloo_all_to_all()

ADAMS = [
    dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.0),
    dict(learning_rate=5e-4, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, grad_clip_norm=1.0),
]  # fmt: skip
LENGTHS = ((20, 13, 7, 16, 9, 11, 5), (18, 5, 12, 14, 10, 8))  # the datums of step 1, step 2
BUDGET = 32  # padded tokens per micro-batch: several micro-batches per replica, unequal counts


def _train(engine, out: dict, tag: str, save: Path | None = None) -> None:
    cm.train_pad_free(engine, out, tag, LENGTHS, ADAMS, save)


def _run_torch(work: Path) -> None:
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine
    from oneloop.tiny.model import TINY_QWEN3_MOE, build_tiny_model, named_tiny_specs

    model = build_tiny_model(named_tiny_specs()[TINY_QWEN3_MOE])
    common = dict(device="cpu", dtype="float32", threads=1, max_tokens_per_microbatch=BUDGET)
    out: dict = {}
    replayed = TorchTrainerEngine(model, LoraSpec(0), **common)
    cm.replay_call(replayed, model, out, "torch", LENGTHS[0], ADAMS[0], backward=True)
    engine = TorchTrainerEngine(model, LoraSpec(0), **common)
    _train(engine, out, "torch")
    cm.save_run(work / "torch.npz", out)


def _run(work: Path) -> None:
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup
    from oneloop.backends.megatron_local.engines.megatron.trainer import (
        MegatronParallel,
        MegatronTrainerEngine,
    )
    from oneloop.tiny.model import TINY_QWEN3_MOE, build_tiny_model, named_tiny_specs

    model = build_tiny_model(named_tiny_specs()[TINY_QWEN3_MOE])
    common = dict(dtype="float32", threads=1, max_tokens_per_microbatch=BUDGET)
    out: dict = cm.load_run(work / "torch.npz")
    mega = dict(device="cpu", speed=cm.check_speed(), **common)
    # megatron-core's own MoE path: SequentialMLP experts, index_select / scatter_add_ permutations
    sequential = dict(mega, speed=cm.check_speed(grouped_experts=False, gather_dispatch=False))
    r3 = MegatronTrainerEngine(model, LoraSpec(0), parallel=MegatronParallel(), **mega)
    plain_calls = cm.count_layer_calls(r3)
    cm.replay_call(r3, model, out, "ref", LENGTHS[0], ADAMS[0], backward=True)
    del r3
    # activation recompute: every decoder layer runs again in the backward, R3 replayed there too
    full = MegatronParallel(recompute="full")
    r3 = MegatronTrainerEngine(model, LoraSpec(0), parallel=full, **mega)
    recompute_calls = cm.count_layer_calls(r3)
    cm.replay_call(r3, model, out, "recompute", LENGTHS[0], ADAMS[0], backward=True)
    del r3
    recompute = MegatronTrainerEngine(model, LoraSpec(0), parallel=full, **mega)
    _train(recompute, out, "recompute")
    del recompute
    sorts = _ChunkSorts()  # megatron-core's sort by local expert, called per step below
    seq = MegatronTrainerEngine(model, LoraSpec(0), parallel=MegatronParallel(), **sequential)
    _train(seq, out, "sequential")
    del seq
    chunk_sorts = {"sequential": sorts.pop()}
    ref = MegatronTrainerEngine(model, LoraSpec(0), parallel=MegatronParallel(), **mega)
    _train(ref, out, "ref")
    chunk_sorts["ref"] = sorts.pop()
    cm.start_ray(2)
    ep2 = MegatronRayGroup(
        model,
        LoraSpec(0),
        parallel=MegatronParallel(dp=2, ep=2),
        timeout_s=cm.GROUP_TIMEOUT_S,
        setup=cm.phase_setup(),
        gpus_per_rank=0,
        **mega,
    )
    cm.replay_call(ep2, model, out, "ep2", LENGTHS[0], ADAMS[0], backward=False)  # forward only:
    # the next steps start clean
    _train(ep2, out, "ep2", save=work / "ckpt_ep2_step1")
    ep2.close()
    pp2 = MegatronRayGroup(model, LoraSpec(0), parallel=MegatronParallel(pp=2),
                           timeout_s=cm.GROUP_TIMEOUT_S, setup=cm.phase_setup(), gpus_per_rank=0,
                           **mega)  # fmt: skip
    cm.replay_call(pp2, model, out, "pp2", LENGTHS[0], ADAMS[0], backward=False)  # R3 by stage
    _train(pp2, out, "pp2")  # one MoE layer per stage, the tied output layer on the last
    pp2.close()
    # recompute under the pipeline schedule: each micro-batch's backward recomputes its layers
    # after other micro-batches' forwards, with the replay its forward had
    pp2 = MegatronRayGroup(model, LoraSpec(0), parallel=MegatronParallel(pp=2, recompute="full"),
                           timeout_s=cm.GROUP_TIMEOUT_S, setup=cm.phase_setup(), gpus_per_rank=0,
                           **mega)  # fmt: skip
    cm.replay_call(pp2, model, out, "pp2_recompute", LENGTHS[0], ADAMS[0], backward=True)
    pp2.close()
    # tensor parallelism: attention split over 2 ranks, sequence parallelism (each rank's MoE
    # layers route half the positions), every expert whole, split ep 2 over the same two ranks
    tp2 = MegatronRayGroup(model, LoraSpec(0), parallel=MegatronParallel(tp=2, ep=2),
                           timeout_s=cm.GROUP_TIMEOUT_S, setup=cm.phase_setup(), gpus_per_rank=0,
                           **mega)  # fmt: skip
    cm.replay_call(tp2, model, out, "tp2", LENGTHS[0], ADAMS[0], backward=False)
    _train(tp2, out, "tp2", save=work / "ckpt_tp2_step1")
    tp2.close()
    # context parallelism: each sequence's two chunks a rank, K/V gathered; each rank routes its
    # own positions (R3: its positions' records), experts split ep 2 over the CP pair
    cp2 = MegatronRayGroup(model, LoraSpec(0), parallel=MegatronParallel(cp=2, ep=2),
                           timeout_s=cm.GROUP_TIMEOUT_S, setup=cm.phase_setup(), gpus_per_rank=0,
                           **mega)  # fmt: skip
    cm.replay_call(cp2, model, out, "cp2", LENGTHS[0], ADAMS[0], backward=False)
    _train(cp2, out, "cp2", save=work / "ckpt_cp2_step1")
    cp2.close()
    figures: dict = {"microbatch_counts_dp2": cm.microbatch_counts(LENGTHS, 2, BUDGET)}
    figures["chunk_sorts"] = chunk_sorts
    figures["fused_rope"] = [ref.fused_rope, ref.module.position_embedding_type]  # "auto": on
    figures["layer0_calls"] = {"plain": plain_calls[0], "recompute": recompute_calls[0]}
    from oneloop.backends.megatron_local.engines.microbatch import pack_microbatches

    figures["r3_microbatches"] = len(pack_microbatches(list(LENGTHS[0]), BUDGET))
    try:
        ref.load_state(work / "ckpt_ep2_step1", with_optimizer=True)
        figures["ep1_loads_ep2_optimizer"] = "loaded"
    except ValueError as error:
        figures["ep1_loads_ep2_optimizer"] = str(error)
    for tag in ("tp2", "cp2", "ep2"):  # the groups' checkpoints load in one process (ep2 last)
        ref.load_state(work / f"ckpt_{tag}_step1", with_optimizer=False)
        loaded = cm.fused_weights(ref)
        figures[f"ep1_loads_{tag}_weights_gap"] = cm.weights_gap(loaded, out[f"{tag}/weights0"])
    figures["optimizer_files"] = sorted(p.name for p in (work / "ckpt_ep2_step1").glob("opt*"))
    figures["grouped_experts"] = sorted(
        type(m).__name__ for m in ref.module.modules() if type(m).__name__.endswith("Experts")
    )[:1]
    figures["dispatchers"] = sorted({type(m.token_dispatcher).__name__ for m in ref.module.modules()
                                     if hasattr(m, "token_dispatcher")})  # fmt: skip
    runs = ("torch", "ep2", "sequential", "pp2", "tp2", "cp2", "recompute")
    figures.update(cm.run_gaps(out, runs, steps=2))
    r3 = ("ref", "ep2", "pp2", "tp2", "cp2", "recompute", "pp2_recompute")
    figures.update(cm.r3_gaps(out, r3))
    figures["ref_weights_moved"] = cm.weights_gap(out["ref/weights1"], _weights_of(model))
    figures["expert_tensors"] = sum(".mlp.experts." in k for k in out["ep2/weights1"])
    (work / "figures.json").write_text(json.dumps(figures, indent=1))


class _ChunkSorts:
    """Counts megatron-core's `sort_chunks_by_idxs` calls from its token dispatcher (the sort by
    local expert) in this process from now on; `pop()` returns the count and restarts it."""

    def __init__(self) -> None:
        from megatron.core.transformer.moe import token_dispatcher

        original, self.calls = token_dispatcher.sort_chunks_by_idxs, 0

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        token_dispatcher.sort_chunks_by_idxs = counted

    def pop(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


def _weights_of(model: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    from oneloop.backends.megatron_local.engines.hf import fuse_experts

    weights = fuse_experts(load_file(str(model / "model.safetensors")))
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return {k: v.astype(np.float32) for k, v in weights.items()}


if __name__ == "__main__":
    sys.exit(cm.phase_main(__doc__, {"torch": _run_torch, "megatron": _run}))
