"""Llama 3's RoPE scaling on the megatron engine (real megatron-core, CPU, fp32): its target
logprobs equal the torch engine's (transformers' scaling) on a tiny random Llama with `llama3`
scaling, where plain RoPE would be measurably off at these positions; `fused_rope`, which rotates
with unscaled frequencies, is refused there. Phases: rope_phases.py. RoPE scaling the engine does
not build is refused before any engine starts (tests/backends/engines/test_megatron_layout.py)."""

import json

import numpy as np
import pytest
from cpu_megatron import megatron_core_installed, run_phases_concurrently

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.timeout(900)]


def test_llama3_rope_scaling_matches_the_torch_engine(tmp_path) -> None:
    assert megatron_core_installed(), "megatron-core missing: `uv sync` (group megatron-cpu)"
    from rope_phases import build

    build(tmp_path)  # once, before the phases that both read it
    phases = (["--phase", "torch"], ["--phase", "megatron"])
    run_phases_concurrently("rope_phases.py", tmp_path, phases, timeout=600)
    torch_lp, megatron_lp = np.load(tmp_path / "torch.npz"), np.load(tmp_path / "megatron.npz")
    gap = float(np.abs(megatron_lp["scaled"] - torch_lp["scaled"]).max())
    scaling = float(np.abs(torch_lp["scaled"] - torch_lp["plain"]).max())
    vs_plain = float(np.abs(megatron_lp["scaled"] - torch_lp["plain"]).max())
    refusal = json.loads((tmp_path / "refusal.txt").read_text())
    print(f"RESULT megatron vs torch (llama3 scaling) max |dlogprob| = {gap}")
    print(f"RESULT scaled vs plain RoPE (torch engine) max |dlogprob| = {scaling}")
    print(f"RESULT megatron (llama3 scaling) vs torch with plain RoPE: {vs_plain}")
    print(f"RESULT fused_rope: {refusal}")
    assert gap < 2e-5, gap
    # the scaling matters at these positions: plain RoPE (what the engine built before it read
    # the scaling) fails the bound above many times over (7.6e-4 when written)
    assert scaling > 10 * 2e-5 and vs_plain > 10 * 2e-5, (scaling, vs_plain)
    assert "fused_rope" in refusal and "llama3, factor 8.0" in refusal, refusal
