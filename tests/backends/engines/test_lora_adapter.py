"""LoRA adapter export of the `torch` trainer engine (`TrainerEngine.adapter`, `LoraAdapter`).

The adapter written with `LoraAdapter.write_peft` and loaded by peft onto the base Hugging Face
model must be the same model as the engine's merged `sampler_weights()`: that is what lets a sampler
that loads adapters (vLLM LoRA modules) stand in for one that loads merged weights.
"""

import numpy as np
import pytest
import torch

from oneloop.backends.megatron_local.engines.base import DatumArrays, LoraSpec
from oneloop.backends.megatron_local.engines.hf import load_causal_lm, untie_embeddings
from oneloop.backends.megatron_local.engines.microbatch import LORA_ALPHA
from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine

ADAM = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
ALL_TARGETS = (
    "down_proj",
    "gate_proj",
    "k_proj",
    "lm_head",
    "o_proj",
    "q_proj",
    "up_proj",
    "v_proj",
)


def _batch(seed: int, vocab: int) -> list[DatumArrays]:
    rng = np.random.default_rng(seed)
    data = []
    for n in (24, 17, 9):
        tokens = rng.integers(0, vocab, n + 1)
        data.append(DatumArrays(tokens[:-1], tokens[1:], {"weights": np.ones(n, np.float32)}))
    return data


def _trained(path, lora: LoraSpec) -> TorchTrainerEngine:
    """An engine after two AdamW steps, so every B is non-zero (B = 0 at init)."""
    engine = TorchTrainerEngine(path, lora, dtype="float32", threads=1)
    vocab = engine.model.config.vocab_size
    for seed in (0, 1):
        engine.forward_backward(_batch(seed, vocab), "cross_entropy", None, forward_only=False)
        engine.optim_step(ADAM)
    return engine


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_peft_loaded_adapter_matches_merged_sampler_weights(tiny_model_path, tmp_path) -> None:
    from peft import PeftModel

    engine = _trained(tiny_model_path, LoraSpec(4, seed=7))
    adapter = engine.adapter()
    assert (adapter.rank, adapter.alpha, adapter.target_modules) == (4, LORA_ALPHA, ALL_TARGETS)
    assert all(v.dtype == np.float32 for v in adapter.tensors.values())
    assert "base_model.model.lm_head.lora_B.weight" in adapter.tensors
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight" in adapter.tensors
    b_norms = [np.abs(v).max() for k, v in adapter.tensors.items() if ".lora_B." in k]
    assert len(b_norms) == 2 * 7 + 1 and min(b_norms) > 0.0

    directory = adapter.write_peft(tmp_path / "adapter", str(tiny_model_path))
    peft_model = PeftModel.from_pretrained(load_causal_lm(tiny_model_path, "float32"), directory)
    merged = untie_embeddings(load_causal_lm(tiny_model_path, "float32"))
    weights = {k: torch.from_numpy(v) for k, v in engine.sampler_weights().items()}
    merged.load_state_dict(weights, strict=True)
    base = load_causal_lm(tiny_model_path, "float32")

    tokens = torch.as_tensor(np.stack([d.tokens[:9] for d in _batch(5, base.config.vocab_size)]))
    via_peft = _logits(peft_model.eval(), tokens)
    torch.testing.assert_close(via_peft, _logits(merged.eval(), tokens), atol=1e-4, rtol=1e-4)
    assert (via_peft - _logits(base.eval(), tokens)).abs().max() > 1e-2  # the adapter acts


def test_adapter_holds_only_the_chosen_targets(tiny_model_path) -> None:
    engine = TorchTrainerEngine(
        tiny_model_path, LoraSpec(2, seed=1, train_mlp=False, train_unembed=False), threads=1
    )
    adapter = engine.adapter()
    assert adapter.target_modules == ("k_proj", "o_proj", "q_proj", "v_proj")
    assert len(adapter.tensors) == 2 * 4 * 2  # layers × targets × (A, B)
    assert all(".self_attn." in name for name in adapter.tensors)
    q_b = adapter.tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert q_b.shape[1] == 2 and not q_b.any()  # B = 0 at init: a new model equals its base


def test_full_fine_tuning_has_no_adapter(tiny_model_path) -> None:
    engine = TorchTrainerEngine(tiny_model_path, LoraSpec(0), threads=1)
    with pytest.raises(ValueError, match="rank 0"):
        engine.adapter()


def test_bfloat16_sampler_weights_are_exact_float32(tiny_model_path):
    """numpy has no bfloat16: a bf16 trainer hands its sampler float32 copies of the same values."""
    for rank in (0, 4):
        engine = TorchTrainerEngine(tiny_model_path, LoraSpec(rank, seed=0), dtype="bfloat16")
        weights = engine.sampler_weights()
        assert {w.dtype for w in weights.values()} == {np.dtype(np.float32)}
        for name, tensor in engine.model.get_base_model().state_dict().items() if rank else (
            engine.model.state_dict().items()
        ):
            if "lora_" in name or "base_layer" in name:
                continue
            assert np.array_equal(weights[name], tensor.float().numpy()), name
            assert torch.equal(torch.from_numpy(weights[name]).bfloat16(), tensor)
