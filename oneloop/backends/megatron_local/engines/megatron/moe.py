"""Hugging Face ⇄ Megatron-core parameter mapping for the seed's MoE and hybrid families, and the
megatron-core MoE settings the engine builds them with.

Families (read from the HF config; the dense ones stay in `layout.py`):
- `qwen3_moe` (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention, every layer a top-k MoE MLP;
- `qwen3_5_moe` / `qwen3_5_moe_text` (Qwen3.5 / Qwen3.6 MoE, text model only): hybrid layers,
  Gated DeltaNet (`linear_attention`) or gated full attention (`full_attention`), each followed by
  a top-k MoE MLP plus a sigmoid-gated shared expert;
- `qwen3_5` / `qwen3_5_text` (Qwen3.5 dense): the same hybrid layers with a dense SwiGLU MLP.

Names are the Hugging Face checkpoint's on disk (`model.layers.{i}.mlp.experts.{j}.gate_proj`,
...) and megatron-core 0.19's: `mlp.router.weight`, per-expert
`mlp.experts.local_experts.{j}.linear_fc{1,2}.weight` (SequentialMLP; grouped GEMM renames
them, see `EXPERT_LAYOUTS`), `mlp.shared_experts.linear_fc{1,2}.weight` and
`mlp.shared_experts.gate_weight`. Fused layouts:
- expert `linear_fc1` [2·ffn, hidden] = gate rows then up rows (as the dense MLP);
- gated attention `linear_qkv` [(2H + 2G)·D, hidden], per KV group g: g's H/G query heads, their
  H/G gate heads, g's key head, g's value head (megatron `attention_output_gate`); HF's q_proj
  [2·H·D, hidden] holds per head its D query rows then its D gate rows;
- Gated DeltaNet `in_proj` [2·Kd + 2·Vd + 2·Hv, hidden] = q | k | v | z | beta | alpha (HF's
  in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); conv1d over q | k | v in both.
Qwen3.5's RMSNorms store (weight − 1) (zero-centred gamma): copied as is, the engine sets
`layernorm_zero_centered_gamma` for these families; the Gated DeltaNet's output norm
(`linear_attn.norm`) stores gamma itself, so it maps as gamma − 1 (megatron's `out_norm` follows
the same zero-centred setting; checked against transformers in fp32 on CPU, max logit diff 1e-6).
"""

from dataclasses import dataclass
from typing import Any

import torch

from oneloop.backends.megatron_local.engines.megatron.layout import (
    fuse_qkv,
    globals_to_hf,
    globals_to_megatron,
)

MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text")
HYBRID_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text")
FAMILIES = tuple(dict.fromkeys(MOE_MODEL_TYPES + HYBRID_MODEL_TYPES))
LAYER_TYPES = ("full_attention", "linear_attention")
MEGATRON_EXPERT = "mlp.experts.local_experts"  # SequentialMLP's expert i: `{MEGATRON_EXPERT}.{i}.`


@dataclass(frozen=True)
class MoeSettings:
    """megatron-core MoE settings for RL (the defaults): router in fp32, no load-balancing aux
    loss and no z-loss (they would pull the policy away from the sampler's routing), dropless
    all-to-all dispatch."""

    router_dtype: str = "fp32"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    token_dispatcher: str = "alltoall"
    grouped_gemm: bool = False
    """TEGroupedMLP where TransformerEngine is present (device); SequentialMLP otherwise."""

    def transformer_config_kwargs(self, shape: "HybridShape") -> dict[str, Any]:
        """The `TransformerConfig` fields of these settings for `shape` (MoE families)."""
        return {
            "num_moe_experts": shape.experts,
            "moe_router_topk": shape.top_k,
            "moe_ffn_hidden_size": shape.expert_ffn,
            "moe_shared_expert_intermediate_size": shape.shared_ffn or None,
            "moe_shared_expert_gate": shape.shared_ffn > 0,
            # norm_topk_prob: softmax over the top-k logits (= renormalised top-k probabilities);
            # without it, top-k of the softmax over every expert, not renormalised
            "moe_router_pre_softmax": not shape.norm_topk,
            "moe_router_score_function": "softmax",
            "moe_router_dtype": self.router_dtype,
            "moe_aux_loss_coeff": self.aux_loss_coeff,
            "moe_z_loss_coeff": self.z_loss_coeff or None,
            "moe_router_load_balancing_type": "aux_loss" if self.aux_loss_coeff else "none",
            "moe_token_dispatcher_type": self.token_dispatcher,
            "moe_grouped_gemm": self.grouped_gemm,
            "moe_router_topk_scaling_factor": None,
        }


