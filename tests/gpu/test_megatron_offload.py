"""`local.megatron.optimizer_cpu_offload` on one GPU: the `megatron` engine with and without the
optimizer offloaded, same random Qwen3 (0.6 B shape, bf16), two optim_steps with different
AdamParams: same loss and grad norm, same weights within bf16 tolerance, the optimizer's state
(fp32 main params, moments) on the CPU and less GPU memory allocated after the step; save/load
round trip with offload, and a checkpoint written without offload resumed with it.

Regression: the flag reached megatron-core, whose offload fraction defaults to 0.0, so nothing
was offloaded (`megatron.offload`). Device only
(`pytest -m gpu tests/gpu/test_megatron_offload.py`); figures → $OUT/megatron_offload.json.
"""

import gc
import time

import pytest
import torch

pytest.importorskip("megatron.core")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_figures import ADAM, batch, model_dir, record  # noqa: E402

from oneloop.backends.megatron_local.engines.base import LoraSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]

ADAM_2 = dict(  # every field differs from ADAM's: each must reach the CPU AdamW
    learning_rate=3e-4, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5
)


def _engine(path, offload: bool):
    from oneloop.backends.megatron_local.engines.megatron.trainer import (
        MegatronParallel,
        MegatronTrainerEngine,
    )

    parallel = MegatronParallel(optimizer_cpu_offload=offload)
    return MegatronTrainerEngine(
        path, LoraSpec(0), dtype="bfloat16", device="cuda", parallel=parallel
    )


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in engine.hf_weights().items()}


