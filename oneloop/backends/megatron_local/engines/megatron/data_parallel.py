"""How a data-parallel megatron trainer splits a call's datums and merges the replicas' results."""

import numpy as np

from oneloop.backends.megatron_local import losses
from oneloop.backends.megatron_local.engines.base import DatumArrays, ForwardResult
from oneloop.backends.megatron_local.engines.microbatch import pack_microbatches


def validate_everywhere(loss_fn: str, data: list[DatumArrays]) -> None:
    """Every datum's loss inputs checked on every rank before any collective: an input error
    raised by one replica or stage alone would leave the others waiting."""
    for index, datum in enumerate(data):
        inputs = {"target_tokens": datum.targets, **datum.inputs}
        losses.validate_datum_inputs(loss_fn, len(datum.tokens), inputs, index)


def microbatch_counts(data: list[DatumArrays], shares: list[list[int]], budget: int) -> list[int]:
    """Token-budget micro-batches each replica's share packs into (`pack_microbatches`)."""
    return [len(pack_microbatches([len(data[i].tokens) for i in s], budget)) for s in shares]


def dp_shares(lengths: list[int], dp: int) -> list[list[int]]:
    """Datum indices per data-parallel replica, balanced by token count: longest first, each to
    the replica with the fewest tokens so far (ties: the lower replica); each share in datum
    order. Deterministic, so every rank computes the same split."""
    shares: list[list[int]] = [[] for _ in range(dp)]
    tokens = [0] * dp
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        replica = min(range(dp), key=lambda r: (tokens[r], r))
        shares[replica].append(index)
        tokens[replica] += lengths[index]
    return [sorted(share) for share in shares]


def merge_shares(results: list[ForwardResult], shares: list[list[int]], n: int) -> ForwardResult:
    """The whole call's result from each replica's (`dp_shares` order): per-datum logprobs and
    losses in datum order, the loss and metrics summed (Tinker's sums)."""
    logprobs: list[np.ndarray] = [np.empty(0, np.float32)] * n
    per_datum = [0.0] * n
    metrics: dict[str, float] = {}
    for result, share in zip(results, shares, strict=True):
        for row, index in enumerate(share):
            logprobs[index], per_datum[index] = result.logprobs[row], result.per_datum_loss[row]
        for key, value in result.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    return ForwardResult(logprobs, float(sum(per_datum)), per_datum, metrics)


def gather_shares(mine: ForwardResult, shares: list[list[int]], n: int) -> ForwardResult:
    """The whole call's result on every rank from each replica's for its share (an all-gather
    over this rank's data-parallel group; every rank calls it)."""
    import torch
    from megatron.core import parallel_state

    every: list = [None] * len(shares)
    group = parallel_state.get_data_parallel_group()
    torch.distributed.all_gather_object(every, mine, group=group)
    return merge_shares(every, shares, n)
