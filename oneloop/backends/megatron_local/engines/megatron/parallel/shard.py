"""Tensor-parallel shard ⇄ gather maps of Megatron-layout parameters (pure torch; tested in CI).

Operates on the full Megatron-layout tensors `megatron.layout.hf_to_megatron` yields. With TP size
`tp`, rank r of Megatron's local-spec GPTModel (no sequence parallelism) holds:
- column-parallel (output rows split in `tp` contiguous blocks): `linear_qkv` weight and bias,
  `output_layer` and the vocab-parallel `word_embeddings` (rows = vocabulary). The fused qkv block
  is grouped per KV group (see `megatron.layout`), so a contiguous block is whole query groups:
  rank r's q heads with exactly the k/v heads they attend with;
- `linear_fc1` (SwiGLU): rank r's block of gate rows followed by its block of up rows — not a
  contiguous block of the fused [gate; up] tensor;
- row-parallel (input columns split): `linear_proj`, `linear_fc2`;
- replicated: every norm (including QK-norm, whose gradient Megatron sums over the TP group).
"""

import torch

from oneloop.backends.megatron_local.engines.megatron.layout import DenseShape

COLUMN, FC1, ROW, REPLICATED = "column", "fc1", "row", "replicated"

_COLUMN_SUFFIXES = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "output_layer.weight",
    "word_embeddings.weight",
)
_ROW_SUFFIXES = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def tp_kind(name: str) -> str:
    """How parameter `name` (local-spec GPTModel name) is split over tensor-parallel ranks."""
    if name.endswith("mlp.linear_fc1.weight"):
        return FC1
    if name.endswith(_COLUMN_SUFFIXES):
        return COLUMN
    if name.endswith(_ROW_SUFFIXES):
        return ROW
    return REPLICATED


def check_tp(shape: DenseShape, tp: int) -> None:
    """Raise ValueError naming the figure when `shape` cannot be split `tp` ways."""
    if tp < 1:
        raise ValueError(f"local.megatron.tp={tp}: must be >= 1")
    figures = {
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "intermediate_size": shape.ffn,
        "vocab_size": shape.vocab,
    }
    bad = {k: v for k, v in figures.items() if v % tp}
    if bad:
        raise ValueError(
            f"local.megatron.tp={tp} must divide the model's {bad} (Megatron splits heads, KV "
            "groups, the MLP and the vocabulary evenly over tensor-parallel ranks)"
        )


def shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of the full Megatron-layout tensor `name` (a view where possible)."""
    kind = tp_kind(name)
    if tp == 1 or kind == REPLICATED:
        return full
    if kind == COLUMN:
        return torch.chunk(full, tp, dim=0)[rank]
    if kind == ROW:
        return torch.chunk(full, tp, dim=1)[rank]
    gate, up = torch.chunk(full, 2, dim=0)
    return torch.cat([torch.chunk(gate, tp, dim=0)[rank], torch.chunk(up, tp, dim=0)[rank]])


def gather(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor `name` from every rank's part, in rank order (inverse of `shard`)."""
    kind = tp_kind(name)
    if len(shards) == 1 or kind == REPLICATED:
        return shards[0]
    if kind == COLUMN:
        return torch.cat(shards, dim=0)
    if kind == ROW:
        return torch.cat(shards, dim=1)
    halves = [torch.chunk(s, 2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def shard_all(mega: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """`shard` of every tensor of a full Megatron-layout state dict."""
    return {name: shard(name, t, tp, rank) for name, t in mega.items()}


def gather_all(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`gather` of every tensor, given each rank's state dict in rank order."""
    return {name: gather(name, [part[name] for part in per_rank]) for name in per_rank[0]}
