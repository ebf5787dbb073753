"""Tensor-parallel shard ⇄ gather maps of the `megatron` engine (pure torch; runs in CI).

Round trips are exact; the per-rank parts compute what Megatron's TP layers compute with them
(column-parallel outputs concatenate, row-parallel outputs sum, SwiGLU stays per rank); parallel
sizes not built (PP, CP, EP) and bad TP requests are refused with the reason before any rank starts.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from oneloop.backends.megatron_local.engines.megatron.layout import DenseShape, hf_to_megatron
from oneloop.backends.megatron_local.engines.megatron.parallel.shard import (
    COLUMN,
    REPLICATED,
    ROW,
    SECTIONS,
    check_tp,
    gather_all,
    shard_all,
    tp_kind,
)
from tests.backends.engines.test_megatron_layout import random_qwen3


def _model(tied: bool) -> tuple[DenseShape, dict[str, torch.Tensor]]:
    return random_qwen3(tied, heads=8, kv_heads=4)  # 4 KV groups: splits across TP 1, 2 and 4


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_shard_then_gather_is_exact(tied: bool, tp: int) -> None:
    shape, hf = _model(tied)
    mega = hf_to_megatron(shape, hf)
    parts = [shard_all(mega, tp, r) for r in range(tp)]
    for name, full in mega.items():
        sizes = [p[name].numel() for p in parts]
        expected = full.numel() if tp_kind(name) == REPLICATED else full.numel() // tp
        assert sizes == [expected] * tp, name
    back = gather_all(parts)
    assert list(back) == list(mega)
    for name in mega:
        assert torch.equal(back[name], mega[name]), name


def test_kinds_of_every_parameter() -> None:
    shape, hf = _model(tied=False)
    kinds = {name: tp_kind(name) for name in hf_to_megatron(shape, hf)}
    layer = "decoder.layers.1."
    assert kinds[layer + "self_attention.linear_qkv.weight"] == COLUMN
    assert kinds[layer + "self_attention.linear_proj.weight"] == ROW
    assert kinds[layer + "mlp.linear_fc1.weight"] == SECTIONS
    assert kinds[layer + "mlp.linear_fc2.weight"] == ROW
    assert kinds["embedding.word_embeddings.weight"] == COLUMN
    assert kinds["output_layer.weight"] == COLUMN
    for norm in ("input_layernorm", "pre_mlp_layernorm", "self_attention.q_layernorm"):
        assert kinds[f"{layer}{norm}.weight"] == REPLICATED
    assert kinds["decoder.final_layernorm.weight"] == REPLICATED


def test_qkv_shard_holds_whole_query_groups() -> None:
    """Rank r's qkv rows are the fused q/k/v of its own heads and the KV heads they use."""
    shape, hf = _model(tied=True)
    tp, d = 2, shape.head_dim
    fused = hf_to_megatron(shape, hf)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    sub = DenseShape(
        **{**shape.__dict__, "heads": shape.heads // tp, "kv_heads": shape.kv_heads // tp}
    )
    from oneloop.backends.megatron_local.engines.megatron.layout import fuse_qkv

    for r in range(tp):
        qs = q[r * sub.heads * d : (r + 1) * sub.heads * d]
        ks = k[r * sub.kv_heads * d : (r + 1) * sub.kv_heads * d]
        vs = v[r * sub.kv_heads * d : (r + 1) * sub.kv_heads * d]
        mine = shard_all({"decoder.layers.0.self_attention.linear_qkv.weight": fused}, tp, r)
        assert torch.equal(
            mine["decoder.layers.0.self_attention.linear_qkv.weight"], fuse_qkv(sub, qs, ks, vs)
        )


def test_rank_parts_compute_the_full_mlp_and_logits() -> None:
    shape, hf = _model(tied=False)
    mega = hf_to_megatron(shape, hf)
    x = torch.randn(5, shape.hidden)
    fc1, fc2 = (
        mega["decoder.layers.0.mlp.linear_fc1.weight"],
        mega["decoder.layers.0.mlp.linear_fc2.weight"],
    )

    def swiglu(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(x @ w1.T, 2, dim=-1)
        return (F.silu(gate) * up) @ w2.T

    full = swiglu(fc1, fc2)
    tp = 4
    parts = [shard_all(mega, tp, r) for r in range(tp)]
    name1, name2 = (
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
    )
    summed = sum(swiglu(p[name1], p[name2]) for p in parts)  # row-parallel fc2: all-reduce sum
    torch.testing.assert_close(summed, full, rtol=1e-5, atol=1e-5)
    logits = x @ mega["output_layer.weight"].T
    shards = torch.cat([x @ p["output_layer.weight"].T for p in parts], dim=-1)
    torch.testing.assert_close(shards, logits)  # vocab-parallel: rank r holds vocab block r


@pytest.mark.parametrize("name", ["oneloop/tiny-qwen3.5-moe", "oneloop/tiny-qwen3.5"])
def test_hybrid_shards_split_the_gated_delta_net_by_head(name: str) -> None:
    """A Qwen3.5 hybrid at TP 2: round trip exact; rank r's Gated DeltaNet tensors are the rows
    of its own key heads (q, k) and value heads (v, z, beta, alpha, A_log, dt_bias), section by
    section as megatron-core splits them; the routed experts stay whole."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from oneloop.backends.megatron_local.engines.megatron import moe
    from oneloop.tiny.model import build_tiny_model, named_tiny_specs

    path = build_tiny_model(named_tiny_specs()[name])
    shape = moe.HybridShape.from_hf(AutoConfig.from_pretrained(path))
    hf = load_file(path / "model.safetensors")
    mega, sections, tp = moe.hf_to_megatron(shape, hf), moe.tp_sections(shape), 2
    parts = [shard_all(mega, tp, r, sections) for r in range(tp)]
    back = gather_all(parts, sections)
    assert list(back) == list(mega) and all(torch.equal(back[n], mega[n]) for n in mega)
    kinds = {n: tp_kind(n) for n in mega}
    assert {kinds[n] for n in mega if ".local_experts." in n} <= {REPLICATED}
    i = shape.layer_types.index("linear_attention")
    src, dst = f"model.layers.{i}.linear_attn.", f"decoder.layers.{i}.self_attention."
    kd, vd = shape.linear_k_heads * shape.linear_k_dim, shape.linear_v_heads * shape.linear_v_dim
    q, k, v = torch.split(hf[src + "in_proj_qkv.weight"], [kd, kd, vd])
    cq, ck, cv = torch.split(hf[src + "conv1d.weight"], [kd, kd, vd])
    z, b, a = (hf[f"{src}in_proj_{n}.weight"] for n in "zba")
    for r, part in enumerate(parts):
        mine = [torch.chunk(t, tp)[r] for t in (q, k, v, z, b, a)]  # heads r·H/tp … in order
        assert torch.equal(part[dst + "in_proj.weight"], torch.cat(mine))
        conv = torch.cat([torch.chunk(t, tp)[r] for t in (cq, ck, cv)])
        assert torch.equal(part[dst + "conv1d.weight"], conv)
        for tensor in ("A_log", "dt_bias"):
            assert torch.equal(part[dst + tensor], torch.chunk(hf[src + tensor], tp)[r])
        out = torch.chunk(hf[src + "out_proj.weight"], tp, dim=1)[r]
        assert torch.equal(part[dst + "out_proj.weight"], out)
        assert torch.equal(part[dst + "out_norm.weight"], mega[dst + "out_norm.weight"])
    with pytest.raises(ValueError, match=r"(in_proj|conv1d)\.weight: no row sections"):
        shard_all(mega, tp, 0)  # a hybrid's fused GDN tensors need their sections


def test_check_tp_names_the_indivisible_figure() -> None:
    shape, _ = _model(tied=True)
    check_tp(shape, 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tp(shape, 8)
    with pytest.raises(ValueError, match="vocab_size"):
        check_tp(shape, 5)


def test_parallel_sizes_not_built_are_refused_with_the_reason() -> None:
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel
    from oneloop.backends.megatron_local.engines.megatron.world import init_distributed
    from oneloop.errors import CapabilityError

    cpu = torch.device("cpu")
    for sizes, reason in (
        ({"pp": 2}, "MegatronRayGroup"),  # PP ranks too
        ({"cp": 2}, "MegatronRayGroup"),  # CP ranks too (megatron.parallel.cp_rank)
        ({"ep": 2}, "MoE"),
        ({"tp": 2}, "MegatronRayGroup"),  # TP ranks exist only when the group starts them
        ({"dp": 2}, "MegatronRayGroup"),  # DP replicas too
    ):
        with pytest.raises(CapabilityError, match=reason):
            init_distributed(MegatronParallel(**sizes), cpu)


def test_group_engine_refuses_before_starting_ranks(tmp_path) -> None:
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel
    from oneloop.errors import CapabilityError

    Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8,
    ).save_pretrained(tmp_path)  # fmt: skip
    with pytest.raises(CapabilityError, match="LoRA"):  # LoRA is tensor-parallel only
        MegatronRayGroup(tmp_path, LoraSpec(4), parallel=MegatronParallel(tp=2, pp=2))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        MegatronRayGroup(tmp_path, LoraSpec(0), parallel=MegatronParallel(tp=8), device="cpu")
