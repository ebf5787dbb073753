"""HF ⇄ Megatron parameter mapping of the `megatron` trainer engine (pure torch; runs in CI), and
the RoPE it builds from a config: Llama 3's scaling read, any other scaling refused by name.

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
    rope_scaling_factor,
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


# Llama 3.2's RoPE scaling (its config.json)
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip


def test_rope_scaling_is_read_or_refused_naming_the_field() -> None:
    """Plain RoPE and Llama 3's scaling are built (the factor read from a config object or a
    config.json dict, transformers 5's rope_parameters or the older rope_scaling); any other
    scaling is refused by name (the engine would rotate with the wrong frequencies)."""
    from transformers import LlamaConfig

    assert rope_scaling_factor(Qwen3Config()) is None  # rope_type "default"
    assert rope_scaling_factor({"model_type": "qwen3", "rope_scaling": None}) is None
    assert rope_scaling_factor(LlamaConfig(rope_scaling=dict(LLAMA3))) == 32.0
    assert rope_scaling_factor({"rope_scaling": dict(LLAMA3)}) == 32.0
    mrope = {"rope_type": "default", "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    assert rope_scaling_factor({"rope_parameters": mrope}) is None  # Qwen3.5: text positions
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    other = {**LLAMA3, "original_max_position_embeddings": 4096}
    for field, params in (("rope_scaling", yarn), ("rope_parameters", other)):
        with pytest.raises(ValueError, match=rf"this config's {field} is .*trainer_engine=torch"):
            rope_scaling_factor({"model_type": "llama", field: params})
    assert DenseShape.from_hf(LlamaConfig(rope_scaling=dict(LLAMA3))).rope_scaling == 32.0


def test_rope_scaling_refusals_come_before_any_engine(tmp_path) -> None:
    """`load_config` with the megatron engine refuses a scaling it does not build, and
    `fused_rope` (unscaled frequencies) on a Llama 3 scaled model, naming the field."""
    import json

    from oneloop.errors import CapabilityError
    from oneloop.loop.config import load_config
    from oneloop.tiny.model import TINY_MODEL_NAME, build_tiny_model, named_tiny_specs

    source = json.loads((build_tiny_model(named_tiny_specs()[TINY_MODEL_NAME]) / "config.json")
                        .read_text())  # fmt: skip
    base = ["backend.local.trainer_engine=megatron"]
    for name, params in (("llama3", LLAMA3), ("yarn", {"rope_type": "yarn", "factor": 4.0})):
        (tmp_path / name).mkdir()
        config = {**source, "rope_parameters": {**source.get("rope_parameters", {}), **params}}
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    load_config("demo-cpu", [*base, f"model.base_model={tmp_path / 'llama3'}"])
    with pytest.raises(CapabilityError, match=r"rope_parameters is .*'yarn'.*trainer_engine=torch"):
        load_config("demo-cpu", [*base, f"model.base_model={tmp_path / 'yarn'}"])
    fused = "backend.local.megatron.speed.fused_rope=true"
    with pytest.raises(CapabilityError, match=r"fused_rope=true .*llama3, factor 32\.0"):
        load_config("demo-cpu", [*base, fused, f"model.base_model={tmp_path / 'llama3'}"])
