"""LoRA on the `megatron` trainer at TP = 2 (two GPUs, `megatron.group` → `parallel.lora_tp`)
against TP = 1, same random Qwen3 (0.6 B shape, bf16) and the same start adapter (B != 0, loaded
through the LoRA checkpoint path): forward_backward loss and target logprobs, grad norm and the
adapter after one optim_step, logprobs after the step, merged sampler weights, the PEFT adapter's
layout, save/load with the per-rank optimizer state, and a TP mismatch refused.

TP = 1 runs first in a subprocess (torch.distributed is one world per process; this file run as a
script is that subprocess), then TP = 2 in the test process. Device only, nvidia-h200-x2:
`ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest -m gpu tests/gpu/test_megatron_lora_tp.py`
(gpu_run.sh stage `mlora_tp`). Figures → $OUT/megatron_lora_tp.json.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs (nvidia-h200-x2)", allow_module_level=True)

from gpu_figures import ADAM, batch, model_dir, record  # noqa: E402

from oneloop.backends.megatron_local.engines.base import LoraSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

LORA = LoraSpec(16, seed=3)
LORA_ADAM = {**ADAM, "learning_rate": 1e-3}  # a usual LoRA rate (test_megatron_engine's)
LOSSES = ("cross_entropy", "importance_sampling")
MERGED_KEYS = tuple(  # merged sampler weights compared: every target of two layers + lm_head
    f"model.layers.{i}.{m}.weight"
    for i in (0, 27)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
) + ("lm_head.weight",)


def start_adapter(engine, path: Path, out: Path) -> Path:
    """`engine`'s own adapter with B drawn at random (seeded), as a LoRA checkpoint at step 0."""
    adapter = engine.adapter()
    rng = np.random.default_rng(11)
    for name, value in adapter.tensors.items():
        if ".lora_B." in name:
            value[...] = rng.standard_normal(value.shape).astype(np.float32) * 1e-3
    adapter.write_peft(out, str(path))
    (out / "engine.json").write_text('{"steps": 0}')
    return out


def run_sequence(engine) -> dict:
    """The calls both TP sizes make after loading the start adapter."""
    out: dict = {}
    for loss in LOSSES:
        result = engine.forward_backward(batch(1, loss), loss, None, forward_only=False)
        out[loss] = (result.loss, result.logprobs)
    out["step"] = engine.optim_step(LORA_ADAM)
    out["adapter"] = engine.adapter().tensors
    after = engine.forward_backward(batch(1, "cross_entropy"), "cross_entropy", None, True)
    out["after"] = after.logprobs
    weights = engine.hf_weights()
    out["merged"] = {k: weights[k].float().cpu() for k in MERGED_KEYS}
    return out


