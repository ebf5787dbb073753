"""The `megatron` trainer engine against the `torch` engine on one GPU, same random Qwen3 (0.6 B
shape, bf16): forward_backward loss and target logprobs, and weights after one optim_step; the same
for LoRA (same adapter init in both; adapter after one step; merged sampler weights), and
save/load of both kinds of run.

Each check runs on both forms of a one-rank megatron trainer (`KINDS`): the one-process engine
(`MegatronTrainerEngine` in the test process, what the product builds at one rank) and the
Ray-placed group at dp = tp = pp = 1 (`MegatronRayGroup`: one rank actor in a placement group,
sharing the GPU; issue 18: the megatron engine tests pass on it with the same figures).

Device only (`pytest -m gpu tests/gpu/test_megatron_engine.py`). Figures → $OUT/megatron_parity.json
and $OUT/megatron_lora_parity.json (one process), $OUT/megatron_parity_ray_group.json and
$OUT/megatron_lora_parity_ray_group.json (the group).
"""

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_figures import ADAM, batch, layer_specs, logprob_gaps, model_dir, record  # noqa: E402

from oneloop.backends.megatron_local.engines.base import LoraSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

# The one-process engine, and the Ray-placed group of one rank (dp = tp = pp = 1).
KINDS = ("one_process", "ray_group")


