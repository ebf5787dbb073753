"""The megatron engine's LoRA at TP = 2 vs TP = 1 on real megatron-core, gloo ranks, float32.

lora_tp_gloo_phases.py runs each phase in its own process (the CUDA-on-CPU shims stay there):
TP = 1, TP = 2, then TP = 1 loading the TP = 2 checkpoint. Both sizes start from the same random
non-zero adapter on every target and make the same calls; their losses, logprobs, adapter
gradients, grad norm, adapter after a step, merged weights, checkpoint files and resumed steps must
match, and a checkpoint's optimizer state is refused at the other TP size (with the reason) while
its adapter loads.
"""

import json

import numpy as np
import pytest
from cpu_megatron import (
    grad_rel_diff_max,
    max_abs_diff,
    megatron_core_installed,
    prefix_abs_diff_max,
    run_phases,
)

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.timeout(900)]
TP = 2
LOSSES = ("cross_entropy", "importance_sampling")  # lora_tp_gloo_phases.LOSSES, in call order


def _figures(work, tp: int) -> dict:
    one, many = np.load(work / "tp1.npz"), np.load(work / f"tp{tp}.npz")
    g1, gn = np.load(work / "grads1.npz"), np.load(work / f"grads{tp}.npz")
    i1, i_n = np.load(work / "init1.npz"), np.load(work / f"init{tp}.npz")
    probe = np.load(work / "probe1.npz")

    def gap(prefix: str) -> float:
        return prefix_abs_diff_max(one, many, prefix)

    figures: dict = {
        "init_adapter_abs_diff_max": max_abs_diff(i1, i_n, i1.files),
        "grad_rel_diff_max": grad_rel_diff_max(g1, gn),
        "grad_norm_tp1": float(one["grad_norm"]),
        f"grad_norm_tp{tp}": float(many["grad_norm"]),
        "adapter_after_step_abs_diff_max": gap("adapter/"),
        "logprob_after_step_abs_diff_max": gap("lp_after_step"),
        "merged_hf_abs_diff_max": gap("hf/"),
        "checkpoint_files_tp1": json.loads((work / "files1.json").read_text()),
        f"checkpoint_files_tp{tp}": json.loads((work / f"files{tp}.json").read_text()),
        f"resume_restore_abs_diff_max_tp{tp}": float(many["resume_restore_abs_diff_max"]),
        f"resume_step_abs_diff_max_tp{tp}": float(many["resume_step_abs_diff_max"]),
        "resume_step_abs_diff_max_tp1": float(one["resume_step_abs_diff_max"]),
        "tp1_ckpt_adapter_abs_diff_max": float(many["tp1_ckpt_adapter_abs_diff_max"]),
        "tp_mismatch_refusal": str(many["mismatch_refused"]),
        f"tp{tp}_ckpt_adapter_at_tp1_abs_diff_max": float(probe["adapter_abs_diff_max"]),
        "tp_mismatch_refusal_at_tp1": str(probe["mismatch_refused"]),
    }
    for loss in LOSSES:
        figures[f"{loss}_loss_tp1"] = float(one[f"loss_{loss}"])
        figures[f"{loss}_loss_tp{tp}"] = float(many[f"loss_{loss}"])
        figures[f"{loss}_logprob_abs_diff_max"] = gap(f"lp_{loss}")
    return figures


def _checks(figures: dict, tp: int) -> dict[str, bool]:
    files_1 = set(figures["checkpoint_files_tp1"]) - {"optimizer.pt"}
    files_n = {f for f in figures[f"checkpoint_files_tp{tp}"] if not f.startswith("optimizer.")}
    return {
        "init": figures["init_adapter_abs_diff_max"] == 0.0,
        "loss": all(
            abs(figures[f"{x}_loss_tp1"] - figures[f"{x}_loss_tp{tp}"])
            < 1e-4 * abs(figures[f"{x}_loss_tp1"])
            for x in LOSSES
        ),
        "logprobs": all(figures[f"{x}_logprob_abs_diff_max"] < 1e-4 for x in LOSSES),
        "grads": figures["grad_rel_diff_max"] < 1e-4,
        "grad_norm": abs(figures["grad_norm_tp1"] - figures[f"grad_norm_tp{tp}"])
        < 1e-5 * figures["grad_norm_tp1"],
        "adapter": figures["adapter_after_step_abs_diff_max"] < 1e-5,
        "after_step": figures["logprob_after_step_abs_diff_max"] < 1e-4,
        "merged": figures["merged_hf_abs_diff_max"] < 1e-5,
        "ckpt_layout": files_1 == files_n
        and {f"optimizer.tp{tp}.rank{r}.pt" for r in range(tp)}
        <= set(figures[f"checkpoint_files_tp{tp}"]),
        "resume": figures[f"resume_restore_abs_diff_max_tp{tp}"] == 0.0
        and figures[f"resume_step_abs_diff_max_tp{tp}"] < 1e-6
        and figures["resume_step_abs_diff_max_tp1"] < 1e-6,
        "cross_tp_adapter_load": figures["tp1_ckpt_adapter_abs_diff_max"] == 0.0,
        "mismatch_refused": "saved at local.megatron tp=1 " in figures["tp_mismatch_refusal"],
        "tpn_ckpt_at_tp1": figures[f"tp{tp}_ckpt_adapter_at_tp1_abs_diff_max"] == 0.0,
        "mismatch_refused_at_tp1": f"saved at local.megatron tp={tp} "
        in figures["tp_mismatch_refusal_at_tp1"],
    }


def test_lora_at_tp2_matches_tp1_on_gloo_ranks(tmp_path) -> None:
    assert megatron_core_installed(), "megatron-core missing: `uv sync` (group megatron-cpu)"
    phases = (["--only", "1"], ["--only", str(TP)], ["--probe", str(TP)])
    run_phases("lora_tp_gloo_phases.py", tmp_path, phases)
    figures = _figures(tmp_path, TP)
    print("RESULT megatron_lora_tp_cpu", json.dumps(figures, indent=1))
    failed = [name for name, ok in _checks(figures, TP).items() if not ok]
    assert not failed, (failed, figures)