def _two_steps(engine, baseline: int) -> dict:
    """Loss, grad norm and step seconds of two steps; GPU memory the engine holds after them
    (allocated minus `baseline`, what was allocated before the engine was built)."""
    out: dict = {"loss": [], "grad_norm": [], "optim_step_s": []}
    for seed, adam in ((1, ADAM), (2, ADAM_2)):
        data = batch(seed, "cross_entropy")
        out["loss"].append(engine.forward_backward(data, "cross_entropy", None, False).loss)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out["grad_norm"].append(engine.optim_step(adam)["grad_norm:mean"])
        torch.cuda.synchronize()
        out["optim_step_s"].append(time.perf_counter() - start)
    out["gpu_allocated_bytes"] = torch.cuda.memory_allocated() - baseline
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The plain engine's two steps (then freed), the offloaded engine's two steps (kept)."""
    path = model_dir(tmp_path_factory.mktemp("model"))
    ckpt = tmp_path_factory.mktemp("plain-ckpt")
    baseline = torch.cuda.memory_allocated()
    plain = _engine(path, offload=False)
    before = _weights(plain)
    plain_run = _two_steps(plain, baseline)
    plain_run["weights"] = _weights(plain)
    plain.save_state(ckpt, with_optimizer=True)
    plain_run["numel"] = sum(p.numel() for p in plain.module.parameters())
    del plain
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    offload = _engine(path, offload=True)
    off_run = _two_steps(offload, baseline)
    off_run["weights"] = _weights(offload)
    return {"before": before, "plain": plain_run, "offload": off_run, "engine": offload,
            "plain_ckpt": ckpt}  # fmt: skip


def test_offload_matches_plain_and_frees_gpu_memory(runs) -> None:
    from oneloop.backends.megatron_local.engines.megatron import offload as megatron_offload

    before, plain, off = runs["before"], runs["plain"], runs["offload"]
    dot = norm_p = norm_o = 0.0
    diffs = []
    for name, start in before.items():
        a = (plain["weights"][name].cuda().double(), off["weights"][name].cuda().double())
        upd_p, upd_o = a[0] - start.cuda().double(), a[1] - start.cuda().double()
        dot += float((upd_p * upd_o).sum())
        norm_p += float((upd_p * upd_p).sum())
        norm_o += float((upd_o * upd_o).sum())
        diffs.append((a[0] - a[1]).abs().float())
    diff = torch.cat([d.flatten() for d in diffs])
    cosine = dot / (norm_p**0.5 * norm_o**0.5)
    tensors = megatron_offload.state_tensors(runs["engine"].optimizer)
    devices = sorted({t.device.type for t in tensors.values()})
    kinds = sorted({key.split(".", 2)[2] for key in tensors})
    saved = plain["gpu_allocated_bytes"] - off["gpu_allocated_bytes"]
    figures = {
        "loss_plain": plain["loss"],
        "loss_offload": off["loss"],
        "grad_norm_plain": plain["grad_norm"],
        "grad_norm_offload": off["grad_norm"],
        "optim_step_s_plain": plain["optim_step_s"],
        "optim_step_s_offload": off["optim_step_s"],
        "update_cosine_2_steps": cosine,
        "weight_abs_diff_max": float(diff.max()),
        "weight_abs_diff_mean": float(diff.mean()),
        "gpu_allocated_bytes_plain": plain["gpu_allocated_bytes"],
        "gpu_allocated_bytes_offload": off["gpu_allocated_bytes"],
        "gpu_bytes_saved_per_param": saved / plain["numel"],
        "offloaded_state_tensors": len(tensors),
        "offloaded_state_devices": devices,
        "offloaded_state_kinds": kinds,
    }
    record("megatron_offload", figures)
    assert off["loss"][0] == pytest.approx(plain["loss"][0], rel=1e-6)  # same weights, same batch
    assert off["loss"][1] == pytest.approx(plain["loss"][1], rel=1e-3)
    for p, o in zip(plain["grad_norm"], off["grad_norm"], strict=True):
        assert o == pytest.approx(p, rel=0.02)
    assert cosine > 0.99
    assert figures["weight_abs_diff_mean"] < ADAM_2["learning_rate"]
    assert devices == ["cpu"] and {"main_param", "exp_avg", "exp_avg_sq"} <= set(kinds)
    assert all(h.gpu_optimizer is None for h in megatron_offload.hybrid_optimizers(
        runs["engine"].optimizer))  # fmt: skip
    # Without offload the GPU holds fp32 main params and two fp32 moments (12 bytes a parameter).
    assert figures["gpu_bytes_saved_per_param"] > 8.0


def test_offload_save_load_round_trip(runs, tmp_path) -> None:
    engine = runs["engine"]
    data = batch(3, "cross_entropy")
    engine.save_state(tmp_path / "ckpt", with_optimizer=True)
    expected = engine.forward_backward(data, "cross_entropy", None, forward_only=False)
    engine.optim_step(ADAM)
    after_one = engine.forward_backward(data, "cross_entropy", None, forward_only=True).loss
    engine.load_state(tmp_path / "ckpt", with_optimizer=True)
    again = engine.forward_backward(data, "cross_entropy", None, forward_only=False)
    assert again.loss == pytest.approx(expected.loss, rel=1e-6)
    engine.optim_step(ADAM)
    assert engine.forward_backward(data, "cross_entropy", None, forward_only=True).loss == (
        pytest.approx(after_one, rel=1e-4)
    )


def test_checkpoint_without_offload_resumes_with_offload(runs) -> None:
    """The optimizer state has one layout with and without offload (megatron_offload)."""
    from oneloop.backends.megatron_local.engines.megatron import offload as megatron_offload
    from oneloop.backends.megatron_local.engines.megatron.trainer import OPTIMIZER_FILE

    engine = runs["engine"]
    engine.load_state(runs["plain_ckpt"], with_optimizer=True)
    loaded = _weights(engine)
    assert all(torch.equal(loaded[k], v) for k, v in runs["plain"]["weights"].items())
    tensors = megatron_offload.state_tensors(engine.optimizer)
    assert {t.device.type for t in tensors.values()} == {"cpu"}
    saved = torch.load(runs["plain_ckpt"] / OPTIMIZER_FILE, weights_only=False)
    for c, part in enumerate(saved):
        for i, main in enumerate(part["main_params"]):
            assert torch.equal(tensors[f"{c}.{i}.main_param"], main.cpu())
        for i, state in part["optimizer"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(tensors[f"{c}.{i}.{key}"], state[key].cpu())
    # The plain run's two steps, whichever Adam wrote them (TE's FusedAdam counts per group).
    assert {float(t) for key, t in tensors.items() if key.endswith(".step")} == {2.0}
    data = batch(3, "cross_entropy")
    engine.forward_backward(data, "cross_entropy", None, forward_only=False)
    assert engine.optim_step(ADAM)["grad_norm:mean"] > 0.0
