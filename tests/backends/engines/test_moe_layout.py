"""The HF ⇄ Megatron mapping of the MoE / hybrid families (`engines.megatron.moe`) round-trips
each family's tiny checkpoint exactly, fuses the layouts megatron-core reads, and shards experts
over expert-parallel ranks."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from oneloop.backends.megatron_local.engines.megatron.moe import (
    HybridShape,
    MoeSettings,
    expert_shard,
    hf_to_megatron,
    megatron_to_hf,
)
from oneloop.tiny.model import (
    TINY_QWEN3_5,
    TINY_QWEN3_5_MOE,
    TINY_QWEN3_MOE,
    build_tiny_model,
    named_tiny_specs,
)


def _checkpoint(name):
    path = build_tiny_model(named_tiny_specs()[name])
    shape = HybridShape.from_hf(AutoConfig.from_pretrained(path))
    return shape, load_file(path / "model.safetensors")


@pytest.mark.parametrize("name", [TINY_QWEN3_MOE, TINY_QWEN3_5_MOE, TINY_QWEN3_5])
def test_mapping_round_trips_each_family(name):
    shape, hf = _checkpoint(name)
    mega = hf_to_megatron(shape, hf)
    back = megatron_to_hf(shape, mega)
    if shape.tied:
        assert torch.equal(back.pop("lm_head.weight"), hf["model.embed_tokens.weight"])
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    # every HF tensor lands somewhere once: parameter counts agree
    assert sum(t.numel() for t in mega.values()) == sum(t.numel() for t in hf.values())
    layer = shape.layer_types.index("full_attention")
    qkv = mega[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"]
    gate = 2 if shape.gated_attention else 1
    assert qkv.shape[0] == (gate * shape.heads + 2 * shape.kv_heads) * shape.head_dim
    if shape.experts:
        assert mega["decoder.layers.0.mlp.router.weight"].shape == (shape.experts, shape.hidden)
        settings = MoeSettings().transformer_config_kwargs(shape)
        assert settings["moe_router_dtype"] == "fp32" and settings["moe_aux_loss_coeff"] == 0.0
        assert settings["moe_shared_expert_gate"] == (shape.shared_ffn > 0)


def test_gated_attention_layout_is_megatrons_per_group_order():
    """Per KV group: its query heads, their gate heads, its key head, its value head."""
    shape, hf = _checkpoint(TINY_QWEN3_5_MOE)
    layer = shape.layer_types.index("full_attention")
    src = f"model.layers.{layer}.self_attn."
    qkv = hf_to_megatron(shape, hf)[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"]
    d, group = shape.head_dim, shape.heads // shape.kv_heads
    q = hf[src + "q_proj.weight"].reshape(shape.heads, 2, d, -1)  # HF: per head query, gate
    block = qkv.reshape(shape.kv_heads, (2 * group + 2) * d, -1)[1]  # group 1
    assert torch.equal(block[:d], q[group, 0])  # first query head of group 1
    assert torch.equal(block[group * d : group * d + d], q[group, 1])  # its gate head
    key = hf[src + "k_proj.weight"][d : 2 * d]  # key head of group 1
    assert torch.equal(block[2 * group * d : 2 * group * d + d], key)


def test_experts_shard_over_ep_ranks_and_refuse_an_uneven_split():
    shape, hf = _checkpoint(TINY_QWEN3_MOE)
    mega = hf_to_megatron(shape, hf)
    shards = [expert_shard(shape, mega, 2, rank) for rank in range(2)]
    name = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc2.weight"
    assert torch.equal(shards[1][name.format(0)], mega[name.format(shape.experts // 2)])
    assert name.format(shape.experts // 2) not in shards[0]
    assert len(shards[0]) == len(shards[1]) < len(mega)
    with pytest.raises(ValueError, match=r"local\.megatron\.ep=3"):
        expert_shard(shape, mega, 3, 0)


def test_grouped_experts_stack_round_trips_per_expert_names() -> None:
    """The grouped-GEMM experts' stacked weights hold expert j's SequentialMLP weights at [j]."""
    import torch

    from oneloop.backends.megatron_local.engines.megatron.grouped_experts import stack, unstack

    gen = torch.Generator().manual_seed(0)
    mega = {"decoder.layers.0.self_attention.linear_proj.weight": torch.randn(4, 4, generator=gen)}
    for layer in range(2):
        for j in range(3):
            head = f"decoder.layers.{layer}.mlp.experts.local_experts.{j}."
            mega[head + "linear_fc1.weight"] = torch.randn(6, 4, generator=gen)
            mega[head + "linear_fc2.weight"] = torch.randn(4, 3, generator=gen)
    stacked = stack(mega)
    assert sorted(stacked) == [
        "decoder.layers.0.mlp.experts.grouped_fc1",
        "decoder.layers.0.mlp.experts.grouped_fc2",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.1.mlp.experts.grouped_fc1",
        "decoder.layers.1.mlp.experts.grouped_fc2",
    ]
    assert stacked["decoder.layers.1.mlp.experts.grouped_fc1"].shape == (3, 6, 4)
    assert torch.equal(
        stacked["decoder.layers.1.mlp.experts.grouped_fc2"][2],
        mega["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"],
    )
    back = unstack(stacked)
    assert sorted(back) == sorted(mega)
    assert all(torch.equal(back[k], mega[k]) for k in mega)


def test_hybrid_shape_reads_a_multimodal_config_and_partial_rope() -> None:
    """A Qwen3.5 / 3.6 checkpoint's config keeps the decoder under text_config; the engine's
    attention figures come from there, RoPE on partial_rotary_factor of each head."""
    from transformers import Qwen3_5MoeConfig

    from oneloop.backends.megatron_local.engines.megatron.layout import DenseShape

    text = AutoConfig.from_pretrained(build_tiny_model(named_tiny_specs()[TINY_QWEN3_5_MOE]))
    composite = Qwen3_5MoeConfig(text_config=text.to_dict())
    for config in (text, composite):
        shape = DenseShape.from_hf(config)
        assert shape.hybrid and shape.qk_norm
        assert shape.rotary_percent == text.rope_parameters["partial_rotary_factor"] < 1
        assert (shape.heads, shape.head_dim) == (text.num_attention_heads, text.head_dim)
        assert HybridShape.from_hf(config).layer_types == tuple(text.layer_types)


def test_multimodal_checkpoint_names_round_trip() -> None:
    """`model.language_model.` is the decoder; the vision tower and MTP head are not trained and
    the trained weights go back under the checkpoint's own names."""
    from oneloop.backends.megatron_local.engines.megatron.hybrid import (
        checkpoint_weights,
        text_weights,
    )

    t = torch.zeros(1)
    names = (
        "model.language_model.layers.0.mlp.gate.weight",
        "model.language_model.norm.weight",
        "model.visual.blocks.0.attn.qkv.weight",
        "mtp.fc.weight",
        "lm_head.weight",
    )
    hf = dict.fromkeys(names, t)
    text = text_weights(hf)
    assert sorted(text) == ["lm_head.weight", "model.layers.0.mlp.gate.weight", "model.norm.weight"]
    back = checkpoint_weights(text, composite=True)
    assert sorted(back) == sorted(k for k in hf if not k.startswith(("model.visual", "mtp.")))
    plain = {"model.layers.0.mlp.gate.weight": t}
    assert text_weights(plain) is plain and checkpoint_weights(plain, composite=False) is plain


