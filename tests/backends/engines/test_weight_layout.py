"""Hugging Face → vLLM parameter layout, flat packing, IPC and NCCL wire forms (CPU, no vLLM)."""

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from oneloop.backends.config import parse_backend_config
from oneloop.backends.megatron_local.weight_sync.ipc import CudaIpcWeights, make_ipc_weights
from oneloop.backends.megatron_local.weight_sync.layout import (
    ALIGN_BYTES,
    FlatEntry,
    fast_path_gap,
    hf_to_vllm_layout,
    pack_flat,
    unpack_flat,
)
from oneloop.backends.megatron_local.weight_sync.nccl import NcclWeights
from oneloop.errors import ConfigError

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 64, 2, 4, 2, 16, 96, 300


def tiny_qwen3(tied: bool) -> dict[str, torch.Tensor]:
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    return {k: v.detach() for k, v in model.state_dict().items()}


def vllm_layout(tied: bool, vocab_rows: int = VOCAB) -> list[tuple[str, str, tuple[int, ...]]]:
    """vLLM's Qwen3 parameters at tensor parallel size 1, written out by hand from its model code:
    QKVParallelLinear `qkv_proj` [(H + 2·KV)·d, hidden], MergedColumnParallelLinear `gate_up_proj`
    [2·I, hidden]; a tied lm_head is the embedding module itself (no parameter of its own)."""
    bf = "bfloat16"
    rows = [("model.embed_tokens.weight", bf, (vocab_rows, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        rows += [
            (f"{p}.self_attn.qkv_proj.weight", bf, ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)),
            (f"{p}.self_attn.o_proj.weight", bf, (HIDDEN, HEADS * HEAD_DIM)),
            (f"{p}.self_attn.q_norm.weight", bf, (HEAD_DIM,)),
            (f"{p}.self_attn.k_norm.weight", bf, (HEAD_DIM,)),
            (f"{p}.mlp.gate_up_proj.weight", bf, (2 * INTER, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", bf, (HIDDEN, INTER)),
            (f"{p}.input_layernorm.weight", bf, (HIDDEN,)),
            (f"{p}.post_attention_layernorm.weight", bf, (HIDDEN,)),
        ]
    rows.append(("model.norm.weight", bf, (HIDDEN,)))
    if not tied:
        rows.append(("lm_head.weight", bf, (vocab_rows, HIDDEN)))
    return rows


@pytest.mark.parametrize("tied", [True, False])
def test_fuses_qkv_and_gate_up_in_vllm_order(tied: bool) -> None:
    hf = tiny_qwen3(tied)
    layout = vllm_layout(tied)
    fused = dict(hf_to_vllm_layout(hf, layout))
    assert list(fused) == [name for name, _, _ in layout]
    for i in range(LAYERS):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        qkv = torch.cat(
            [hf[f"{a}.q_proj.weight"], hf[f"{a}.k_proj.weight"], hf[f"{a}.v_proj.weight"]]
        )
        assert torch.equal(fused[f"{a}.qkv_proj.weight"], qkv)
        gate_up = torch.cat([hf[f"{m}.gate_proj.weight"], hf[f"{m}.up_proj.weight"]])
        assert torch.equal(fused[f"{m}.gate_up_proj.weight"], gate_up)
        assert torch.equal(fused[f"{a}.q_norm.weight"], hf[f"{a}.q_norm.weight"])
    assert torch.equal(fused["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    if not tied:
        assert torch.equal(fused["lm_head.weight"], hf["lm_head.weight"])
    for name, _dtype, shape in layout:
        assert fused[name].dtype == torch.bfloat16 and tuple(fused[name].shape) == shape, name


def test_untied_vllm_model_takes_lm_head_from_a_tied_checkpoint() -> None:
    hf = tiny_qwen3(tied=True)
    hf.pop("lm_head.weight", None)
    fused = dict(hf_to_vllm_layout(hf, vllm_layout(tied=False)))
    assert torch.equal(fused["lm_head.weight"], hf["model.embed_tokens.weight"])


def test_padded_vocabulary_rows_are_zero() -> None:
    hf = tiny_qwen3(tied=True)
    fused = dict(hf_to_vllm_layout(hf, vllm_layout(tied=True, vocab_rows=320)))
    embed = fused["model.embed_tokens.weight"]
    assert embed.shape == (320, HIDDEN)
    assert torch.equal(embed[:VOCAB], hf["model.embed_tokens.weight"])
    assert not embed[VOCAB:].any()


def test_mismatches_are_listed_by_name() -> None:
    hf = tiny_qwen3(tied=True)
    hf["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    layout = vllm_layout(tied=True)
    layout[1] = (layout[1][0], "bfloat16", (7, HIDDEN))  # layer 0 qkv_proj: wrong rows
    with pytest.raises(ValueError) as err:
        hf_to_vllm_layout(hf, layout)
    message = str(err.value)
    assert "model.layers.0.self_attn.qkv_proj.weight" in message and "(7, 64)" in message
    assert "model.layers.0.mlp.extra.weight" in message
    del hf["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        hf_to_vllm_layout(hf, vllm_layout(tied=True))


EXPERTS, MOE_INTER, TOP_K = 4, 32, 2


def tiny_qwen3_moe() -> dict[str, torch.Tensor]:
    """A tiny Qwen3-MoE's state dict in transformers' layout (experts fused per layer)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=MOE_INTER,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    return {k: v.detach() for k, v in model.state_dict().items()}


def vllm_moe_layout() -> list[tuple[str, str, tuple[int, ...]]]:
    """vLLM's Qwen3-MoE parameters at tensor parallel size 1, from its model code: the dense
    MLP rows replaced by the router `mlp.gate` (ReplicatedLinear [E, hidden]) and FusedMoE's
    `experts.routed_experts.w13_weight` [E, 2·F, hidden] / `...w2_weight` [E, hidden, F] (the
    names vLLM 0.26 reported on the device)."""
    bf = "bfloat16"
    rows = []
    for name, dtype, shape in vllm_layout(tied=False):
        if ".mlp.gate_up_proj." in name:
            head = name.split(".mlp.")[0] + ".mlp"
            rows += [
                (f"{head}.gate.weight", bf, (EXPERTS, HIDDEN)),
                (f"{head}.experts.routed_experts.w13_weight", bf, (EXPERTS, 2 * MOE_INTER, HIDDEN)),
                (f"{head}.experts.routed_experts.w2_weight", bf, (EXPERTS, HIDDEN, MOE_INTER)),
            ]
        elif ".mlp.down_proj." not in name:
            rows.append((name, dtype, shape))
    return rows


@pytest.mark.parametrize("form", ["per_expert", "fused"])
def test_moe_experts_stack_into_fused_moe_parameters(form: str) -> None:
    """Per-expert checkpoint names (as the megatron engine exports them) and transformers' fused
    experts both give FusedMoE's w13 (gate rows, then up rows, per expert) and w2 (down)."""
    from oneloop.backends.megatron_local.engines.hf import split_experts

    fused_hf = tiny_qwen3_moe()
    hf = split_experts(fused_hf) if form == "per_expert" else fused_hf
    layout = vllm_moe_layout()
    built = dict(hf_to_vllm_layout(hf, layout))
    assert list(built) == [name for name, _, _ in layout]
    per_expert = split_experts(fused_hf)
    for i in range(LAYERS):
        m = f"model.layers.{i}.mlp"
        for j in range(EXPERTS):
            e = f"{m}.experts.{j}"
            gate_up = torch.cat(
                [per_expert[f"{e}.gate_proj.weight"], per_expert[f"{e}.up_proj.weight"]]
            )
            assert torch.equal(built[f"{m}.experts.routed_experts.w13_weight"][j], gate_up)
            assert torch.equal(
                built[f"{m}.experts.routed_experts.w2_weight"][j],
                per_expert[f"{e}.down_proj.weight"],
            )
        assert torch.equal(built[f"{m}.gate.weight"], hf[f"{m}.gate.weight"])
    if form == "per_expert":  # a missing expert is named
        del hf["model.layers.1.mlp.experts.3.up_proj.weight"]
        with pytest.raises(ValueError, match=r"w13_weight: missing .*experts\.3\.up_proj"):
            hf_to_vllm_layout(hf, layout)


def test_pack_and_unpack_round_trip_with_aligned_offsets() -> None:
    named = hf_to_vllm_layout(tiny_qwen3(tied=False), vllm_layout(tied=False))
    named.append(("odd.float32", torch.arange(5, dtype=torch.float32)))
    buffer, entries = pack_flat(named, "cpu")
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert all(e.offset % ALIGN_BYTES == 0 for e in entries)
    assert buffer.numel() >= sum(e.nbytes for e in entries)
    views = unpack_flat(buffer, entries)
    assert [n for n, _ in views] == [n for n, _ in named]
    for (_, original), (_, view) in zip(named, views, strict=True):
        assert view.dtype == original.dtype and torch.equal(view, original)
    # views share the buffer: writing one changes the buffer, not a copy
    views[0][1].zero_()
    assert not buffer[entries[0].offset : entries[0].offset + entries[0].nbytes].any()


def test_ipc_weights_wire_form_round_trips() -> None:
    weights = CudaIpcWeights(
        handle=(
            (4096,),
            (1,),
            0,
            "uint8",
            0,
            b"\x01handle",
            4096,
            0,
            False,
            b"\x02ref",
            0,
            b"\x03event",
            True,
        ),
        storage_typed=True,
        gpu_uuid="GPU-1234",
        nbytes=4096,
        entries=(FlatEntry("model.norm.weight", "bfloat16", (64,), 0),),
        version=3,
    )
    wire = weights.to_wire()
    allowed = (str, int, float, bool, bytes, list, dict, type(None))

    def plain(x) -> bool:
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return isinstance(x, allowed)

    assert plain(wire)  # msgpack-native: vLLM's RPC carries it without pickle
    assert CudaIpcWeights.from_wire(wire) == weights


def test_ipc_needs_a_cuda_uint8_buffer() -> None:
    with pytest.raises(ValueError, match="1-D CUDA uint8 buffer"):
        make_ipc_weights(torch.zeros(8, dtype=torch.uint8), [], version=1)


def test_nccl_weights_wire_form_round_trips_and_checks_into() -> None:
    entries = (
        FlatEntry("model.norm.weight", "bfloat16", (64,), 0),
        FlatEntry("lm_head.weight", "bfloat16", (32, 64), 256),
    )
    weights = NcclWeights("weights:m", 4352, entries, version=7, into="buffer")
    wire = weights.to_wire()
    assert json.loads(json.dumps(wire)) == wire  # plain types only: vLLM's RPC carries it
    assert NcclWeights.from_wire(wire) == weights
    with pytest.raises(ValueError, match="into must be one of"):
        NcclWeights("weights:m", 4352, entries, version=7, into="somewhere")


def test_gpu_weight_sync_needs_the_vllm_sampler() -> None:
    with pytest.raises(ConfigError, match=r"backend\.local.*weight_sync=nccl.*sampler_engine=vllm"):
        parse_backend_config({"local": {"weight_sync": "nccl", "sampler_engine": "torch"}})
    config = parse_backend_config({"local": {"weight_sync": "nccl", "sampler_engine": "vllm"}})
    assert config.local.weight_sync == "nccl"


def test_fast_path_gap_names_the_gated_deltanet_parameters() -> None:
    """Dense and Qwen3-MoE layouts map; a Gated DeltaNet layer (vLLM's Qwen3.5 / 3.6 names) does
    not, and the reason names one of its parameters (auto sync then takes the object store)."""
    assert fast_path_gap(vllm_layout(tied=True)) is None
    assert fast_path_gap(vllm_moe_layout()) is None
    gdn = ("model.layers.0.linear_attn.in_proj_qkvz.weight", "bfloat16", (8, 64))
    gap = fast_path_gap([*vllm_moe_layout(), gdn])
    assert gap is not None and gdn[0] in gap
