"""Hugging Face ⇄ Megatron-core parameter mapping for the dense families the `megatron` engine runs.

Families: Qwen3 (GQA, QK-norm, optional tied embeddings), Qwen2 (GQA with q/k/v biases) and Llama.
Our own mapping, round-trip tested. megatron-bridge is not used: its newest release (0.6.2) needs
transformers <= 5.12.1 (this install has 5.24) and fails at import (`transformers.
modeling_attn_mask_utils` is gone), and its Qwen3/Llama mappings name TransformerEngine's fused
norm+linear parameters, which the local spec (no TE on the device image) does not have.

Megatron's fused layouts, which the mapping must reproduce exactly:
- `linear_qkv.weight` [(H + 2G)·D, hidden] is grouped per KV group g: the H/G query heads of g,
  then g's key head, then g's value head (not q-block, k-block, v-block as in vLLM);
- `linear_fc1.weight` [2·ffn, hidden] is gate rows then up rows (SwiGLU);
- norms keep their names' roles: `input_layernorm`, `pre_mlp_layernorm` (HF
  post_attention_layernorm), `q_layernorm`/`k_layernorm` (Qwen3 q_norm/k_norm),
  `decoder.final_layernorm`.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
MOE_ATTENTION_TYPES = ("qwen3_moe",)
"""MoE families whose attention is the dense family's (their experts: `megatron.moe`)."""
HYBRID_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text")
# Llama 3.x RoPE scaling as megatron-core's RotaryEmbedding builds it: its factor is a setting, the
# rest is fixed at these values (Llama 3.1 / 3.2 / 3.3 ship them).
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip


def rope_scaling_factor(config: Any) -> float | None:
    """The RoPE scaling the megatron engine builds for an HF config (an object or config.json's
    dict): None for plain RoPE (`rope_type` default; Qwen3.5's interleaved M-RoPE is plain RoPE on
    text positions), the factor for Llama 3's `llama3` scaling. ValueError naming the field for
    any other scaling (yarn, linear, dynamic, longrope, or llama3 with other fixed values): the
    engine would otherwise rotate with the wrong frequencies."""

    def field(name: str) -> Any:
        return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)

    # transformers >= 5 keeps the scaling in rope_parameters; older config.json in rope_scaling
    for name in ("rope_parameters", "rope_scaling"):
        params = field(name) or {}
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind == "default":
            continue
        fixed = {k: float(params.get(k, -1)) for k in LLAMA3_FIXED}
        if kind == "llama3" and fixed == LLAMA3_FIXED:
            return float(params["factor"])
        raise ValueError(
            f"trainer_engine=megatron builds plain RoPE and Llama 3's `llama3` scaling with "
            f"{LLAMA3_FIXED}; this config's {name} is {dict(params)} (model_type "
            f"{field('model_type')!r}): use trainer_engine=torch for it"
        )
    return None


