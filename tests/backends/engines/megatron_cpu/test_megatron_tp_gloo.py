"""The megatron engine's tensor parallelism on real megatron-core, TP = 2 vs TP = 1 on gloo ranks.

Each size runs in its own process (tp_gloo_phases.py: the CUDA-on-CPU shims stay there): target
logprobs, the loss, the exported HF weights and every parameter's gradient must match; each phase
also checks a save/load round trip, an error all ranks raise alike and a killed rank. The optimizer
is left out here (CUDA-only in Megatron): tests/gpu/test_megatron_tp.py checks optim_step.
"""

import numpy as np
import pytest
from cpu_megatron import (
    build_model,
    grad_rel_diff_max,
    max_abs_diff,
    megatron_core_installed,
    run_phases_concurrently,
)

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.timeout(900)]
TP = 2


def test_tp2_matches_tp1_on_gloo_ranks(tmp_path) -> None:
    assert megatron_core_installed(), "megatron-core missing: `uv sync` (group megatron-cpu)"
    phases = (["--only", str(tp)] for tp in (1, TP))
    build_model(tmp_path / "model")  # the phases' model (tiny_qwen3), written once
    run_phases_concurrently("tp_gloo_phases.py", tmp_path, phases)
    one, many = np.load(tmp_path / "tp1.npz"), np.load(tmp_path / f"tp{TP}.npz")
    g1, gn = np.load(tmp_path / "grads1.npz"), np.load(tmp_path / f"grads{TP}.npz")
    names = [k for k in one.files if k not in ("loss", "lp")]
    figures = {
        "loss_tp1": float(one["loss"]),
        f"loss_tp{TP}": float(many["loss"]),
        "logprob_abs_diff_max": float(np.abs(one["lp"] - many["lp"]).max()),
        "weights_abs_diff_max": max_abs_diff(one, many, names),
        "grad_rel_diff_max": grad_rel_diff_max(g1, gn),
    }
    print("RESULT megatron_tp_cpu", figures)
    assert sorted(one.files) == sorted(many.files)
    assert sorted(g1.files) == sorted(gn.files)
    assert figures["logprob_abs_diff_max"] < 1e-4, figures
    assert figures["weights_abs_diff_max"] == 0.0, figures
    assert figures["grad_rel_diff_max"] < 1e-4, figures