@dataclass(frozen=True)
class HybridShape:
    """The figures of a MoE and/or hybrid decoder the mapping needs (read from the HF config)."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    layer_types: tuple[str, ...]
    experts: int  # 0 = dense MLP
    top_k: int
    expert_ffn: int
    shared_ffn: int  # 0 = no shared expert
    ffn: int  # dense MLP width (dense families)
    norm_topk: bool
    gated_attention: bool
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0

    @classmethod
    def from_hf(cls, config: Any) -> "HybridShape":
        text = getattr(config, "text_config", None) or config
        get = (
            (lambda k, d=None: text.get(k, d))
            if isinstance(text, dict)
            else (lambda k, d=None: getattr(text, k, d))
        )
        model_type = get("model_type", "?")
        if model_type not in FAMILIES:
            raise ValueError(
                f"model_type={model_type!r}: the MoE / hybrid mapping covers {FAMILIES}"
            )
        layers = int(get("num_hidden_layers"))
        hybrid = model_type in HYBRID_MODEL_TYPES
        types = (
            tuple(get("layer_types") or ["full_attention"] * layers)
            if hybrid
            else (("full_attention",) * layers)
        )
        for index, kind in enumerate(types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer_types[{index}]={kind!r}: expected one of {LAYER_TYPES}")
        experts = int(get("num_experts") or get("num_local_experts") or 0)
        heads = int(get("num_attention_heads"))
        return cls(
            model_type=model_type,
            layers=layers,
            hidden=int(get("hidden_size")),
            heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or int(get("hidden_size")) // heads),
            vocab=int(get("vocab_size")),
            tied=bool(get("tie_word_embeddings", False)),
            layer_types=types,
            experts=experts,
            top_k=int(get("num_experts_per_tok") or 0),
            expert_ffn=int(get("moe_intermediate_size") or 0),
            shared_ffn=int(get("shared_expert_intermediate_size") or 0) if experts else 0,
            ffn=int(get("intermediate_size") or 0),
            norm_topk=bool(get("norm_topk_prob", True)),
            gated_attention=hybrid,
            linear_k_heads=int(get("linear_num_key_heads") or 0),
            linear_v_heads=int(get("linear_num_value_heads") or 0),
            linear_k_dim=int(get("linear_key_head_dim") or 0),
            linear_v_dim=int(get("linear_value_head_dim") or 0),
            conv_kernel=int(get("linear_conv_kernel_dim") or 0),
        )

    def check_ep(self, ep: int) -> None:
        """Raise ValueError naming `local.megatron.ep` unless it splits the experts evenly."""
        if ep > 1 and (not self.experts or self.experts % ep):
            raise ValueError(
                f"local.megatron.ep={ep}: must divide the model's {self.experts} experts"
            )


def _split_gated_q(shape: HybridShape, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF gated q_proj [H·2D, ...] (per head: D query rows, D gate rows) → query, gate [H·D]."""
    per_head = q.reshape(shape.heads, 2, shape.head_dim, *q.shape[1:])
    tail = q.shape[1:]
    return per_head[:, 0].reshape(-1, *tail), per_head[:, 1].reshape(-1, *tail)


