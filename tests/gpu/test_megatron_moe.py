"""The `megatron` trainer engine on a real-width MoE against the `torch` engine, one GPU: the
4-layer Qwen3-30B-A3B-width random model (`build_random_qwen3.py --shape 30b-a3b-4l`, bf16),
megatron-core's MoE layers (router in fp32, all-to-all dispatch) with the engine's default speed
switches (grouped-GEMM experts, gather dispatch, Triton logprob kernels) built from our
`megatron.moe` mapping. forward_backward loss and target logprobs, and the update of one
optim_step, within bf16 tolerance of transformers' Qwen3-MoE (whose router runs in bf16: a token
whose top-k is a near tie may pick other experts there); save/load restores the weights.

Device only (`pytest -m gpu tests/gpu/test_megatron_moe.py`). Figures → $OUT/megatron_moe.json.
"""

import gc
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


from gpu_figures import (  # noqa: I001  (first: puts the runbook on the path)
    ADAM,
    batch,
    host_weights,
    logprob_gaps,
    record,
    update_cosine,
)
from build_random_qwen3 import build  # noqa: E402

from oneloop.backends.megatron_local.engines.base import LoraSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    given = os.environ.get("ONELOOP_GPU_MOE_DIR")
    return Path(given) if given else build("30b-a3b-4l", tmp_path_factory.mktemp("moe"))


def test_megatron_moe_matches_torch_engine(path, tmp_path) -> None:
    from safetensors.torch import load_file

    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronTrainerEngine
    from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine

    before: dict = {}
    for file in sorted(path.glob("*.safetensors")):
        before.update(load_file(str(file)))
    before = host_weights(before)
    data = batch(1, "cross_entropy")
    ref = TorchTrainerEngine(path, LoraSpec(0), dtype="bfloat16", device="cuda")
    b = ref.forward_backward(data, "cross_entropy", None, forward_only=False)
    step_t = ref.optim_step(ADAM)
    after_t = host_weights(ref.sampler_weights())
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    mega = MegatronTrainerEngine(path, LoraSpec(0), dtype="bfloat16", device="cuda")
    assert mega.moe is not None and not mega.te
    experts = {type(m).__name__ for m in mega.module.modules() if type(m).__name__.endswith("MLP")}
    assert "SequentialMLP" not in experts, experts  # grouped_experts, the default
    dispatchers = {type(m.token_dispatcher).__name__ for m in mega.module.modules()
                   if hasattr(m, "token_dispatcher")}  # fmt: skip
    assert dispatchers == {"GatherDispatcher"}, dispatchers  # gather_dispatch, the default
    a = mega.forward_backward(data, "cross_entropy", None, forward_only=False)
    step_m = mega.optim_step(ADAM)
    after_m = host_weights(mega.hf_weights())
    gaps = logprob_gaps(a, b)
    keys = sorted(after_t)
    assert sorted(after_m) == keys
    cosine = update_cosine(before, after_m, after_t)
    mega.save_state(tmp_path / "ckpt", with_optimizer=True)  # ~44 GB with the optimizer
    del mega
    gc.collect()
    torch.cuda.empty_cache()
    try:
        restored = MegatronTrainerEngine(path, LoraSpec(0), dtype="bfloat16", device="cuda")
        restored.load_state(tmp_path / "ckpt", with_optimizer=True)
        reloaded = host_weights(restored.hf_weights())
    finally:
        shutil.rmtree(tmp_path / "ckpt")  # the device's disk is 64 GB
    figures = {
        "loss_megatron": a.loss,
        "loss_torch": b.loss,
        "loss_rel_diff": abs(a.loss - b.loss) / abs(b.loss),
        "logprob_abs_diff_mean": float(gaps.mean()),
        "logprob_abs_diff_max": float(gaps.max()),
        "grad_norm_megatron": step_m["grad_norm:mean"],
        "grad_norm_torch": step_t["grad_norm:mean"],
        "update_cosine": cosine,
        "weight_abs_diff_max": max(float((after_m[k] - after_t[k]).abs().max()) for k in keys),
        "restored_weight_abs_diff_max": max(
            float((reloaded[k] - after_m[k]).abs().max()) for k in keys
        ),
        "restored_steps": restored.steps,
    }
    record("megatron_moe", figures)
    assert figures["loss_rel_diff"] < 0.01, figures
    assert figures["logprob_abs_diff_mean"] < 0.05, figures
    assert figures["update_cosine"] > 0.95, figures
    assert figures["restored_weight_abs_diff_max"] == 0.0 and restored.steps == 1, figures