def figures_name(base: str, kind: str) -> str:
    """The figures file of `kind`: the one-process names as before, the group's suffixed."""
    return base if kind == "one_process" else f"{base}_{kind}"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def ray_gpu():
    """A local Ray cluster with this machine's GPU, for the group's rank actor (one GPU); yields
    the groups built on it (`ray_group`)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_gpus=1, include_dashboard=False)
    groups: list = []
    yield groups
    for group in groups:
        group.close()
    if started:
        ray.shutdown()


def ray_group(groups: list, path, lora: LoraSpec, **kwargs):
    """The megatron trainer as a Ray-placed group of one rank, on `ray_gpu`'s cluster. The groups
    built before are closed first: each holds the one GPU, and a module-scoped fixture's last
    group lives until the module ends (the LoRA group waited for its GPU forever, on the H200)."""
    from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel

    while groups:
        groups.pop().close()
    group = MegatronRayGroup(
        path, lora, dtype="bfloat16", device="cuda", parallel=MegatronParallel(), **kwargs
    )
    groups.append(group)
    assert group.world == 1
    return group


def megatron_engine(path, spec: str, groups: list | None = None):
    """The one-process engine, or with `groups` (`ray_gpu`) the Ray-placed group of one rank."""
    from oneloop.backends.megatron_local.engines.megatron.speed import MegatronSpeed
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronTrainerEngine

    speed = MegatronSpeed(layer_spec=spec)
    if groups is not None:
        import ray

        group = ray_group(groups, path, LoraSpec(0), speed=speed)
        te = ray.get(group._actors[0].attribute.remote("te"), timeout=60)
        assert te is (spec == "te"), te
        return group
    engine = MegatronTrainerEngine(path, LoraSpec(0), dtype="bfloat16", device="cuda", speed=speed)
    te_modules = {type(m).__name__ for m in engine.module.modules() if type(m).__name__[:2] == "TE"}
    assert engine.te is (spec == "te") and bool(te_modules) is (spec == "te"), te_modules
    return engine


@pytest.fixture(
    scope="module",
    params=[(spec, kind) for spec in layer_specs() for kind in KINDS],
    ids=lambda param: "-".join(param),
)
def engines(request, path):
    from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine

    spec, kind = request.param
    groups = request.getfixturevalue("ray_gpu") if kind == "ray_group" else None
    ref = TorchTrainerEngine(path, LoraSpec(0), dtype="bfloat16", device="cuda")
    return megatron_engine(path, spec, groups), ref, spec, kind


def test_megatron_matches_torch_engine(engines) -> None:
    mega, ref, spec, kind = engines
    # on the GPU, like the torch engine's weights (the group returns host tensors)
    before = {k: v.float().to("cuda").clone() for k, v in mega.hf_weights().items()}
    figures: dict = {}
    for loss in ("cross_entropy", "importance_sampling"):
        data = batch(1, loss)
        a = mega.forward_backward(data, loss, None, forward_only=False)
        b = ref.forward_backward(data, loss, None, forward_only=False)
        gaps = logprob_gaps(a, b)
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
    after_m = {k: v.float().to("cuda") for k, v in mega.hf_weights().items()}
    after_t = {k: v.float() for k, v in ref.model.state_dict().items() if k in after_m}
    diffs = torch.cat([(after_m[k] - after_t[k]).abs().flatten() for k in after_t])
    upd_m = torch.cat([(after_m[k] - before[k]).flatten() for k in after_t])
    upd_t = torch.cat([(after_t[k] - before[k]).flatten() for k in after_t])
    cosine = float(torch.nn.functional.cosine_similarity(upd_m.double(), upd_t.double(), dim=0))
    figures["optim_step"] = {
        "grad_norm_megatron": step_m["grad_norm:mean"],
        "grad_norm_torch": step_t["grad_norm:mean"],
        "weight_abs_diff_max": float(diffs.max()),
        "weight_abs_diff_mean": float(diffs.mean()),
        "update_cosine": cosine,
        "update_abs_mean_megatron": float(upd_m.abs().mean()),
    }
    base = "megatron_parity" if spec == "local" else f"megatron_parity_{spec}"
    record(figures_name(base, kind), figures)
    # One AdamW step moves each weight by about lr; bf16 rounding of the two paths differs by ulps.
    assert cosine > 0.9
    assert figures["optim_step"]["weight_abs_diff_mean"] < ADAM["learning_rate"]
    assert (
        abs(step_m["grad_norm:mean"] - step_t["grad_norm:mean"]) / step_t["grad_norm:mean"] < 0.05
    )


def test_save_and_load_state_restores_weights_and_optimizer(engines, tmp_path) -> None:
    mega = engines[0]
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


@pytest.mark.skipif("te" not in layer_specs(), reason="needs TransformerEngine")
def test_a_te_spec_checkpoint_loads_on_the_local_spec(path, tmp_path) -> None:
    """Checkpoints hold HF-named weights whichever spec wrote them: a TE run's weights load on the
    local spec and give the same logprobs (bf16 tolerance); its optimizer state is refused there,
    named, before anything changes."""
    te = megatron_engine(path, "te")
    te.forward_backward(batch(3, "cross_entropy"), "cross_entropy", None, forward_only=False)
    te.optim_step(ADAM)
    te.save_state(tmp_path / "ckpt", with_optimizer=True)
    data = batch(2, "cross_entropy")
    te_out = te.forward_backward(data, "cross_entropy", None, forward_only=True)
    del te
    local = megatron_engine(path, "local")
    fresh = local.forward_backward(data, "cross_entropy", None, forward_only=True)
    with pytest.raises(ValueError, match="saved on the 'te' layer spec, this trainer builds"):
        local.load_state(tmp_path / "ckpt", with_optimizer=True)
    unchanged = local.forward_backward(data, "cross_entropy", None, forward_only=True)
    assert unchanged.loss == fresh.loss
    local.load_state(tmp_path / "ckpt", with_optimizer=False)
    local_out = local.forward_backward(data, "cross_entropy", None, forward_only=True)
    tokens = sum(len(d.tokens) for d in data)
    gaps = logprob_gaps(te_out, local_out)
    moved = logprob_gaps(te_out, fresh)  # the trained step's own effect, for scale
    record("megatron_te_checkpoint_on_local", {
        "loss_te": te_out.loss, "loss_local": local_out.loss,
        "loss_abs_diff_per_token": abs(te_out.loss - local_out.loss) / tokens,
        "logprob_abs_diff_mean": float(gaps.mean()), "logprob_abs_diff_max": float(gaps.max()),
        "untrained_logprob_abs_diff_mean": float(moved.mean()),
    })  # fmt: skip
    assert abs(te_out.loss - local_out.loss) / tokens < 0.01
    assert float(gaps.mean()) < 0.02
    # The loaded weights are the trained ones: measured 0.0063 vs the step's own 0.111 (H200).
    assert float(gaps.mean()) < float(moved.mean()) / 4
    assert local.steps == 1


# -- LoRA ------------------------------------------------------------------------------------------

LORA = LoraSpec(16, seed=3)
# A usual LoRA learning rate; one step moves this model's logprobs by ~0.9 (mean; torch engine,
# fp32, CPU).
LORA_ADAM = {**ADAM, "learning_rate": 1e-3}


def _flat(adapter, names) -> torch.Tensor:
    return torch.cat([torch.from_numpy(adapter.tensors[k]).flatten() for k in names])


@pytest.fixture(scope="module", params=KINDS)
def lora_engines(request, tmp_path_factory):
    """Megatron and torch LoRA engines on the same random Qwen3 with the same adapter: the torch
    engine's A (B = 0 in both) enters the megatron engine through its LoRA checkpoint path."""
    from oneloop.backends.megatron_local.engines.megatron.trainer import (
        ENGINE_STATE_FILE,
        MegatronTrainerEngine,
    )
    from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine

    kind = request.param
    path = model_dir(tmp_path_factory.mktemp("lora-model"))
    ref = TorchTrainerEngine(path, LORA, dtype="bfloat16", device="cuda")
    if kind == "ray_group":
        mega = ray_group(request.getfixturevalue("ray_gpu"), path, LORA)
    else:
        mega = MegatronTrainerEngine(path, LORA, dtype="bfloat16", device="cuda")
    start = ref.adapter().write_peft(tmp_path_factory.mktemp("lora-start"), str(path))
    (start / ENGINE_STATE_FILE).write_text('{"steps": 0}')
    mega.load_state(start, with_optimizer=False)
    return mega, ref, path, kind