def reference_tp1(path: Path, work: Path) -> None:
    """TP = 1 in this (sub)process: writes the start adapter, the results and a checkpoint."""
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronTrainerEngine

    engine = MegatronTrainerEngine(path, LORA, dtype="bfloat16", device="cuda")
    init = engine.adapter().tensors
    base = engine.hf_weights()  # B = 0: the merged weights are the base ones
    base = {k: base[k].float().cpu() for k in MERGED_KEYS}
    engine.load_state(start_adapter(engine, path, work / "start"), with_optimizer=False)
    result = run_sequence(engine)
    result["init"], result["base"] = init, base
    engine.save_state(work / "ckpt_tp1", with_optimizer=True)
    torch.save(result, work / "tp1.pt")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def tp1(model, tmp_path_factory) -> tuple[dict, Path]:
    work = tmp_path_factory.mktemp("lora-tp1")
    done = subprocess.run(
        [sys.executable, __file__, str(model), str(work)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(work / "tp1.pt", weights_only=False), work


@pytest.fixture(scope="module")
def tp2(model, tp1):  # tp1 first: its process has left the GPU before the group starts
    import ray

    from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel

    if not ray.is_initialized():  # the group's ranks are Ray actors, one GPU each
        ray.init(address="local", num_gpus=2, include_dashboard=False)
    engine = MegatronRayGroup(
        model, LORA, dtype="bfloat16", device="cuda", parallel=MegatronParallel(tp=2)
    )
    yield engine
    engine.close()


def _flat(tensors: dict, names: list[str]) -> torch.Tensor:
    return torch.cat([torch.from_numpy(np.asarray(tensors[k])).flatten() for k in names])


def test_lora_tp2_matches_tp1(tp1, tp2) -> None:
    ref, work = tp1
    names = sorted(ref["init"])
    init = tp2.adapter()
    assert sorted(init.tensors) == names  # the PEFT layout of TP = 1 (and of the torch engine)
    figures: dict = {
        "init_adapter_abs_diff_max": float(
            (_flat(init.tensors, names) - _flat(ref["init"], names)).abs().max()
        )
    }
    assert figures["init_adapter_abs_diff_max"] == 0.0  # same seed, same adapter at any TP size
    tp2.load_state(work / "start", with_optimizer=False)
    got = run_sequence(tp2)
    for loss in LOSSES:
        (loss_2, lp_2), (loss_1, lp_1) = got[loss], ref[loss]
        gaps = np.concatenate([np.abs(a - b) for a, b in zip(lp_2, lp_1, strict=True)])
        figures[loss] = {
            "loss_tp2": loss_2,
            "loss_tp1": loss_1,
            "loss_abs_diff_per_token": abs(loss_2 - loss_1) / sum(len(x) for x in lp_1),
            "logprob_abs_diff_mean": float(gaps.mean()),
            "logprob_abs_diff_max": float(gaps.max()),
        }
        assert figures[loss]["loss_abs_diff_per_token"] < 0.01
        assert figures[loss]["logprob_abs_diff_mean"] < 0.02
    after_2, after_1 = _flat(got["adapter"], names), _flat(ref["adapter"], names)
    a_names = [k for k in names if ".lora_A." in k]
    upd_2 = _flat(got["adapter"], a_names) - _flat(ref["init"], a_names)
    upd_1 = _flat(ref["adapter"], a_names) - _flat(ref["init"], a_names)
    norm_2, norm_1 = got["step"]["grad_norm:mean"], ref["step"]["grad_norm:mean"]
    gaps_after = np.concatenate(
        [np.abs(a - b) for a, b in zip(got["after"], ref["after"], strict=True)]
    )
    shift = np.concatenate(
        [np.abs(a - b) for a, b in zip(ref["after"], ref["cross_entropy"][1], strict=True)]
    )
    merged = torch.cat([(got["merged"][k] - ref["merged"][k]).abs().flatten() for k in MERGED_KEYS])
    figures["optim_step"] = {
        "grad_norm_tp2": norm_2,
        "grad_norm_tp1": norm_1,
        "adapter_abs_diff_max": float((after_2 - after_1).abs().max()),
        "adapter_abs_diff_mean": float((after_2 - after_1).abs().mean()),
        "lora_A_update_cosine": float(
            torch.nn.functional.cosine_similarity(upd_2.double(), upd_1.double(), dim=0)
        ),
        "lora_A_update_abs_mean_tp1": float(upd_1.abs().mean()),
        "logprob_after_step_abs_diff_mean": float(gaps_after.mean()),
        "logprob_shift_mean": float(shift.mean()),
        "merged_abs_diff_max": float(merged.max()),
        "merged_abs_diff_mean": float(merged.mean()),
        "merged_delta_abs_mean_tp1": float(
            torch.cat(
                [(ref["merged"][k] - ref["base"][k]).abs().flatten() for k in MERGED_KEYS]
            ).mean()
        ),
    }
    record("megatron_lora_tp", figures)
    step = figures["optim_step"]
    assert abs(norm_2 - norm_1) / norm_1 < 0.05  # split parts counted once, replicated once
    assert step["lora_A_update_cosine"] > 0.9  # A's gradient: TP-summed through h = A·x
    assert step["adapter_abs_diff_mean"] < 0.5 * LORA_ADAM["learning_rate"]
    assert step["logprob_after_step_abs_diff_mean"] < 0.2 * step["logprob_shift_mean"]
    # A misplaced adapter block would make the gap as large as the delta itself.
    assert step["merged_abs_diff_mean"] < 0.1 * step["merged_delta_abs_mean_tp1"]


def test_lora_tp2_save_load_resume_and_tp_mismatch(tp1, tp2, tmp_path) -> None:
    _, work = tp1
    data = batch(2, "cross_entropy")
    tp2.forward_backward(batch(3, "cross_entropy"), "cross_entropy", None, forward_only=False)
    tp2.optim_step(LORA_ADAM)
    ckpt = tmp_path / "ckpt"
    tp2.save_state(ckpt, with_optimizer=True)
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "engine.json",
        "optimizer.tp2.rank0.pt",
        "optimizer.tp2.rank1.pt",
    ], files
    assert json.loads((ckpt / "engine.json").read_text())["tp"] == 2
    saved = tp2.adapter()
    expected = tp2.forward_backward(data, "cross_entropy", None, forward_only=False)
    tp2.optim_step(LORA_ADAM)
    after_one = tp2.forward_backward(data, "cross_entropy", None, forward_only=True).loss
    tp2.load_state(ckpt, with_optimizer=True)
    restored = tp2.adapter()
    assert all(np.array_equal(restored.tensors[k], v) for k, v in saved.tensors.items())
    again = tp2.forward_backward(data, "cross_entropy", None, forward_only=False)
    assert again.loss == pytest.approx(expected.loss, rel=1e-6)
    tp2.optim_step(LORA_ADAM)
    assert tp2.forward_backward(data, "cross_entropy", None, forward_only=True).loss == (
        pytest.approx(after_one, rel=1e-4)
    )
    with pytest.raises(ValueError, match="saved at local.megatron tp=1 "):
        tp2.load_state(work / "ckpt_tp1", with_optimizer=True)
    tp2.load_state(work / "ckpt_tp1", with_optimizer=False)  # the adapter loads at any TP size
    ref = torch.load(work / "tp1.pt", weights_only=False)["adapter"]
    loaded = tp2.adapter().tensors
    assert all(np.array_equal(loaded[k], v) for k, v in ref.items())


if __name__ == "__main__":
    reference_tp1(Path(sys.argv[1]), Path(sys.argv[2]))
