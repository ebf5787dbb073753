"""HF ⇄ Megatron parameter mapping of the `megatron` trainer engine (pure torch; runs in CI).

The engine itself needs a GPU (Megatron's optimizer allocates on CUDA); its forward was checked
equal to transformers' to 0.0 in fp32 on CPU with this mapping, and `tests/gpu/` checks it on the
device.
"""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from oneloop.backends.megatron_local.engines.megatron.layout import (
    DenseShape,
    hf_to_megatron,
    megatron_param_names,
    megatron_to_hf,
)


def random_qwen3(
    tied: bool, heads: int = 4, kv_heads: int = 2
) -> tuple[DenseShape, dict[str, torch.Tensor]]:
    """A tiny random Qwen3's shape and HF state dict (no lm_head entry when tied)."""
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    return DenseShape.from_hf(config), state


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_is_exact(tied: bool) -> None:
    shape, hf = random_qwen3(tied)
    mega = hf_to_megatron(shape, hf)
    assert list(mega) == megatron_param_names(shape)
    back = megatron_to_hf(shape, mega)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    expected_head = hf["model.embed_tokens.weight"] if tied else hf["lm_head.weight"]
    assert torch.equal(back["lm_head.weight"], expected_head)


def test_qkv_is_grouped_per_kv_head() -> None:
    """Megatron's linear_qkv rows: per KV group, its query heads, then its key, then its value."""
    shape, hf = random_qwen3(tied=True)
    qkv = hf_to_megatron(shape, hf)["decoder.layers.1.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    d = shape.head_dim  # 8; 4 query heads in 2 groups of 2
    expected = torch.cat([q[0:16], k[0:8], v[0:8], q[16:32], k[8:16], v[8:16]])
    assert qkv.shape == ((shape.heads + 2 * shape.kv_heads) * d, shape.hidden)
    assert torch.equal(qkv, expected)
    fc1 = hf_to_megatron(shape, hf)["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate, up]))


def test_unsupported_family_is_refused_by_name() -> None:
    config = Qwen3Config()
    config.model_type = "gemma3"
    with pytest.raises(ValueError, match="model_type='gemma3'.*trainer_engine=torch"):
        DenseShape.from_hf(config)

