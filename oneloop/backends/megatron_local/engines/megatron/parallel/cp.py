"""Context-parallel arithmetic and attention of the `megatron` trainer (pure torch; tested in CI).

Context parallelism (CP) splits every sequence over `cp` ranks. The layout is Megatron's
load-balanced one (megatron-core 0.19 `get_batch_on_this_cp_rank` and RotaryEmbedding's
`get_pos_emb_on_this_cp_rank`): a sequence padded to a multiple of 2·cp is cut into 2·cp equal
chunks and rank r holds chunks r and 2·cp−1−r (one early, one late chunk, so the causal attention
work is even). Every per-token tensor (tokens, targets, mask, loss inputs, global position ids) is
sliced the same way, so Megatron's RoPE slicing and ours agree on each token's position.

Attention without TransformerEngine: each rank all-gathers K and V over the CP group
(`gather_sequence`: an autograd function whose backward sums the dK/dV of every rank and keeps
this rank's part: reduce-scatter on NCCL, all-reduce + slice on gloo, which has no
reduce-scatter), then each of its two query chunks attends to the global prefix ending with that
chunk under a lower-right-aligned causal mask (`cp_attention`: torch SDPA with
`causal_lower_right`, which the flash and memory-efficient kernels take without materialising a
mask). Memory: the gathered K/V is the full sequence per rank (cp× one rank's K/V), the price of
all-gather CP over ring attention; the scores are never materialised on GPU.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def padded_length(length: int, cp: int) -> int:
    """The sequence length rounded up to a multiple of 2·cp (every chunk the same size)."""
    if cp < 1 or length < 1:
        raise ValueError(f"padded_length: need length >= 1 and cp >= 1, got {length}, {cp}")
    step = 2 * cp
    return -(-length // step) * step


def rank_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2·cp) that CP rank `rank` holds, early chunk first."""
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} outside a CP group of size {cp}")
    return rank, 2 * cp - 1 - rank


def rank_positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [seq / cp] (int64) of the tokens CP rank `rank` holds, in its order."""
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not a multiple of 2·cp = {2 * cp}")
    chunk = seq // (2 * cp)
    return torch.cat(
        [torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in rank_chunks(cp, rank)]
    )


def rank_major_order(seq: int, cp: int, device=None) -> torch.Tensor:
    """Global position of each row of the rank-major concatenation of all ranks' shards."""
    return torch.cat([rank_positions(seq, cp, r, device) for r in range(cp)])


def split_for_rank(x: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """This rank's shard of `x` along `dim` (its two chunks, concatenated)."""
    return x.index_select(dim, rank_positions(x.size(dim), cp, rank, x.device))


def merge_shards(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The full tensor in global order from every rank's shard (rank order), along `dim`."""
    cat = torch.cat(shards, dim=dim)
    order = rank_major_order(cat.size(dim), len(shards), cat.device)
    return cat.index_select(dim, torch.argsort(order))


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cp: int,
    rank: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of CP rank `rank`'s queries over the full sequence.

    query [b, heads, 2c, d]: this rank's two chunks (global chunks r and 2cp-1-r);
    key, value [b, kv_heads, 2·cp·c, d]: the whole sequence in global order.
    Returns [b, heads, 2c, d], each query attending exactly to the keys at or before its global
    position. GQA: K/V are repeated to the query heads (the lower-right causal kernels take no
    grouped heads)."""
    if query.size(2) % 2:
        raise ValueError(f"a CP shard holds two equal chunks; got {query.size(2)} rows")
    chunk = query.size(2) // 2
    if key.size(2) != 2 * cp * chunk:
        raise ValueError(f"keys hold {key.size(2)} rows, expected 2·cp·chunk = {2 * cp * chunk}")
    if key.size(1) != query.size(1):
        repeat = query.size(1) // key.size(1)
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)
    outs = []
    for half, index in enumerate(rank_chunks(cp, rank)):
        end = (index + 1) * chunk  # the chunk's last global position + 1
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, half * chunk : (half + 1) * chunk],
                key[:, :, :end],
                value[:, :, :end],
                attn_mask=causal_lower_right(chunk, end),
                scale=scale,
            )
        )
    return torch.cat(outs, dim=2)


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(group.size())]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return parts


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 into global order; backward: sum over ranks, keep this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rows = group, x.size(0)
        return merge_shards(_all_gather(x, group), dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, rows = ctx.group, ctx.rows
        cp, rank = group.size(), group.rank()
        by_rank = grad.index_select(0, rank_major_order(grad.size(0), cp, grad.device))
        by_rank = by_rank.contiguous()
        if torch.distributed.get_backend(group) == "nccl":
            mine = torch.empty_like(by_rank[:rows])
            torch.distributed.reduce_scatter_tensor(mine, by_rank, group=group)
            return mine, None
        torch.distributed.all_reduce(by_rank, group=group)  # gloo: no reduce-scatter
        return by_rank[rank * rows : (rank + 1) * rows].clone(), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The full sequence (dim 0, global order) from every CP rank's shard `x`; differentiable."""
    return _GatherSequence.apply(x, group)


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """[b, shard] → [b, full] in global order over the CP group (no autograd: results only)."""
    with torch.no_grad():
        return merge_shards(_all_gather(x, group), dim=1)