def _fuse_gated_qkv(shape: HybridShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    query, gate = _split_gated_q(shape, q)
    group, d, tail = shape.heads // shape.kv_heads, shape.head_dim, q.shape[1:]
    blocks = [
        query.reshape(shape.kv_heads, group * d, *tail),
        gate.reshape(shape.kv_heads, group * d, *tail),
        k.reshape(shape.kv_heads, d, *tail),
        v.reshape(shape.kv_heads, d, *tail),
    ]
    return torch.cat(blocks, dim=1).reshape(-1, *tail)


def _split_gated_qkv(shape: HybridShape, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    group, d, tail = shape.heads // shape.kv_heads, shape.head_dim, qkv.shape[1:]
    blocks = qkv.reshape(shape.kv_heads, (2 * group + 2) * d, *tail)
    query, gate, k, v = torch.split(blocks, [group * d, group * d, d, d], dim=1)
    per_head = torch.stack(
        [query.reshape(shape.heads, d, *tail), gate.reshape(shape.heads, d, *tail)], dim=1
    )
    return per_head.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _gdn_sections(shape: HybridShape) -> list[int]:
    kd, vd = shape.linear_k_heads * shape.linear_k_dim, shape.linear_v_heads * shape.linear_v_dim
    return [2 * kd + vd, vd, shape.linear_v_heads, shape.linear_v_heads]


_GDN_COPIED = (
    ("self_attention.conv1d.weight", "linear_attn.conv1d.weight"),
    ("self_attention.A_log", "linear_attn.A_log"),
    ("self_attention.dt_bias", "linear_attn.dt_bias"),
    ("self_attention.out_proj.weight", "linear_attn.out_proj.weight"),
)
_GDN_IN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _layer_pairs(shape: HybridShape, i: int) -> list[tuple[str, str]]:
    """(megatron suffix, hf suffix) pairs copied one to one inside layer i."""
    pairs = [
        ("input_layernorm.weight", "input_layernorm.weight"),
        ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ]
    if shape.layer_types[i] == "linear_attention":
        pairs += list(_GDN_COPIED)
    else:
        pairs += [
            ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
            ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
        ]
    if shape.experts:
        pairs.append(("mlp.router.weight", "mlp.gate.weight"))
        pairs += [
            (f"{MEGATRON_EXPERT}.{j}.linear_fc2.weight", f"mlp.experts.{j}.down_proj.weight")
            for j in range(shape.experts)
        ]
        if shape.shared_ffn:
            pairs += [
                ("mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight"),
                ("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight"),
            ]
    else:
        pairs.append(("mlp.linear_fc2.weight", "mlp.down_proj.weight"))
    return pairs


def _fc1_pairs(shape: HybridShape) -> list[tuple[str, str]]:
    """(megatron fc1 suffix, hf prefix of its gate_proj / up_proj) inside a layer."""
    if not shape.experts:
        return [("mlp.linear_fc1.weight", "mlp.")]
    pairs = [
        (f"{MEGATRON_EXPERT}.{j}.linear_fc1.weight", f"mlp.experts.{j}.")
        for j in range(shape.experts)
    ]
    if shape.shared_ffn:
        pairs.append(("mlp.shared_experts.linear_fc1.weight", "mlp.shared_expert."))
    return pairs


def hf_to_megatron(shape: HybridShape, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full HF state dict (checkpoint names, text model under `model.`) → megatron names."""
    out = globals_to_megatron(shape.tied, hf)
    for i in range(shape.layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mega, name in _layer_pairs(shape, i):
            out[dst + mega] = hf[src + name]
        if shape.layer_types[i] == "linear_attention":
            # HF's gated RMSNorm after the delta rule stores gamma itself; megatron's follows
            # layernorm_zero_centered_gamma (1 + w), as the layer norms do
            out[dst + "self_attention.out_norm.weight"] = hf[f"{src}linear_attn.norm.weight"] - 1
            out[dst + "self_attention.in_proj.weight"] = torch.cat(
                [hf[f"{src}linear_attn.{n}.weight"] for n in _GDN_IN], dim=0
            )
        else:
            attn = src + "self_attn."
            q, k, v = (hf[f"{attn}{n}_proj.weight"] for n in "qkv")
            fused = (
                _fuse_gated_qkv(shape, q, k, v)
                if shape.gated_attention
                else fuse_qkv(
                    shape,
                    q,
                    k,
                    v,  # type: ignore[arg-type]  # reads heads, kv_heads, head_dim
                )
            )
            out[dst + "self_attention.linear_qkv.weight"] = fused
        for mega, prefix in _fc1_pairs(shape):
            out[dst + mega] = torch.cat(
                [hf[f"{src}{prefix}gate_proj.weight"], hf[f"{src}{prefix}up_proj.weight"]], dim=0
            )
    return out


def megatron_to_hf(shape: HybridShape, mega: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron`; a tied model also gets `lm_head.weight` (samplers untie)."""
    out = globals_to_hf(shape.tied, mega)
    for i in range(shape.layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for mega_name, name in _layer_pairs(shape, i):
            out[dst + name] = mega[src + mega_name]
        if shape.layer_types[i] == "linear_attention":
            out[f"{dst}linear_attn.norm.weight"] = mega[src + "self_attention.out_norm.weight"] + 1
            parts = torch.split(mega[src + "self_attention.in_proj.weight"], _gdn_sections(shape))
            for name, part in zip(_GDN_IN, parts, strict=True):
                out[f"{dst}linear_attn.{name}.weight"] = part
        else:
            qkv = mega[src + "self_attention.linear_qkv.weight"]
            if shape.gated_attention:
                q, k, v = _split_gated_qkv(shape, qkv)
            else:
                group, d = shape.heads // shape.kv_heads, shape.head_dim
                blocks = qkv.reshape(shape.kv_heads, (group + 2) * d, *qkv.shape[1:])
                q, k, v = (
                    b.reshape(-1, *qkv.shape[1:])
                    for b in torch.split(blocks, [group * d, d, d], dim=1)
                )
            for name, tensor in zip("qkv", (q, k, v), strict=True):
                out[f"{dst}self_attn.{name}_proj.weight"] = tensor
        for mega_name, prefix in _fc1_pairs(shape):
            gate, up = torch.chunk(mega[src + mega_name], 2, dim=0)
            out[f"{dst}{prefix}gate_proj.weight"] = gate
            out[f"{dst}{prefix}up_proj.weight"] = up
    return out


def expert_shard(
    shape: HybridShape, mega: dict[str, torch.Tensor], ep: int, rank: int
) -> dict[str, torch.Tensor]:
    """The parameters EP rank `rank` of `ep` holds: every non-expert parameter, and experts
    rank·E/ep … (rank+1)·E/ep − 1 renumbered from 0 (megatron's `local_experts` numbering)."""
    shape.check_ep(ep)
    per_rank = shape.experts // ep
    out = {}
    for name, tensor in mega.items():
        parts = expert_index(name)
        if parts is None:
            out[name] = tensor
            continue
        head, index, tail = parts
        local = index - rank * per_rank
        if 0 <= local < per_rank:
            out[f"{head}.mlp.experts.local_experts.{local}.{tail}"] = tensor
    return out


def tp_sections(shape: HybridShape) -> dict[str, list[int]]:
    """The row sections of a Gated DeltaNet's fused tensors (`parallel.shard`'s table): each
    TP rank holds its share of every section, as megatron-core's GatedDeltaNet splits them."""
    kd, vd = shape.linear_k_heads * shape.linear_k_dim, shape.linear_v_heads * shape.linear_v_dim
    heads = shape.linear_v_heads
    return {
        "self_attention.in_proj.weight": [kd, kd, vd, vd, heads, heads],
        "self_attention.conv1d.weight": [kd, kd, vd],
    }


def check_tp(shape: HybridShape, tp: int) -> None:
    """Raise ValueError naming the config figures `tp` does not divide: the attention's heads and
    KV groups, the vocabulary, a Gated DeltaNet's key and value heads, a shared expert's width,
    a dense MLP's width (Megatron splits each evenly over the TP ranks; experts stay whole)."""
    if tp == 1:
        return
    figures = {
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab,
        "shared_expert_intermediate_size": shape.shared_ffn,
    }
    if "linear_attention" in shape.layer_types:
        figures.update(
            linear_num_key_heads=shape.linear_k_heads, linear_num_value_heads=shape.linear_v_heads
        )
    if not shape.experts:
        figures["intermediate_size"] = shape.ffn
    bad = {k: v for k, v in figures.items() if v % tp}
    if bad:
        raise ValueError(
            f"local.megatron.tp={tp} must divide the model's {bad} (Megatron splits heads, KV "
            "groups, the vocabulary, the Gated DeltaNet heads and the dense and shared-expert MLPs "
            "evenly over tensor-parallel ranks; each expert stays whole)"
        )


def check_engine_layout(
    shape: HybridShape, *, tp: int, pp: int, cp: int, ep: int, dp: int, lora_rank: int
) -> None:
    """What the megatron engine builds for a MoE or hybrid model, else CapabilityError (or
    ValueError for sizes that do not divide) naming the field: pipeline stages (`parallel.pp`);
    tensor parallelism with sequence parallelism, each expert kept whole (expert TP 1); context
    parallelism at tp = 1 (`parallel.cp_rank`; a Gated DeltaNet splits its heads over the CP
    group); experts split by `ep` over the ranks of each stage's tp · cp · dp block; no LoRA on
    these layers."""
    from oneloop.errors import CapabilityError

    shape.check_ep(ep)
    check_tp(shape, tp)
    refusals = (
        (cp > 1 and tp > 1, f"local.megatron.cp={cp}", f"context parallelism with tp={tp} is not "
         "built for these layers; use cp with tp = 1, or tp alone"),
        (lora_rank > 0, f"model.lora_rank={lora_rank}", "LoRA adapters on MoE and hybrid "
         "layers are not built on the megatron engine (the torch engine trains them)"),
        (ep > 1 and (tp * cp * dp) % ep, f"local.megatron.ep={ep}", "expert-parallel ranks are "
         f"carved out of each stage's tp · cp · dp = {tp * cp * dp} ranks; ep must divide it"),
    )  # fmt: skip
    for refused, field, why in refusals:
        if refused:
            raise CapabilityError(
                f"{field} with the {'MoE' if shape.experts else 'hybrid'} model "
                f"{shape.model_type!r} on trainer_engine=megatron: {why}"
            )
    if cp > 1 and "linear_attention" in shape.layer_types:
        heads = {"linear_num_key_heads": shape.linear_k_heads,
                 "linear_num_value_heads": shape.linear_v_heads}  # fmt: skip
        bad = {k: v for k, v in heads.items() if v % cp}
        if bad:
            raise ValueError(
                f"local.megatron.cp={cp} must divide the model's {bad} (the Gated DeltaNet "
                "trades its sequence chunks for heads over the CP group)"
            )


def expert_index(name: str) -> tuple[str, int, str] | None:
    """(head, local expert index, tail) of a SequentialMLP expert parameter name, else None."""
    marker = ".mlp.experts.local_experts."
    if marker not in name:
        return None
    head, rest = name.split(marker)
    index, tail = rest.split(".", 1)
    return head, int(index), tail


def unshard_experts(
    shape: HybridShape, per_rank: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Inverse of `expert_shard` over every EP rank's parameters (in EP-rank order): every
    non-expert parameter from rank 0, experts renumbered to their global index."""
    local = shape.experts // len(per_rank)
    out: dict[str, torch.Tensor] = {}
    for rank, mega in enumerate(per_rank):
        for name, tensor in mega.items():
            parts = expert_index(name)
            if parts is None:
                if rank == 0:
                    out[name] = tensor
                continue
            head, index, tail = parts
            out[f"{head}.mlp.experts.local_experts.{rank * local + index}.{tail}"] = tensor
    return out


def to_megatron_rank(
    shape: HybridShape, hf: dict[str, torch.Tensor], ep: int
) -> dict[str, torch.Tensor]:
    """Full HF weights → this EP rank's Megatron-layout weights (every non-expert parameter and
    its own experts; megatron's parallel state gives the rank)."""
    mega = hf_to_megatron(shape, hf)
    if ep == 1:
        return mega
    from megatron.core import parallel_state

    return expert_shard(shape, mega, ep, parallel_state.get_expert_model_parallel_rank())


def gather_experts(
    shape: HybridShape, params: dict[str, torch.Tensor], ep: int
) -> dict[str, torch.Tensor]:
    """This EP rank's Megatron-layout weights with every expert: at ep > 1 the experts are
    all-gathered over the expert-parallel group in one flat collective (every rank calls it)."""
    if ep == 1:
        return params
    from megatron.core import parallel_state

    names = [n for n in params if expert_index(n) is not None]
    mine = [params[n] for n in names]
    flat = torch._utils._flatten_dense_tensors(mine)
    every = [torch.empty_like(flat) for _ in range(ep)]
    group = parallel_state.get_expert_model_parallel_group()
    torch.distributed.all_gather(every, flat, group=group)
    per_rank = [
        dict(zip(names, torch._utils._unflatten_dense_tensors(f, mine), strict=True)) for f in every
    ]
    per_rank[0].update({n: t for n, t in params.items() if n not in per_rank[0]})
    return unshard_experts(shape, per_rank)