def test_megatron_lora_matches_torch_lora(lora_engines) -> None:
    from oneloop.backends.megatron_local.engines.hf import (
        load_causal_lm,
        token_logprobs,
        untie_embeddings,
    )

    mega, ref, path, kind = lora_engines
    start = ref.adapter()
    names = sorted(start.tensors)
    assert mega.adapter().target_modules == start.target_modules
    assert sorted(mega.adapter().tensors) == names
    assert torch.equal(_flat(mega.adapter(), names), _flat(start, names))
    figures: dict = {}
    first: dict = {}
    for loss in ("cross_entropy", "importance_sampling"):
        data = batch(1, loss)
        a = mega.forward_backward(data, loss, None, forward_only=False)
        b = ref.forward_backward(data, loss, None, forward_only=False)
        first[loss], gaps = a, logprob_gaps(a, b)
        figures[loss] = {
            "loss_megatron": a.loss,
            "loss_torch": b.loss,
            "loss_abs_diff_per_token": abs(a.loss - b.loss) / sum(len(d.tokens) for d in data),
            "logprob_abs_diff_mean": float(gaps.mean()),
            "logprob_abs_diff_max": float(gaps.max()),
        }
        assert figures[loss]["loss_abs_diff_per_token"] < 0.01
        assert figures[loss]["logprob_abs_diff_mean"] < 0.02
    step_m, step_t = mega.optim_step(LORA_ADAM), ref.optim_step(LORA_ADAM)
    after_m, after_t = _flat(mega.adapter(), names), _flat(ref.adapter(), names)
    upd_m, upd_t = after_m - _flat(start, names), after_t - _flat(start, names)
    lr = LORA_ADAM["learning_rate"]
    figures["optim_step"] = {
        "grad_norm_megatron": step_m["grad_norm:mean"],
        "grad_norm_torch": step_t["grad_norm:mean"],
        "adapter_abs_diff_max": float((after_m - after_t).abs().max()),
        "adapter_abs_diff_mean": float((after_m - after_t).abs().mean()),
        "update_cosine": float(
            torch.nn.functional.cosine_similarity(upd_m.double(), upd_t.double(), dim=0)
        ),
        "update_abs_mean_megatron": float(upd_m.abs().mean()),
    }
    # With the adapters active (B != 0): each engine's own stepped adapter, same tokens.
    data = batch(1, "cross_entropy")
    a = mega.forward_backward(data, "cross_entropy", None, forward_only=True)
    b = ref.forward_backward(data, "cross_entropy", None, forward_only=True)
    gaps, shift = logprob_gaps(a, b), logprob_gaps(a, first["cross_entropy"])
    # The merged sampler weights, loaded into the HF model, score like the engine itself.
    hf = untie_embeddings(load_causal_lm(path, "bfloat16")).to("cuda").eval()
    merged = {k: torch.from_numpy(v) for k, v in mega.sampler_weights().items()}
    hf.load_state_dict(merged, strict=True)
    tokens = torch.as_tensor(data[0].tokens, device="cuda")[None]
    targets = torch.as_tensor(data[0].targets, device="cuda")[None]
    with torch.no_grad():
        hf_lp = token_logprobs(hf(input_ids=tokens).logits, targets)[0].float().cpu().numpy()
    merged_gap = np.abs(hf_lp - a.logprobs[0])
    figures["after_step"] = {
        "logprob_abs_diff_mean": float(gaps.mean()),
        "logprob_abs_diff_max": float(gaps.max()),
        "logprob_shift_mean": float(shift.mean()),
        "merged_hf_logprob_abs_diff_mean": float(merged_gap.mean()),
        "merged_hf_logprob_abs_diff_max": float(merged_gap.max()),
    }
    record(figures_name("megatron_lora_parity", kind), figures)
    step = figures["optim_step"]
    assert (
        abs(step["grad_norm_megatron"] - step["grad_norm_torch"]) < 0.05 * step["grad_norm_torch"]
    )
    # Adam's first step moves each entry by ~lr·sign(grad): a sign flip on a tiny gradient costs
    # 2·lr on that entry, so compare the mean and the direction.
    assert step["update_cosine"] > 0.9
    assert step["adapter_abs_diff_mean"] < 0.5 * lr
    assert figures["after_step"]["logprob_abs_diff_mean"] < 0.02
    # A misplaced delta (wrong fused rows) would make the gap comparable to the shift itself.
    assert (
        figures["after_step"]["logprob_abs_diff_mean"]
        < 0.2 * figures["after_step"]["logprob_shift_mean"]
    )
    # The HF model holds W + ΔW rounded to bf16 once more than the engine's W·x + ΔW·x path.
    assert figures["after_step"]["merged_hf_logprob_abs_diff_mean"] < 0.03


