"""The `megatron` trainer engine on a real-width Gated DeltaNet hybrid against the `torch` engine,
one GPU: the 4-layer Qwen3.6-35B-A3B-width random model (`build_random_qwen3.py --shape
35b-a3b-4l`: 3 Gated DeltaNet layers, 1 gated attention layer, 256 experts top-8 and a shared
expert), megatron-core's GatedDeltaNet (flash-linear-attention kernels), gated attention and MoE
layers built by `megatron.hybrid`. Both engines run fp32: on random GDN weights transformers
disagrees with itself by 0.16 mean between fp32 and bf16 (../shared/device/README.md), so bf16
figures would measure the init, not the engine. forward_backward loss and target logprobs, the
grad norm and the update of one optim_step are compared.

Device only (`pytest -m gpu tests/gpu/test_megatron_hybrid.py`; gpu_run.sh stage
`megatron_hybrid`, which carries flash-linear-attention and einops in `.wfla`). Run on the H200
2026-12-03 (32-expert shape; figures in the README). Figures → $OUT/megatron_hybrid.json.
"""

import gc
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("fla")
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
    given = os.environ.get("ONELOOP_GPU_HYBRID_DIR")
    return Path(given) if given else build("35b-a3b-4l", tmp_path_factory.mktemp("hybrid"))


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def test_megatron_hybrid_matches_torch_engine(path) -> None:
    from safetensors.torch import load_file

    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronTrainerEngine
    from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine

    before: dict = {}
    for file in sorted(path.glob("*.safetensors")):
        before.update(load_file(str(file)))
    before = host_weights(before)
    data = batch(1, "cross_entropy")
    ref = TorchTrainerEngine(path, LoraSpec(0), dtype="float32", device="cuda")
    b = ref.forward_backward(data, "cross_entropy", None, forward_only=False)
    step_t = ref.optim_step(ADAM)
    after_t = host_weights(ref.sampler_weights())
    del ref
    _free()
    mega = MegatronTrainerEngine(path, LoraSpec(0), dtype="float32", device="cuda")
    kinds = {type(m).__name__ for m in mega.module.modules()}
    assert {"GatedDeltaNet", "GroupedExperts", "ZeroCenteredRMSNorm"} <= kinds, kinds
    a = mega.forward_backward(data, "cross_entropy", None, forward_only=False)
    step_m = mega.optim_step(ADAM)
    after_m = host_weights(mega.hf_weights())
    del mega
    _free()
    gaps = logprob_gaps(a, b)
    keys = sorted(after_t)
    assert sorted(after_m) == keys
    cosine = update_cosine(before, after_m, after_t)
    figures = {
        "loss_megatron": a.loss,
        "loss_torch": b.loss,
        "loss_rel_diff": abs(a.loss - b.loss) / abs(b.loss),
        "logprob_abs_diff_mean": float(gaps.mean()),
        "logprob_abs_diff_max": float(gaps.max()),
        "grad_norm_megatron": step_m["grad_norm:mean"],
        "grad_norm_torch": step_t["grad_norm:mean"],
        "update_cosine": cosine,
    }
    record("megatron_hybrid", figures)
    assert figures["loss_rel_diff"] < 0.01, figures
    assert figures["logprob_abs_diff_mean"] < 0.05, figures
    assert figures["update_cosine"] > 0.95, figures