def test_hybrid_transformer_fields_and_refusals() -> None:
    from oneloop.backends.megatron_local.engines.megatron.hybrid import (
        check_speed,
        transformer_fields,
    )
    from oneloop.backends.megatron_local.engines.megatron.moe import check_engine_layout
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel
    from oneloop.errors import CapabilityError

    moe, _ = _checkpoint(TINY_QWEN3_5_MOE)
    dense, _ = _checkpoint(TINY_QWEN3_5)
    fields = transformer_fields(moe, MoeSettings(), MegatronParallel(dp=2, ep=2), cpu=True)
    assert fields["linear_attention_freq"] == [
        int(k == "linear_attention") for k in moe.layer_types
    ]
    assert fields["num_moe_experts"] == moe.experts and fields["expert_model_parallel_size"] == 2
    assert fields["layernorm_zero_centered_gamma"] and fields["attention_output_gate"]
    assert fields["deterministic_mode"] and not fields["perform_initialization"]
    one = MegatronParallel()
    assert not transformer_fields(dense, MoeSettings(), one, cpu=False)["deterministic_mode"]
    assert "num_moe_experts" not in transformer_fields(dense, MoeSettings(), one, cpu=False)
    assert transformer_fields(None, MoeSettings(), one, cpu=True) == {}
    sizes = dict(tp=1, pp=1, cp=1, ep=1, dp=1, lora_rank=0)
    check_engine_layout(dense, **sizes)
    with pytest.raises(CapabilityError, match=r"lora_rank=8 with the hybrid model"):
        check_engine_layout(dense, **{**sizes, "lora_rank": 8})
    check_engine_layout(dense, **{**sizes, "cp": 2})  # the GDN's 2 key heads split over CP
    with pytest.raises(CapabilityError, match=r"cp=2 with the hybrid model.*tp=2"):
        check_engine_layout(dense, **{**sizes, "cp": 2, "tp": 2})
    with pytest.raises(ValueError, match=r"cp=4 must divide .*'linear_num_key_heads': 2"):
        check_engine_layout(dense, **{**sizes, "cp": 4})
    check_engine_layout(moe, **{**sizes, "cp": 2, "dp": 2, "ep": 4})  # EP out of cp · dp
    check_engine_layout(dense, **{**sizes, "tp": 2})  # 2 GDN key heads, 4 value heads
    with pytest.raises(ValueError, match=r"tp=4 must divide .*'linear_num_key_heads': 2"):
        check_engine_layout(dense, **{**sizes, "tp": 4})
    check_engine_layout(moe, **{**sizes, "pp": 2, "dp": 4, "ep": 4})  # stages × replicas × EP
    with pytest.raises(CapabilityError, match=r"ep=4 with the MoE model.*tp · cp · dp = 2 ranks"):
        check_engine_layout(moe, **{**sizes, "pp": 2, "dp": 2, "ep": 4})
    check_engine_layout(moe, **{**sizes, "tp": 2, "ep": 2})  # GDN heads split, experts whole
    for shape in (moe, dense):  # TP: sequence parallel; MoE: experts whole (expert TP 1)
        tp2 = transformer_fields(shape, MoeSettings(), MegatronParallel(tp=2), cpu=True)
        assert tp2["sequence_parallel"] and tp2["tensor_model_parallel_size"] == 2
        assert tp2.get("expert_tensor_parallel_size") == (1 if shape.experts else None)
    qwen3_moe, _ = _checkpoint(TINY_QWEN3_MOE)
    check_engine_layout(qwen3_moe, **{**sizes, "tp": 2, "ep": 2})  # EP carved from the TP pair
    sp = transformer_fields(qwen3_moe, MoeSettings(), MegatronParallel(tp=2), cpu=True)
    assert sp["sequence_parallel"] and sp["expert_tensor_parallel_size"] == 1
    with pytest.raises(ValueError, match="ep=2: must divide the model's 0 experts"):
        check_engine_layout(dense, **{**sizes, "ep": 2, "dp": 2})
    with pytest.raises(CapabilityError, match="fused_rope=true"):
        check_speed(fused_rope=True)


def test_fused_expert_checkpoints_split_per_expert() -> None:
    """A checkpoint storing each layer's experts fused reads as the per-expert one; a fused
    tensor of another shape is refused naming it."""
    from oneloop.backends.megatron_local.engines.hf import fuse_experts, split_experts
    from oneloop.backends.megatron_local.engines.megatron.hybrid import text_weights

    _, hf = _checkpoint(TINY_QWEN3_5_MOE)
    fused = fuse_experts(hf)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    back = text_weights(fused)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    name = next(k for k in fused if k.endswith("gate_up_proj"))
    with pytest.raises(ValueError, match=f"{name}: expected"):
        split_experts({**fused, name: fused[name].transpose(1, 2)})
