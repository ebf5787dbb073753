"""Tensor-parallel shard ⇄ gather maps of the `megatron` engine's LoRA adapters (pure torch; CI).

Each adapter follows its base linear's split (`parallel.shard`), so a rank's adapter delta lands on
exactly the rows / columns of the base output it holds:
- column-parallel bases (`linear_qkv`: q/k/v_proj; `linear_fc1`: gate/up_proj; `output_layer`:
  lm_head): A [rank, in] replicated, B [out, rank] split along the output in `tp` contiguous
  blocks. Per HF target that is a plain block: Megatron's fused qkv block is grouped per KV group,
  so rank r's part is its query heads and the k/v heads of their groups — block r of q_proj's,
  k_proj's and v_proj's B each; fc1's rank part is block r of gate then block r of up, which
  `megatron.lora`'s fuser rebuilds from the rank's gate/up blocks over the rank's local shape
  (`local_shape`);
- row-parallel bases (`linear_proj`: o_proj; `linear_fc2`: down_proj): A split along the input
  (the columns the rank's base shard reads), B replicated.
"""

from dataclasses import replace

import torch

from oneloop.backends.megatron_local.engines.megatron.layout import DenseShape

LORA_A, LORA_B = "lora_A", "lora_B"
COLUMN_TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROW_TARGETS = ("o_proj", "down_proj")


def split_dim(target: str, part: str) -> int | None:
    """The dim along which `part` (lora_A / lora_B) of HF target `target` is split; None when it
    is replicated on every tensor-parallel rank."""
    if part not in (LORA_A, LORA_B):
        raise ValueError(f"LoRA part {part!r}: expected {LORA_A} or {LORA_B}")
    if target in COLUMN_TARGETS:
        return 0 if part == LORA_B else None
    if target in ROW_TARGETS:
        return 1 if part == LORA_A else None
    raise ValueError(f"LoRA target {target!r}: expected one of {COLUMN_TARGETS + ROW_TARGETS}")


def is_row_parallel(target: str) -> bool:
    """Whether `target`'s base is row-parallel (its LoRA hidden state needs a TP sum)."""
    split_dim(target, LORA_A)  # validates the name
    return target in ROW_TARGETS


def shard_part(target: str, part: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of the full adapter tensor (a view; the full tensor when replicated)."""
    dim = split_dim(target, part)
    if tp == 1 or dim is None:
        return full
    if full.shape[dim] % tp:
        raise ValueError(f"{target}.{part} {tuple(full.shape)}: dim {dim} does not split {tp} ways")
    return torch.chunk(full, tp, dim=dim)[rank]


def gather_part(target: str, part: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full adapter tensor from every rank's part, in rank order (inverse of `shard_part`)."""
    dim = split_dim(target, part)
    if len(shards) == 1 or dim is None:
        return shards[0]
    return torch.cat(shards, dim=dim)


def full_shape(target: str, part: str, local: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The full tensor's shape given a rank's part shape."""
    dim = split_dim(target, part)
    if dim is None:
        return tuple(local)
    return tuple(n * tp if i == dim else n for i, n in enumerate(local))


def local_shape(shape: DenseShape, tp: int) -> DenseShape:
    """The figures one rank's share of every split linear has (for the per-rank fusers)."""
    if tp == 1:
        return shape
    return replace(
        shape,
        heads=shape.heads // tp,
        kv_heads=shape.kv_heads // tp,
        ffn=shape.ffn // tp,
        vocab=shape.vocab // tp,
    )
