"""Micro-batching shared by every trainer engine (`torch`, `megatron` and its parallel ranks).

- `pack_microbatches`: greedy packing in datum order under a padded-token budget;
- `padded_arrays`: one micro-batch as right-padded numpy arrays (every engine's input layout);
- `run_microbatches`: run a per-micro-batch callable over the packing and gather per-datum results.
  Losses are sums, so the result does not depend on how the batch was split.
- `LORA_ALPHA`: the LoRA scaling numerator every trainer engine and adapter export uses.
"""

from collections.abc import Callable

import numpy as np

from oneloop.backends.megatron_local import losses
from oneloop.backends.megatron_local.engines.base import DatumArrays, ForwardResult

LORA_ALPHA = 32  # Tinker's service uses a fixed alpha of 32 for every rank.


def pack_microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Greedy packing in order: each group's padded size (count × longest) stays within `budget`."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        new_longest = max(longest, length)
        if current and new_longest * (len(current) + 1) > budget:
            groups.append(current)
            current, new_longest = [], length
        current.append(index)
        longest = new_longest
    if current:
        groups.append(current)
    return groups


def padded_arrays(data: list[DatumArrays], seq: int) -> tuple[np.ndarray, ...]:
    """tokens, targets (int64) and mask (bool) [rows, seq], right-padded with zeros, and the loss
    inputs {key: float32 [rows, seq]} of one micro-batch (every engine's input layout)."""
    shape = (len(data), seq)
    tokens, targets = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    mask = np.zeros(shape, bool)
    inputs = {k: np.zeros(shape, np.float32) for k in sorted(data[0].inputs)}
    for row, datum in enumerate(data):
        n = len(datum.tokens)
        tokens[row, :n], targets[row, :n], mask[row, :n] = datum.tokens, datum.targets, True
        for key, values in inputs.items():
            values[row, :n] = datum.inputs[key]
    return tokens, targets, mask, inputs


def run_microbatches(
    data: list[DatumArrays],
    budget: int,
    microbatch: Callable[[list[DatumArrays]], tuple["losses.LossResult", np.ndarray]],
) -> ForwardResult:
    """Split `data` by `pack_microbatches`, run `microbatch` on each (it returns the loss result
    and padded target logprobs [rows, T]) and gather per-datum logprobs, losses and summed
    metrics in datum order. Shared by every trainer engine: losses are sums, so the result does
    not depend on how the batch was split."""
    lengths = [len(d.tokens) for d in data]
    logprobs: list[np.ndarray] = [np.empty(0, np.float32)] * len(data)
    per_datum: list[float] = [0.0] * len(data)
    metric_sums: dict[str, float] = {}
    for group in pack_microbatches(lengths, budget):
        result, lp = microbatch([data[i] for i in group])
        for row, index in enumerate(group):
            logprobs[index] = lp[row, : lengths[index]].copy()
            per_datum[index] = float(result.per_datum[row])
        for key, value in result.metrics.items():
            metric_sums[key] = metric_sums.get(key, 0.0) + value
    return ForwardResult(logprobs, float(sum(per_datum)), per_datum, metric_sums)
