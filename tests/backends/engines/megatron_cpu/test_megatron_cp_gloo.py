"""The megatron engine's context parallelism on real megatron-core: CP = 2 vs CP = 1, gloo ranks.

cp_gloo_phases.py runs each size in its own process (the CUDA-on-CPU shims stay there) on the same
calls: cross_entropy then ppo (accumulating; ragged datums, several micro-batches), optim_step,
forward_only, a save/load round trip. Losses, per-datum losses, ppo's clipped-token count,
per-token logprobs, the reduced gradients, the grad norm and the weights after the step must
match, for both fused_rope settings (our RoPE at global positions; Megatron's CP-sliced RoPE).
"""

import json

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
TP, CP = 1, 2
LOSSES = ("cross_entropy", "ppo")


def _max_gap(a, b) -> float:
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b, strict=True)
    )


def _figures(work, tag: str) -> dict:
    one, many = (json.loads((work / f"{t}.json").read_text()) for t in ("tp1cp1", tag))
    figures: dict = {}
    for loss in LOSSES:
        figures[loss] = {
            "loss_cp1": one[loss]["loss"],
            f"loss_{tag}": many[loss]["loss"],
            "loss_abs_diff": abs(one[loss]["loss"] - many[loss]["loss"]),
            "per_datum_abs_diff_max": _max_gap([one[loss]["per_datum"]], [many[loss]["per_datum"]]),
            "metrics_cp1": one[loss]["metrics"],
            f"metrics_{tag}": many[loss]["metrics"],
            "logprob_abs_diff_max": _max_gap(one[f"{loss}_lp"], many[f"{loss}_lp"]),
            "lengths_ok": [len(x) for x in many[f"{loss}_lp"]] == many["lengths"],
        }
    figures["forward_only_after_step"] = {
        "loss_abs_diff": abs(one["after_loss"] - many["after_loss"]),
        "logprob_abs_diff_max": _max_gap(one["after_lp"], many["after_lp"]),
    }
    figures["reload_loss_abs_diff"] = abs(many["reloaded_loss"] - many["after_loss"])
    w1, wn = np.load(work / "weights_tp1cp1.npz"), np.load(work / f"weights_{tag}.npz")
    if "step" in many:
        g1, gn = np.load(work / "grads_tp1cp1.npz"), np.load(work / f"grads_{tag}.npz")
        figures["optim_step"] = {
            "grad_norm_cp1": one["step"]["grad_norm:mean"],
            f"grad_norm_{tag}": many["step"]["grad_norm:mean"],
            "grad_rel_diff_max": grad_rel_diff_max(g1, gn),
            "weights_abs_diff_max": max_abs_diff(w1, wn, w1.files),
        }
    else:  # TP > 1: no optimizer stand-in; weights unchanged, exported in the same HF layout
        figures["weights_abs_diff_max"] = max_abs_diff(w1, wn, w1.files)
    return figures


@pytest.mark.parametrize("fused_rope", [False, True], ids=["our_rope", "fused_rope"])
def test_cp2_matches_cp1_on_gloo_ranks(tmp_path, fused_rope: bool) -> None:
    assert megatron_core_installed(), "megatron-core missing: `uv sync` (group megatron-cpu)"
    step = int(TP == 1)  # the stand-in optimizer: TP = 1
    phases = (["--only", f"{t},{c},{int(fused_rope)},{step}"] for t, c in ((1, 1), (TP, CP)))
    build_model(tmp_path / "model")  # the phases' model (tiny_qwen3), written once
    run_phases_concurrently("cp_gloo_phases.py", tmp_path, phases)
    tag = f"tp{TP}cp{CP}"
    figures = _figures(tmp_path, tag)
    print(f"RESULT megatron_cp_cpu fused_rope={fused_rope}", json.dumps(figures, indent=1))
    for loss in LOSSES:
        assert figures[loss]["lengths_ok"], (loss, figures)
        assert figures[loss]["logprob_abs_diff_max"] < 1e-4, (loss, figures)
        assert figures[loss]["per_datum_abs_diff_max"] < 1e-3, (loss, figures)
        assert figures[loss]["loss_abs_diff"] < 1e-3, (loss, figures)
    ppo = figures["ppo"]
    clipped = ppo[f"metrics_{tag}"]["clipped_tokens:sum"]
    assert clipped == ppo["metrics_cp1"]["clipped_tokens:sum"], figures
    assert figures["forward_only_after_step"]["logprob_abs_diff_max"] < 1e-4, figures
    assert figures["reload_loss_abs_diff"] < 1e-5, figures
    if "optim_step" in figures:
        optim = figures["optim_step"]
        one, many = optim["grad_norm_cp1"], optim[f"grad_norm_{tag}"]
        assert abs(one - many) / one < 1e-5, figures
        assert optim["grad_rel_diff_max"] < 1e-4, figures
        assert optim["weights_abs_diff_max"] < 1e-5, figures
    else:
        assert figures["weights_abs_diff_max"] == 0.0, figures
