"""The `megatron` trainer engine on a real-width Gated DeltaNet hybrid against the `torch` engine,
one GPU: the 4-layer Qwen3.6-35B-A3B-width random model (`build_random_qwen3.py --shape
35b-a3b-4l`: 3 Gated DeltaNet layers, 1 gated attention layer, 256 experts top-8 and a shared
expert), megatron-core's GatedDeltaNet (flash-linear-attention kernels), gated attention and MoE
layers built by `megatron.hybrid`. Both engines run fp32: on random GDN weights transformers
disagrees with itself by 0.16 mean between fp32 and bf16 (../shared/device/README.md), so bf16
figures would measure the init, not the engine. forward_backward loss and target logprobs, the
grad norm and the update of one optim_step are compared.

Device only (`pytest -m gpu tests/gpu/test_megatron_hybrid.py`; gpu_run.sh stage
`megatron_hybrid`, which carries flash-linear-attention and einops in `.wfla`). Not yet run on the
device. Figures → $OUT/megatron_hybrid.json.
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

from gpu_figures import ADAM, batch, logprob_gaps, record  # noqa: E402  (puts the runbook on the path)
from build_random_qwen3 import build  # noqa: E402, I001

from oneloop.backends.megatron_local.engines.base import LoraSpec  # noqa: E402
from oneloop.backends.megatron_local.engines.hf import fuse_experts  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    given = os.environ.get("ONELOOP_GPU_HYBRID_DIR")
    return Path(given) if given else build("35b-a3b-4l", tmp_path_factory.mktemp("hybrid"))


def _host(weights: dict) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).float().cpu() for k, v in fuse_experts(weights).items()}


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
    before = _host(before)
    data = batch(1, "cross_entropy")
    ref = TorchTrainerEngine(path, LoraSpec(0), dtype="float32", device="cuda")
    b = ref.forward_backward(data, "cross_entropy", None, forward_only=False)
    step_t = ref.optim_step(ADAM)
    after_t = _host(ref.sampler_weights())
    del ref
    _free()
    mega = MegatronTrainerEngine(path, LoraSpec(0), dtype="float32", device="cuda")
    kinds = {type(m).__name__ for m in mega.module.modules()}
    assert {"GatedDeltaNet", "GroupedExperts", "ZeroCenteredRMSNorm"} <= kinds, kinds
    a = mega.forward_backward(data, "cross_entropy", None, forward_only=False)
    step_m = mega.optim_step(ADAM)
    after_m = _host(mega.hf_weights())
    del mega
    _free()
    gaps = logprob_gaps(a, b)
    keys = sorted(after_t)
    assert sorted(after_m) == keys
    dot = norm_m = norm_t = 0.0  # the update's cosine, key by key, on the host
    for k in keys:
        upd_m, upd_t = (after_m[k] - before[k]).double(), (after_t[k] - before[k]).double()
        dot += float((upd_m * upd_t).sum())
        norm_m += float((upd_m * upd_m).sum())
        norm_t += float((upd_t * upd_t).sum())
    figures = {
        "loss_megatron": a.loss,
        "loss_torch": b.loss,
        "loss_rel_diff": abs(a.loss - b.loss) / abs(b.loss),
        "logprob_abs_diff_mean": float(gaps.mean()),
        "logprob_abs_diff_max": float(gaps.max()),
        "grad_norm_megatron": step_m["grad_norm:mean"],
        "grad_norm_torch": step_t["grad_norm:mean"],
        "update_cosine": dot / (norm_m * norm_t) ** 0.5,
    }
    record("megatron_hybrid", figures)
    assert figures["loss_rel_diff"] < 0.01, figures
    assert figures["logprob_abs_diff_mean"] < 0.05, figures
    assert figures["update_cosine"] > 0.95, figures
