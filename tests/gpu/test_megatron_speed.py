"""The megatron engine's speed switches (`MegatronSpeed`, all on by default) against the engine with
every switch off, same random Qwen3 (0.6 B shape, bf16): target logprobs and loss of
forward_backward, weights after one optim_step, and each SDPA backend's logprobs.

Device only (`pytest -m gpu tests/gpu/test_megatron_speed.py`). Figures → $OUT/megatron_speed.json.
"""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("megatron.core")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_figures import ADAM, batch, logprob_gaps, model_dir, record  # noqa: E402

from oneloop.backends.megatron_local.engines.base import LoraSpec  # noqa: E402
from oneloop.backends.megatron_local.engines.megatron.speed import MegatronSpeed  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

FIGURES: dict = {}
# The switches are the local spec's (the TE spec: test_megatron_engine).
LOCAL = MegatronSpeed(layer_spec="local")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("model"))


def engine(path, speed: MegatronSpeed, budget: int = 2048):
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronTrainerEngine

    return MegatronTrainerEngine(
        path, LoraSpec(0), dtype="bfloat16", device="cuda", max_tokens_per_microbatch=budget,
        speed=speed,
    )  # fmt: skip


def test_switches_on_match_switches_off(path) -> None:
    off, on = engine(path, MegatronSpeed.off()), engine(path, LOCAL, budget=4096)
    norm_dtypes = {p.dtype for n, p in on.module.named_parameters() if "layernorm" in n}
    assert norm_dtypes == {torch.bfloat16}
    inner = on.optimizer.chained_optimizers if hasattr(on.optimizer, "chained_optimizers") else [
        on.optimizer
    ]  # fmt: skip
    torch_adam = [o.optimizer for o in inner if isinstance(o.optimizer, torch.optim.Adam)]
    assert all(g["fused"] for o in torch_adam for g in o.param_groups)  # TE's FusedAdam: fused
    before = {k: v.float().clone() for k, v in on.hf_weights().items()}
    for loss in ("cross_entropy", "importance_sampling"):
        data = batch(1, loss)
        a = off.forward_backward(data, loss, None, forward_only=False)
        b = on.forward_backward(data, loss, None, forward_only=False)
        gap = logprob_gaps(a, b)
        tokens = sum(len(d.tokens) for d in data)
        FIGURES[loss] = {
            "loss_off": a.loss,
            "loss_on": b.loss,
            "loss_abs_diff_per_token": abs(a.loss - b.loss) / tokens,
            "logprob_abs_diff_mean": float(gap.mean()),
            "logprob_abs_diff_max": float(gap.max()),
        }
        assert FIGURES[loss]["loss_abs_diff_per_token"] < 0.01
        assert FIGURES[loss]["logprob_abs_diff_mean"] < 0.02
    step_off, step_on = off.optim_step(ADAM), on.optim_step(ADAM)
    after_off = {k: v.float() for k, v in off.hf_weights().items()}
    after_on = {k: v.float() for k, v in on.hf_weights().items()}
    diffs = torch.cat([(after_on[k] - after_off[k]).abs().flatten() for k in after_off])
    upd_off = torch.cat([(after_off[k] - before[k]).flatten() for k in after_off])
    upd_on = torch.cat([(after_on[k] - before[k]).flatten() for k in after_off])
    FIGURES["optim_step"] = {
        "grad_norm_off": step_off["grad_norm:mean"],
        "grad_norm_on": step_on["grad_norm:mean"],
        "weight_abs_diff_max": float(diffs.max()),
        "weight_abs_diff_mean": float(diffs.mean()),
        "update_cosine": float(torch.nn.functional.cosine_similarity(upd_on, upd_off, dim=0)),
    }
    forward = batch(2, "cross_entropy")
    a = off.forward_backward(forward, "cross_entropy", None, forward_only=True)
    b = on.forward_backward(forward, "cross_entropy", None, forward_only=True)
    FIGURES["forward_only_after_step"] = {"logprob_abs_diff_mean": float(logprob_gaps(a, b).mean())}
    record("megatron_speed", FIGURES)
    assert FIGURES["optim_step"]["update_cosine"] > 0.9
    assert FIGURES["optim_step"]["weight_abs_diff_mean"] < ADAM["learning_rate"]
    assert abs(step_on["grad_norm:mean"] - step_off["grad_norm:mean"]) < 0.05 * step_off[
        "grad_norm:mean"
    ]  # fmt: skip
    assert FIGURES["forward_only_after_step"]["logprob_abs_diff_mean"] < 0.02


def test_fused_rope_matches_megatron_rope(path) -> None:
    data = batch(4, "cross_entropy")
    ref = engine(path, replace(LOCAL, fused_rope=False)).forward_backward(
        data, "cross_entropy", None, True
    )  # megatron-core's RoPE (LOCAL's fused_rope "auto" is on for this Qwen3)
    torch.cuda.empty_cache()
    got = engine(path, replace(LOCAL, fused_rope=True)).forward_backward(
        data, "cross_entropy", None, forward_only=False
    )
    gap = logprob_gaps(ref, got)
    FIGURES["fused_rope"] = {"logprob_abs_diff_mean": float(gap.mean()), "max": float(gap.max())}
    record("megatron_speed", FIGURES)
    assert gap.mean() < 0.02


def test_triton_logprobs_match_inductor(path) -> None:
    """`triton_logprobs` (opt-in): the same logprobs, loss and gradient as the Inductor kernels
    (the logits are the same bf16 GEMM; both reduce in fp32)."""
    data = batch(4, "cross_entropy")
    results = []
    for speed in (LOCAL, replace(LOCAL, triton_logprobs=True)):
        chosen = engine(path, speed)
        out = chosen.forward_backward(data, "cross_entropy", None, forward_only=False)
        results.append((out, chosen.optim_step(ADAM)["grad_norm:mean"]))
        del chosen
        torch.cuda.empty_cache()
    (ref, norm_ref), (got, norm_got) = results
    gap = logprob_gaps(ref, got)
    FIGURES["triton_logprobs"] = {
        "logprob_abs_diff_max": float(gap.max()),
        "loss": [ref.loss, got.loss],
        "grad_norm": [norm_ref, norm_got],
    }
    record("megatron_speed", FIGURES)
    assert gap.max() < 1e-4
    assert abs(ref.loss - got.loss) <= 1e-4 * abs(ref.loss)
    assert abs(norm_ref - norm_got) <= 1e-2 * norm_ref


@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
def test_attention_backends_match_auto(path, backend: str) -> None:
    data = batch(3, "cross_entropy")
    auto = engine(path, replace(LOCAL, attention_backend="auto"))
    ref = auto.forward_backward(data, "cross_entropy", None, forward_only=True)
    del auto
    torch.cuda.empty_cache()
    chosen = engine(path, replace(LOCAL, attention_backend=backend))
    try:
        got = chosen.forward_backward(data, "cross_entropy", None, forward_only=False)
    except RuntimeError as exc:
        if "kernel" in str(exc).lower():  # this torch build refuses the backend for these inputs
            pytest.skip(f"{backend}: {exc}")
        raise
    gap = logprob_gaps(ref, got)
    FIGURES[f"attention_{backend}"] = {"logprob_abs_diff_mean": float(gap.mean())}
    record("megatron_speed", FIGURES)
    assert gap.mean() < 0.02
