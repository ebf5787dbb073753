"""A decoder model's shape read from a Hugging Face `config.json`, and its parameter counts.

This module owns turning a config (plain JSON; a multimodal config's `text_config` is used, the
vision tower is ignored) into the figures `oneloop size` needs: which layers keep a per-token KV
cache, the parameter count of the weights, and the parameter count of LoRA adapters.

Layer attention kinds come from `layer_types` ("full_attention" / "sliding_attention" /
"linear_attention"), else from `full_attention_interval` (Qwen3-Next / Qwen3.5: layer i is full
when (i + 1) % interval == 0, the rest linear attention), else from `use_sliding_window` with
`max_window_layers` (Qwen2 style), else every layer is full attention.

Counts cover embeddings, attention, MLP or MoE experts (+ shared expert and router), norms and
the LM head (unless tied). Not counted: biases other than Qwen-style qkv biases, multi-token
prediction heads and vision towers, so totals are a few tenths of a percent low for those models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from pathlib import Path
from typing import Any

from oneloop.errors import ConfigError

DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
}
GIB = 2**30
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights + Adam m + Adam v, 4 B each


def gib_text(n_bytes: int | Fraction) -> str:
    """Bytes as the reports print them: `12.34 GiB`."""
    return f"{float(n_bytes) / GIB:,.2f} GiB"


# Qwen3-Next's full-attention layers gate their output with a second q-sized projection; Qwen3.5
# configs state it as `attn_output_gate`.
GATED_ATTENTION_MODEL_TYPES = frozenset({"qwen3_next"})


class SizeInputError(ConfigError):
    """A sizing input (config file, config key or number) is missing or invalid; names the field."""


class Attention(StrEnum):
    FULL = "full_attention"
    SLIDING = "sliding_attention"
    LINEAR = "linear_attention"


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    experts_per_token: int
    expert_intermediate: int  # moe_intermediate_size
    shared_intermediate: int  # shared_expert_intermediate_size (0 = no shared expert)


@dataclass(frozen=True)
class LinearAttentionShape:
    """Gated DeltaNet dimensions (Qwen3-Next / Qwen3.5 linear-attention layers)."""

    key_heads: int
    key_head_dim: int
    value_heads: int
    value_head_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class ModelShape:
    source: Path
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool
    attention: tuple[Attention, ...]  # one per layer
    moe_layer: tuple[bool, ...]  # one per layer: True where the MLP is a mixture of experts
    dense_intermediate: int  # intermediate_size (0 when every layer is MoE and it is absent)
    moe: MoeShape | None
    linear: LinearAttentionShape | None
    attn_output_gate: bool
    qkv_bias: bool
    sliding_window: int | None
    config_dtype: str | None  # torch_dtype / dtype in the config, if any
    notes: tuple[str, ...]  # how defaults were filled in

    @property
    def full_attention_layers(self) -> int:
        return sum(kind is Attention.FULL for kind in self.attention)


def _read_json(path: Path) -> tuple[Path, dict[str, Any]]:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise SizeInputError(
            f"config: {str(path)!r} is not a config.json file or a directory containing one"
        )
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise SizeInputError(f"config: {file} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise SizeInputError(f"config: {file} must hold a JSON object, got {type(data).__name__}")
    if isinstance(data.get("text_config"), dict):
        data = {**data["text_config"], "model_type": data.get("model_type", "")}
    return file, data


class _Reader:
    def __init__(self, file: Path, data: dict[str, Any]) -> None:
        self.file = file
        self.data = data

    def int(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.data.get(key)
        if value is None:
            if default is None:
                raise SizeInputError(f"{self.file}: missing required key {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise SizeInputError(
                f"{self.file}: {key!r} must be an integer >= {minimum}, got {value!r}"
            )
        return value

    def first(self, *keys: str) -> str | None:
        return next((key for key in keys if self.data.get(key) is not None), None)


def _attention_kinds(r: _Reader, layers: int, notes: list[str]) -> tuple[Attention, ...]:
    types = r.data.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise SizeInputError(
                f"{r.file}: 'layer_types' must be a list of {layers} strings (one per layer)"
            )
        try:
            return tuple(Attention(kind) for kind in types)
        except ValueError as exc:
            known = ", ".join(kind.value for kind in Attention)
            raise SizeInputError(
                f"{r.file}: 'layer_types': {exc}; expected one of {known}"
            ) from exc
    if r.data.get("full_attention_interval") is not None:
        interval = r.int("full_attention_interval")
        notes.append(f"layer i is full attention when (i+1) % {interval} == 0, else linear")
        return tuple(
            Attention.FULL if (i + 1) % interval == 0 else Attention.LINEAR for i in range(layers)
        )
    if r.data.get("use_sliding_window"):
        first_sliding = r.int("max_window_layers", minimum=0)
        return tuple(
            Attention.SLIDING if i >= first_sliding else Attention.FULL for i in range(layers)
        )
    return (Attention.FULL,) * layers


def _moe(r: _Reader, layers: int) -> tuple[MoeShape | None, tuple[bool, ...]]:
    experts_key = r.first("num_experts", "num_local_experts", "n_routed_experts")
    if experts_key is None or r.data[experts_key] == 0:
        return None, (False,) * layers
    moe = MoeShape(
        num_experts=r.int(experts_key),
        experts_per_token=r.int("num_experts_per_tok"),
        expert_intermediate=r.int("moe_intermediate_size"),
        shared_intermediate=r.int("shared_expert_intermediate_size", 0, minimum=0),
    )
    dense_only = r.data.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) for i in dense_only):
        raise SizeInputError(f"{r.file}: 'mlp_only_layers' must be a list of layer indices")
    step = r.int("decoder_sparse_step", 1)
    first_dense = r.int("first_k_dense_replace", 0, minimum=0)
    is_moe = tuple(
        (i + 1) % step == 0 and i not in dense_only and i >= first_dense for i in range(layers)
    )
    return moe, is_moe


def load_shape(path: Path | str) -> ModelShape:
    """Read a config.json (or a directory holding one); errors name the file and the key."""
    file, data = _read_json(Path(path))
    r = _Reader(file, data)
    notes: list[str] = []
    hidden = r.int("hidden_size")
    layers = r.int("num_hidden_layers")
    heads = r.int("num_attention_heads")
    if data.get("num_key_value_heads") is None:
        notes.append("num_key_value_heads absent: = num_attention_heads (multi-head attention)")
    kv_heads = r.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise SizeInputError(
            f"{file}: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}"
        )
    if data.get("head_dim") is None:
        if hidden % heads:
            raise SizeInputError(
                f"{file}: 'head_dim' absent and hidden_size={hidden} is not divisible by "
                f"num_attention_heads={heads}"
            )
        notes.append(f"head_dim absent: = hidden_size / num_attention_heads = {hidden // heads}")
    head_dim = r.int("head_dim", hidden // heads)
    attention = _attention_kinds(r, layers, notes)
    moe, moe_layer = _moe(r, layers)
    needs_dense = not all(moe_layer)
    dense_intermediate = (
        r.int("intermediate_size") if needs_dense else r.int("intermediate_size", 0, minimum=0)
    )
    linear = None
    if Attention.LINEAR in attention:
        linear = LinearAttentionShape(
            key_heads=r.int("linear_num_key_heads"),
            key_head_dim=r.int("linear_key_head_dim"),
            value_heads=r.int("linear_num_value_heads"),
            value_head_dim=r.int("linear_value_head_dim"),
            conv_kernel=r.int("linear_conv_kernel_dim", 4),
        )
    model_type = str(data.get("model_type", ""))
    gate = data.get("attn_output_gate", model_type in GATED_ATTENTION_MODEL_TYPES)
    window = data.get("sliding_window") if Attention.SLIDING in attention else None
    dtype = data.get("torch_dtype") or data.get("dtype")
    return ModelShape(
        source=file,
        model_type=model_type,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=r.int("vocab_size"),
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
        attention=attention,
        moe_layer=moe_layer,
        dense_intermediate=dense_intermediate,
        moe=moe,
        linear=linear,
        attn_output_gate=bool(gate),
        qkv_bias=bool(data.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
        sliding_window=window if isinstance(window, int) else None,
        config_dtype=str(dtype) if isinstance(dtype, str) else None,
        notes=tuple(notes),
    )


@dataclass(frozen=True)
class ParamCount:
    embeddings: int  # input embeddings + LM head (unless tied)
    attention: int  # full / sliding attention projections (+ q/k norms)
    linear_attention: int
    mlp: int  # dense MLPs + MoE experts + shared experts + routers
    norms: int
    total: int


def _attention_params(s: ModelShape) -> int:
    q_out = s.heads * s.head_dim * (2 if s.attn_output_gate else 1)
    kv_out = s.kv_heads * s.head_dim
    params = s.hidden * q_out + 2 * s.hidden * kv_out + s.heads * s.head_dim * s.hidden
    if s.qkv_bias:
        params += q_out + 2 * kv_out
    return params + 2 * s.head_dim  # q_norm, k_norm (Qwen3); small either way


def _linear_attention_params(s: ModelShape) -> int:
    la = s.linear
    if la is None:
        return 0
    key_dim, value_dim = la.key_heads * la.key_head_dim, la.value_heads * la.value_head_dim
    in_proj = s.hidden * (2 * key_dim + 2 * value_dim) + s.hidden * 2 * la.value_heads
    conv = (2 * key_dim + value_dim) * la.conv_kernel
    return in_proj + conv + 2 * la.value_heads + la.value_head_dim + value_dim * s.hidden


def _mlp_params(s: ModelShape, layer: int) -> int:
    if not s.moe_layer[layer] or s.moe is None:
        return 3 * s.hidden * s.dense_intermediate
    m = s.moe
    params = m.num_experts * 3 * s.hidden * m.expert_intermediate + s.hidden * m.num_experts
    if m.shared_intermediate:
        params += 3 * s.hidden * m.shared_intermediate + s.hidden  # + the shared expert's gate
    return params


def param_count(s: ModelShape) -> ParamCount:
    embeddings = s.vocab * s.hidden * (1 if s.tie_embeddings else 2)
    attention = sum(_attention_params(s) for kind in s.attention if kind is not Attention.LINEAR)
    linear = sum(_linear_attention_params(s) for kind in s.attention if kind is Attention.LINEAR)
    mlp = sum(_mlp_params(s, i) for i in range(s.layers))
    norms = 2 * s.hidden * s.layers + s.hidden
    total = embeddings + attention + linear + mlp + norms
    return ParamCount(embeddings, attention, linear, mlp, norms, total)


def _lora(rank: int, d_in: int, d_out: int) -> int:
    return rank * (d_in + d_out)


def lora_param_lines(s: ModelShape, rank: int) -> tuple[int, list[str]]:
    """LoRA parameters over every attention and MLP projection (A: r x d_in, B: d_out x r), with
    one line of arithmetic per kind of layer. MoE experts each get their own adapter; routers and
    embeddings get none."""
    lines: list[str] = []
    q_out, kv_out = s.heads * s.head_dim * (2 if s.attn_output_gate else 1), s.kv_heads * s.head_dim
    attn = (
        _lora(rank, s.hidden, q_out)
        + 2 * _lora(rank, s.hidden, kv_out)
        + _lora(rank, s.heads * s.head_dim, s.hidden)
    )
    n_attn = sum(kind is not Attention.LINEAR for kind in s.attention)
    lines.append(
        f"attention per layer: {rank}*(({s.hidden}+{q_out}) + 2*({s.hidden}+{kv_out}) + "
        f"({s.heads * s.head_dim}+{s.hidden})) = {attn:,} x {n_attn} layers = {attn * n_attn:,}"
    )
    total = attn * n_attn
    if s.linear is not None:
        la = s.linear
        key_dim, value_dim = la.key_heads * la.key_head_dim, la.value_heads * la.value_head_dim
        qkvz, ba = 2 * key_dim + 2 * value_dim, 2 * la.value_heads
        lin = (
            _lora(rank, s.hidden, qkvz)
            + _lora(rank, s.hidden, ba)
            + _lora(rank, value_dim, s.hidden)
        )
        n_lin = s.layers - n_attn
        lines.append(
            f"linear attention per layer: {rank}*(({s.hidden}+{qkvz}) + ({s.hidden}+{ba}) + "
            f"({value_dim}+{s.hidden})) = {lin:,} x {n_lin} layers = {lin * n_lin:,}"
        )
        total += lin * n_lin
    n_moe = sum(s.moe_layer)
    if s.layers - n_moe:
        dense = 3 * _lora(rank, s.hidden, s.dense_intermediate)
        lines.append(
            f"dense MLP per layer: 3*{rank}*({s.hidden}+{s.dense_intermediate}) = {dense:,} x "
            f"{s.layers - n_moe} layers = {dense * (s.layers - n_moe):,}"
        )
        total += dense * (s.layers - n_moe)
    if s.moe is not None and n_moe:
        m = s.moe
        experts = m.num_experts * 3 * _lora(rank, s.hidden, m.expert_intermediate)
        shared = 3 * _lora(rank, s.hidden, m.shared_intermediate) if m.shared_intermediate else 0
        lines.append(
            f"MoE per layer: {m.num_experts} experts*3*{rank}*({s.hidden}+{m.expert_intermediate})"
            + (f" + shared 3*{rank}*({s.hidden}+{m.shared_intermediate})" if shared else "")
            + f" = {experts + shared:,} x {n_moe} layers = {(experts + shared) * n_moe:,}"
        )
        total += (experts + shared) * n_moe
    return total, lines
