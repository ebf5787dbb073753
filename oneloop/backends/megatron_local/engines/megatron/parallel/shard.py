"""Tensor-parallel shard ⇄ gather maps of Megatron-layout parameters (pure torch; tested in CI).

Operates on the full Megatron-layout tensors `megatron.layout.hf_to_megatron` (dense) and
`megatron.moe.hf_to_megatron` (MoE, hybrids) yield. With TP size `tp`, rank r of Megatron's
local-spec GPTModel holds:
- column-parallel (output rows split in `tp` contiguous blocks): `linear_qkv` weight and bias,
  `output_layer` and the vocab-parallel `word_embeddings` (rows = vocabulary), and a Gated
  DeltaNet's per-head `A_log` and `dt_bias`. The fused qkv block (gated or not) is grouped per KV
  group (see `megatron.layout`, `megatron.moe`), so a contiguous block is whole query groups:
  rank r's q heads with exactly the k/v heads they attend with;
- sectioned column-parallel: a fused tensor whose row sections are each split in `tp` contiguous
  blocks, rank r holding its block of every section in order, not a contiguous block of the
  whole: `linear_fc1` (SwiGLU, the routed-expert-free MLPs and the shared expert: gate | up), a
  Gated DeltaNet's `in_proj` (q | k | v | z | beta | alpha) and `conv1d` (q | k | v). The
  sections come from `sections` (a table by name suffix, `moe.tp_sections`); fc1's are its halves;
- row-parallel (input columns split): `linear_proj`, `linear_fc2`, the shared expert's
  `linear_fc2`, a Gated DeltaNet's `out_proj`;
- replicated: every norm (QK-norm's and, under sequence parallelism, every norm's gradient summed
  over the TP group by Megatron), routers, the shared-expert gate, and the routed experts (expert
  TP 1: each expert whole on its rank).
"""

from collections.abc import Mapping, Sequence

import torch

from oneloop.backends.megatron_local.engines.megatron.layout import DenseShape

COLUMN, SECTIONS, ROW, REPLICATED = "column", "sections", "row", "replicated"

_COLUMN_SUFFIXES = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "output_layer.weight",
    "word_embeddings.weight",
    "self_attention.A_log",
    "self_attention.dt_bias",
)
_ROW_SUFFIXES = (
    "self_attention.linear_proj.weight",
    "mlp.linear_fc2.weight",
    "mlp.shared_experts.linear_fc2.weight",
    "self_attention.out_proj.weight",
)
_FC1_SUFFIXES = ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight")
_SECTIONED_SUFFIXES = _FC1_SUFFIXES + (
    "self_attention.in_proj.weight",
    "self_attention.conv1d.weight",
)
Sections = Mapping[str, Sequence[int]]
"""Row sections of the sectioned tensors by name suffix (full sizes; fc1 needs no entry)."""


def tp_kind(name: str) -> str:
    """How parameter `name` (local-spec GPTModel name) is split over tensor-parallel ranks."""
    if name.endswith(_SECTIONED_SUFFIXES):
        return SECTIONS
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


def section_sizes(name: str, rows: int, sections: Sections | None) -> list[int]:
    """The row sections of sectioned tensor `name` with `rows` rows (full sizes)."""
    for suffix, sizes in (sections or {}).items():
        if name.endswith(suffix):
            if sum(sizes) != rows:
                raise ValueError(
                    f"{name}: {rows} rows, its sections {list(sizes)} sum to {sum(sizes)}"
                )
            return list(sizes)
    if name.endswith(_FC1_SUFFIXES):
        return [rows // 2, rows // 2]
    raise ValueError(f"{name}: no row sections given for its tensor-parallel split")


def shard(
    name: str, full: torch.Tensor, tp: int, rank: int, sections: Sections | None = None
) -> torch.Tensor:
    """Rank `rank`'s part of the full Megatron-layout tensor `name` (a view where possible)."""
    kind = tp_kind(name)
    if tp == 1 or kind == REPLICATED:
        return full
    if kind == COLUMN:
        return torch.chunk(full, tp, dim=0)[rank]
    if kind == ROW:
        return torch.chunk(full, tp, dim=1)[rank]
    parts = torch.split(full, section_sizes(name, full.shape[0], sections))
    return torch.cat([torch.chunk(part, tp, dim=0)[rank] for part in parts])


def gather(name: str, shards: list[torch.Tensor], sections: Sections | None = None) -> torch.Tensor:
    """The full tensor `name` from every rank's part, in rank order (inverse of `shard`)."""
    kind = tp_kind(name)
    tp = len(shards)
    if tp == 1 or kind == REPLICATED:
        return shards[0]
    if kind == COLUMN:
        return torch.cat(shards, dim=0)
    if kind == ROW:
        return torch.cat(shards, dim=1)
    sizes = section_sizes(name, shards[0].shape[0] * tp, sections)
    per_rank = [torch.split(s, [size // tp for size in sizes]) for s in shards]
    return torch.cat([part[i] for i in range(len(sizes)) for part in per_rank], dim=0)


def shard_all(
    mega: dict[str, torch.Tensor], tp: int, rank: int, sections: Sections | None = None
) -> dict[str, torch.Tensor]:
    """`shard` of every tensor of a full Megatron-layout state dict."""
    return {name: shard(name, t, tp, rank, sections) for name, t in mega.items()}


def gather_all(
    per_rank: list[dict[str, torch.Tensor]], sections: Sections | None = None
) -> dict[str, torch.Tensor]:
    """`gather` of every tensor, given each rank's state dict in rank order."""
    return {name: gather(name, [part[name] for part in per_rank], sections) for name in per_rank[0]}
