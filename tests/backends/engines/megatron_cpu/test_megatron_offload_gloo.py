"""The megatron engine's optimizer CPU offload on real megatron-core (one gloo rank, bf16).

offload_gloo_phases.py runs in its own process (the CUDA-on-CPU shims stay there): with and without
`optimizer_cpu_offload`, two steps with different AdamParams give the same losses, grad norms,
weights and fp32 optimizer state; checkpoints load across the two settings (step 3 repeats the
original's) and a step-0 checkpoint resets the moments. On CPU this proves the semantics, not the
placement (tests/gpu/test_megatron_offload.py checks that on the device).
"""

import json

import numpy as np
import pytest
from cpu_megatron import megatron_core_installed, run_phases

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.timeout(900)]
STATE_KEYS = ("main_params", "exp_avg", "exp_avg_sq")  # offload_gloo_phases.STATE_KEYS
KINDS = ("plain", "offload")


def test_offloaded_optimizer_matches_the_plain_one(tmp_path) -> None:
    assert megatron_core_installed(), "megatron-core missing: `uv sync` (group megatron-cpu)"
    run_phases("offload_gloo_phases.py", tmp_path, [[]])
    figures = json.loads((tmp_path / "figures.json").read_text())
    for key, value in figures.items():
        print(f"RESULT {key} = {value}")
    assert figures["weights_moved_by_2_steps_max"] > 0, figures
    assert figures["weights_abs_diff_max_after_2_steps"] < 1e-2, figures
    assert np.allclose(figures["loss_steps_plain"], figures["loss_steps_offload"], rtol=1e-3)
    assert np.allclose(
        figures["grad_norm_steps_plain"], figures["grad_norm_steps_offload"], rtol=1e-3
    )
    for key in STATE_KEYS:
        assert figures[f"{key}_fp32_abs_diff_max_after_2_steps"] < 1e-6, (key, figures)
    restart = "offload_restart_from_step0_ckpt_step1_weights_abs_diff_max_vs_plain"
    assert figures[restart] < 1e-6, figures
    for saved in KINDS:
        for into in KINDS:
            gap = figures[f"resume_{saved}_ckpt_into_{into}_step3_weights_abs_diff_max"]
            assert (gap == 0.0) if saved == into else (gap < 1e-2), (saved, into, figures)
