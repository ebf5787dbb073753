"""The `megatron` trainer engine against the `torch` engine on one GPU, same random Qwen3 (0.6 B
shape, bf16): forward_backward loss and target logprobs, and weights after one optim_step.

Device only (`pytest -m gpu tests/gpu/test_megatron_engine.py`). Figures → $OUT/megatron_parity.json.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_figures import model_dir, record  # noqa: E402

from oneloop.backends.megatron_local.engines.base import DatumArrays, LoraSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

ADAM = dict(
    learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0
)


def batch(seed: int, loss: str) -> list[DatumArrays]:
    rng = np.random.default_rng(seed)
    data = []
    for n in (512, 384, 300, 129, 512, 64, 200, 450):
        tokens = rng.integers(0, 151936, n + 1)
        inputs = {"weights": (rng.random(n) > 0.3).astype(np.float32)}
        if loss == "importance_sampling":
            inputs = {
                "logprobs": rng.normal(-11.0, 0.5, n).astype(np.float32),
                "advantages": rng.normal(0.0, 1.0, n).astype(np.float32),
            }
        data.append(DatumArrays(tokens[:-1], tokens[1:], inputs))
    return data


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from oneloop.backends.megatron_local.engines.megatron_trainer import MegatronTrainerEngine
    from oneloop.backends.megatron_local.engines.torch_trainer import TorchTrainerEngine

    path = model_dir(tmp_path_factory.mktemp("model"))
    mega = MegatronTrainerEngine(path, LoraSpec(0), dtype="bfloat16", device="cuda")
    ref = TorchTrainerEngine(path, LoraSpec(0), dtype="bfloat16", device="cuda")
    return mega, ref


def test_megatron_matches_torch_engine(engines) -> None:
    mega, ref = engines
    before = {k: v.float().clone() for k, v in mega.hf_weights().items()}
    figures: dict = {}
    for loss in ("cross_entropy", "importance_sampling"):
        data = batch(1, loss)
        a = mega.forward_backward(data, loss, None, forward_only=False)
        b = ref.forward_backward(data, loss, None, forward_only=False)
        gaps = np.concatenate([np.abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)])
        figures[loss] = {
            "loss_megatron": a.loss,
            "loss_torch": b.loss,
            "loss_rel_diff": abs(a.loss - b.loss) / abs(b.loss),
            # importance_sampling sums terms of both signs: compare per token, not relatively
            "loss_abs_diff_per_token": abs(a.loss - b.loss) / sum(len(d.tokens) for d in data),
            "logprob_abs_diff_mean": float(gaps.mean()),
            "logprob_abs_diff_max": float(gaps.max()),
        }
        assert figures[loss]["loss_abs_diff_per_token"] < 0.01
        assert figures[loss]["logprob_abs_diff_mean"] < 0.02
    step_m, step_t = mega.optim_step(ADAM), ref.optim_step(ADAM)
    after_m = {k: v.float() for k, v in mega.hf_weights().items()}
    after_t = {k: v.float() for k, v in ref.model.state_dict().items() if k in after_m}
    diffs = torch.cat([(after_m[k] - after_t[k]).abs().flatten() for k in after_t])
    upd_m = torch.cat([(after_m[k] - before[k]).flatten() for k in after_t])
    upd_t = torch.cat([(after_t[k] - before[k]).flatten() for k in after_t])
    cosine = float(torch.nn.functional.cosine_similarity(upd_m, upd_t, dim=0))
    figures["optim_step"] = {
        "grad_norm_megatron": step_m["grad_norm:mean"],
        "grad_norm_torch": step_t["grad_norm:mean"],
        "weight_abs_diff_max": float(diffs.max()),
        "weight_abs_diff_mean": float(diffs.mean()),
        "update_cosine": cosine,
        "update_abs_mean_megatron": float(upd_m.abs().mean()),
    }
    record("megatron_parity", figures)
    # One AdamW step moves each weight by about lr; bf16 rounding of the two paths differs by ulps.
    assert cosine > 0.9
    assert figures["optim_step"]["weight_abs_diff_mean"] < ADAM["learning_rate"]
    assert (
        abs(step_m["grad_norm:mean"] - step_t["grad_norm:mean"]) / step_t["grad_norm:mean"] < 0.05
    )


def test_save_and_load_state_restores_weights_and_optimizer(engines, tmp_path) -> None:
    mega, _ = engines
    data = batch(2, "cross_entropy")
    mega.forward_backward(batch(3, "cross_entropy"), "cross_entropy", None, forward_only=False)
    mega.optim_step(ADAM)  # the checkpoint then carries Adam moments and fp32 main params
    mega.save_state(tmp_path / "ckpt", with_optimizer=True)
    expected = mega.forward_backward(data, "cross_entropy", None, forward_only=False)
    mega.optim_step(ADAM)
    after_one = mega.forward_backward(data, "cross_entropy", None, forward_only=True).loss
    mega.load_state(tmp_path / "ckpt", with_optimizer=True)
    again = mega.forward_backward(data, "cross_entropy", None, forward_only=False)
    assert again.loss == pytest.approx(expected.loss, rel=1e-6)
    mega.optim_step(ADAM)
    assert mega.forward_backward(data, "cross_entropy", None, forward_only=True).loss == (
        pytest.approx(after_one, rel=1e-4)
    )