def test_lora_save_and_load_state_restores_adapter_and_optimizer(lora_engines, tmp_path) -> None:
    mega = lora_engines[0]
    data = batch(2, "cross_entropy")
    mega.forward_backward(batch(3, "cross_entropy"), "cross_entropy", None, forward_only=False)
    mega.optim_step(LORA_ADAM)  # the checkpoint then carries Adam moments
    mega.save_state(tmp_path / "ckpt", with_optimizer=True)
    # A LoRA checkpoint is a PEFT adapter directory (plus optimizer and engine state), no base.
    assert (tmp_path / "ckpt" / "adapter_config.json").is_file()
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()
    saved = mega.adapter()
    expected = mega.forward_backward(data, "cross_entropy", None, forward_only=False)
    mega.optim_step(LORA_ADAM)
    after_one = mega.forward_backward(data, "cross_entropy", None, forward_only=True).loss
    mega.load_state(tmp_path / "ckpt", with_optimizer=True)
    restored = mega.adapter()
    assert all(np.array_equal(restored.tensors[k], v) for k, v in saved.tensors.items())
    again = mega.forward_backward(data, "cross_entropy", None, forward_only=False)
    assert again.loss == pytest.approx(expected.loss, rel=1e-6)
    mega.optim_step(LORA_ADAM)
    assert mega.forward_backward(data, "cross_entropy", None, forward_only=True).loss == (
        pytest.approx(after_one, rel=1e-4)
    )