@dataclass(frozen=True)
class DenseShape:
    """The figures of a dense decoder the mapping needs (read from the HF config)."""

    model_type: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    rms_eps: float
    max_positions: int

    rotary_percent: float = 1.0
    """The share of each head's dimensions RoPE rotates (Qwen3.5: partial_rotary_factor 0.25)."""
    rope_scaling: float | None = None
    """Llama 3's RoPE scaling factor (`rope_scaling_factor`); None: plain RoPE."""

    @property
    def hybrid(self) -> bool:
        """Gated DeltaNet hybrid layers (`megatron.hybrid`)."""
        return self.model_type in HYBRID_TYPES

    @classmethod
    def from_hf(cls, config: Any) -> "DenseShape":
        # a multimodal Qwen3.5 / 3.6 checkpoint keeps its decoder's figures under text_config
        config = getattr(config, "text_config", None) or config
        model_type = getattr(config, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES + MOE_ATTENTION_TYPES + HYBRID_TYPES:
            raise ValueError(
                f"trainer_engine=megatron supports model_type "
                f"{SUPPORTED_MODEL_TYPES + MOE_ATTENTION_TYPES + HYBRID_TYPES}; this config has "
                f"model_type={model_type!r} (use trainer_engine=torch)"
            )
        heads = int(config.num_attention_heads)
        rope_parameters = getattr(config, "rope_parameters", None) or {}
        rope = getattr(config, "rope_theta", None)
        if rope is None:  # transformers >= 5 keeps it under rope_parameters
            rope = rope_parameters.get("rope_theta", 10000.0)
        rotary = getattr(config, "partial_rotary_factor", None)
        if rotary is None:
            rotary = rope_parameters.get("partial_rotary_factor", 1.0)
        return cls(
            model_type=model_type,
            layers=int(config.num_hidden_layers),
            hidden=int(config.hidden_size),
            ffn=int(getattr(config, "intermediate_size", None) or config.moe_intermediate_size),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            vocab=int(config.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe") + HYBRID_TYPES,
            rope_theta=float(rope),
            rms_eps=float(config.rms_norm_eps),
            max_positions=int(config.max_position_embeddings),
            rotary_percent=float(rotary),
            rope_scaling=rope_scaling_factor(config),
        )


def _per_layer(shape: DenseShape) -> list[tuple[str, str]]:
    """(megatron suffix, hf suffix) pairs copied one to one inside layer i."""
    pairs = [
        ("input_layernorm.weight", "input_layernorm.weight"),
        ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
        ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
    ]
    if shape.qk_norm:
        pairs += [
            ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
        ]
    return pairs


def fuse_qkv(shape: DenseShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v ([H·D, ...], [G·D, ...], [G·D, ...]) → Megatron's per-group interleaved block."""
    group = shape.heads // shape.kv_heads
    d = shape.head_dim
    tail = q.shape[1:]
    qg = q.reshape(shape.kv_heads, group * d, *tail)
    kg = k.reshape(shape.kv_heads, d, *tail)
    vg = v.reshape(shape.kv_heads, d, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def _split_qkv(shape: DenseShape, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    group = shape.heads // shape.kv_heads
    d = shape.head_dim
    tail = qkv.shape[1:]
    blocks = qkv.reshape(shape.kv_heads, (group + 2) * d, *tail)
    q, k, v = torch.split(blocks, [group * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def globals_to_megatron(tied: bool, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights outside the decoder layers (embedding, final norm, untied head), HF →
    megatron names: the same for every family (dense, MoE, hybrid)."""
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def globals_to_hf(tied: bool, mega: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `globals_to_megatron`; a tied model also gets `lm_head.weight` (samplers
    untie)."""
    return {
        "model.embed_tokens.weight": mega["embedding.word_embeddings.weight"],
        "model.norm.weight": mega["decoder.final_layernorm.weight"],
        "lm_head.weight": mega[
            "embedding.word_embeddings.weight" if tied else "output_layer.weight"
        ],
    }


def hf_to_megatron(shape: DenseShape, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a full HF state dict (names as in `model.safetensors`) to GPTModel parameter names."""
    out = globals_to_megatron(shape.tied, hf)
    for i in range(shape.layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mega, name in _per_layer(shape):
            out[dst + mega] = hf[src + name]
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            shape,
            hf[attn + "q_proj.weight"],
            hf[attn + "k_proj.weight"],
            hf[attn + "v_proj.weight"],
        )
        if shape.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(
                shape, hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"]
            )
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0
        )
    return out


def megatron_to_hf(shape: DenseShape, mega: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron`; a tied model also gets `lm_head.weight` (samplers untie)."""
    out = globals_to_hf(shape.tied, mega)
    for i in range(shape.layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for mega_name, name in _per_layer(shape):
            out[dst + name] = mega[src + mega_name]
        q, k, v = _split_qkv(shape, mega[src + "self_attention.linear_qkv.weight"])
        out[dst + "self_attn.q_proj.weight"] = q
        out[dst + "self_attn.k_proj.weight"] = k
        out[dst + "self_attn.v_proj.weight"] = v
        if shape.qkv_bias:
            qb, kb, vb = _split_qkv(shape, mega[src + "self_attention.linear_qkv.bias"])
            out[dst + "self_attn.q_proj.bias"] = qb
            out[dst + "self_attn.k_proj.bias"] = kb
            out[dst + "self_attn.v_proj.bias"] = vb
        gate, up = torch.chunk(mega[src + "mlp.linear_fc1.weight"], 2, dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate
        out[dst + "mlp.up_proj.weight"] = up
    return out


def megatron_param_names(shape: DenseShape) -> list[str]:
    """GPTModel (local spec) parameter names of `shape`, in `hf_to_megatron`'s order."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    if not shape.tied:
        names.append("output_layer.weight")
    for i in range(shape.layers):
        prefix = f"decoder.layers.{i}."
        names += [prefix + mega for mega, _ in _per_layer(shape)]
        names.append(prefix + "self_attention.linear_qkv.weight")
        if shape.qkv_bias:
            names.append(prefix + "self_attention.linear_qkv.bias")
        names.append(prefix + "mlp.linear_fc1.weight")
    return names
