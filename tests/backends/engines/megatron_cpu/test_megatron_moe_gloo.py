"""Qwen3-MoE on the megatron trainer engine itself (real megatron-core, CPU, gloo, fp32).

moe_gloo_phases.py runs two phases, each in its own process: the torch trainer engine (no CUDA
shims), then the megatron engine at ep = 1 in-process (grouped-GEMM experts and the gather
dispatcher, and megatron-core's SequentialMLP experts and permutations alike), at dp = 2 × ep = 2 as
Ray rank actors (each rank holding half of every layer's experts, tokens dispatched all-to-all,
replicas with unequal micro-batch counts), at pp = 2 (two pipeline stages), at tp = 2 (sequence
parallel, experts whole, ep = 2 over the TP pair) and at cp = 2 (each rank two chunks of every
sequence, ep = 2 over the CP pair). Over two optim_steps: megatron equals the torch engine (loss,
grad norm, logprobs, weights), and ep = 2, pp = 2, tp = 2 and cp = 2 equal ep = 1; the ep = 2
checkpoint's weights (experts gathered back to HF form) load at ep = 1 and its optimizer state is
refused there, naming the layouts. Routing replay (R3): a call whose datums carry recorded experts
computes with them on the megatron engine as on the torch engine, at ep = 1, ep = 2, pp = 2, tp = 2
and cp = 2. Activation recompute (`local.megatron.recompute: full`) runs every layer again in the
backward and changes nothing: the same figures at ep = 1, and the same replayed gradient at ep = 1
and across two pipeline stages (each backward recomputing with its own forward's replay).
"""

import json

import pytest
from cpu_megatron import megatron_core_installed, run_phases

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.timeout(900)]


def test_megatron_moe_matches_torch_and_ep2_matches_ep1(tmp_path) -> None:
    assert megatron_core_installed(), "megatron-core missing: `uv sync` (group megatron-cpu)"
    run_phases("moe_gloo_phases.py", tmp_path, [["--phase", "torch"], ["--phase", "megatron"]])
    figures = json.loads((tmp_path / "figures.json").read_text())
    for key, value in figures.items():
        print(f"RESULT {key} = {value}")
    counts = figures["microbatch_counts_dp2"]
    assert any(len(set(step)) > 1 for step in counts), counts  # the idle micro-batch path ran
    assert figures["ref_weights_moved"] > 1e-4, figures
    assert figures["expert_tensors"] == 4, figures  # 2 layers × (gate_up, down) in module layout
    assert figures["grouped_experts"] == ["GroupedExperts"], figures  # the default speed switch
    assert figures["dispatchers"] == ["GatherDispatcher"], figures  # gather_dispatch, default on
    # on one rank the gather dispatcher skips the sort by local expert (the identity there),
    # which megatron-core's own dispatcher runs in every MoE layer's forward
    assert figures["chunk_sorts"]["ref"] == 0 < figures["chunk_sorts"]["sequential"], figures
    # fused_rope "auto" (the default) applies to Qwen3-MoE: the SDPA attention rotates q and k
    assert figures["fused_rope"] == [True, "none"], figures
    # sequential: megatron-core's SequentialMLP; pp2: two pipeline stages; tp2: TP + SP, EP 2;
    # recompute: every layer recomputed in the backward
    for tag in ("torch", "ep2", "sequential", "pp2", "tp2", "cp2", "recompute"):
        for step in range(2):
            assert figures[f"{tag}_loss{step}_rel_gap"] < 1e-6, (tag, step, figures)
            assert figures[f"{tag}_grad_norm{step}_rel_gap"] < 1e-5, (tag, step, figures)
            assert figures[f"{tag}_logprob{step}_gap"] < 2e-5, (tag, step, figures)
            # AdamW moves every weight by about lr (1e-3) on the first step whatever its gradient's
            # size, so a weight whose gradient is near eps moves by a different fraction of lr
            # at 1e-7 relative gradient differences: the bound is 30 % of one step, not 1e-6
            assert figures[f"{tag}_weights{step}_gap"] < 3e-4, (tag, step, figures)
    # Routing replay (R3): the datums' recorded experts, on the megatron engine (ep = 1, with a
    # backward; ep = 2, forward only, replicas with unequal micro-batch counts) as on the torch
    # engine: logprobs, loss, grad norm and the routing metrics (positions replayed, positions
    # whose own experts differ, the gap to the sampler's logprobs with and without replay).
    # pp2: each stage replays its own layers' records; tp2: each TP rank its positions' records
    for tag in ("ref", "ep2", "pp2", "tp2", "cp2", "recompute", "pp2_recompute"):
        assert figures[f"{tag}_r3_logprob_gap"] < 2e-5, (tag, figures)
        assert figures[f"{tag}_r3_loss_rel_gap"] < 1e-6, (tag, figures)
        positions, torch_positions = figures[f"{tag}_r3_positions"]
        assert positions == torch_positions > 0, (tag, figures)
        assert figures[f"{tag}_r3_differ"][0] == figures[f"{tag}_r3_differ"][1] > 0, figures
        for name in ("gap_tokens", "gap_replay", "gap_free"):
            mine, theirs = figures[f"{tag}_r3_{name}"]
            assert abs(mine - theirs) <= 1e-4 * abs(theirs), (tag, name, figures)
    for tag in ("ref", "recompute", "pp2_recompute"):  # the replayed call's gradient
        assert figures[f"{tag}_r3_grad_norm_rel_gap"] < 1e-5, (tag, figures)
    # recompute ran: the first decoder layer's forwards, one more per micro-batch (its
    # recomputation in the backward) than without (the forward and R3's free pass)
    calls, microbatches = figures["layer0_calls"], figures["r3_microbatches"]
    assert calls["plain"] == 2 * microbatches and calls["recompute"] == 3 * microbatches, figures
    assert figures["ref_r3_gap_replay"][0] != figures["ref_r3_gap_free"][0], figures  # replayed
    assert figures["ep1_loads_ep2_weights_gap"] == 0.0, figures
    assert figures["ep1_loads_tp2_weights_gap"] == 0.0, figures
    assert figures["ep1_loads_cp2_weights_gap"] == 0.0, figures
    refused = figures["ep1_loads_ep2_optimizer"]
    assert "dp=2 ep=2" in refused and "dp=1 ep=1" in refused, refused
    assert figures["optimizer_files"] == [
        "optimizer.tp1.dp2.ep2.rank0.pt",
        "optimizer.tp1.dp2.ep2.rank1.pt",
    ], figures
