"""How a data-parallel megatron trainer splits a call's datums and merges the replicas' results."""

import numpy as np

from oneloop.backends.megatron_local.engines.base import ForwardResult


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
