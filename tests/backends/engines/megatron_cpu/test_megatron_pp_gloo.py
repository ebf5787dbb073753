"""The megatron engine's pipeline parallelism on real megatron-core vs the one-process engine,
gloo ranks, float32: PP = 2 with tied and untied embeddings, TP = 2 × PP = 2 and PP = 2 × DP = 2
with tied ones.

pp_gloo_phases.py runs each size in its own process (the CUDA-on-CPU shims stay there) on the same
calls: forward_backward over 3 token-budget micro-batches, optim_step, a second step, save/load
with the optimizer and the second step again, forward_only; the groups also refuse infinite loss
weights and a step on overflowing gradients (and keep working), the one-process engine loads the
PP = 2 checkpoint, and TP × PP refuses the PP = 2 checkpoint's optimizer state. Losses, logprobs,
grad norms, weights after each step, the resumed step and forward_only must match.
"""

import json

import numpy as np
import pytest
from cpu_megatron import (
    megatron_core_installed,
    prefix_abs_diff_max,
    run_phases,
    run_phases_concurrently,
)

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.timeout(1200)]
# pp2 first: "1" loads its checkpoint and tp2pp2 refuses its optimizer state. TP = 2 × PP = 2 runs
# with tied embeddings only (CI time: its four ranks are the check's most expensive phase; the
# untied lm_head's pipeline placement is checked at PP = 2, its TP split by tests/gpu).
GROUPS = {"tied": ("pp2", "tp2pp2", "pp2dp2"), "untied": ("pp2",)}
LIMITS = {  # figure → its largest allowed value
    "loss_rel_diff": 1e-5,
    "per_datum_loss_abs_diff_max": 1e-3,
    "logprob_abs_diff_max": 1e-4,
    "grad_norm_rel_diff": 1e-4,
    "weights_after_step_abs_diff_max": 1e-5,
    "weights_after_2_steps_abs_diff_max": 1e-5,
    "resume_vs_uninterrupted_abs_diff_max": 1e-6,
    "forward_only_logprob_abs_diff_max": 1e-4,
    "pp2_checkpoint_in_one_process_loss_abs_diff": 1e-3,
    "loss_after_refused_step_abs_diff": 0.0,
}


def _figures(work, name: str, kind: str) -> dict[str, float]:
    one, many = np.load(work / f"1-{kind}.npz"), np.load(work / f"{name}-{kind}.npz")
    figures = {
        "loss_1": float(one["loss1"]),
        f"loss_{name}": float(many["loss1"]),
        "loss_rel_diff": abs(float(one["loss1"] - many["loss1"])) / abs(float(one["loss1"])),
        "per_datum_loss_abs_diff_max": float(np.abs(one["per_datum1"] - many["per_datum1"]).max()),
        "logprob_abs_diff_max": float(np.abs(one["lp1"] - many["lp1"]).max()),
        "grad_norm_1": float(one["grad_norm1"]),
        f"grad_norm_{name}": float(many["grad_norm1"]),
        "grad_norm_rel_diff": abs(float(one["grad_norm1"] - many["grad_norm1"]))
        / float(one["grad_norm1"]),
        "weights_after_step_abs_diff_max": prefix_abs_diff_max(one, many, "w1/"),
        "weights_after_2_steps_abs_diff_max": prefix_abs_diff_max(one, many, "w2/"),
        "resume_vs_uninterrupted_abs_diff_max": max(
            float(np.abs(many[k] - many[k.replace("w2/", "w2resumed/")]).max())
            for k in many.files
            if k.startswith("w2/")
        ),
        "forward_only_logprob_abs_diff_max": float(np.abs(one["fo_lp"] - many["fo_lp"]).max()),
    }
    figures["loss_after_refused_step_abs_diff"] = abs(  # the refused step changed nothing
        float(many["after_refusal_loss"] - many["before_refusal_loss"])
    )
    if name == "pp2":
        figures["pp2_checkpoint_in_one_process_loss_abs_diff"] = abs(
            float(one["cross_loss"] - many["fo_loss"])
        )
    return figures


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_pp2_and_tp2pp2_match_one_process_on_gloo_ranks(tmp_path, kind: str) -> None:
    assert megatron_core_installed(), "megatron-core missing: `uv sync` (group megatron-cpu)"
    first, *others = GROUPS[kind]
    run_phases("pp_gloo_phases.py", tmp_path, [["--only", f"{first}-{kind}"]], timeout=1800)
    phases = (["--only", f"{name}-{kind}"] for name in ("1", *others))  # both read pp2's output
    run_phases_concurrently("pp_gloo_phases.py", tmp_path, phases, timeout=1800)
    for name in GROUPS[kind]:
        figures = _figures(tmp_path, name, kind)
        print(f"RESULT megatron_pp_cpu {name} {kind}", json.dumps(figures))
        over = {k: figures[k] for k, limit in LIMITS.items() if k in figures and figures[k] > limit}
        assert not over, (name, over, figures)
