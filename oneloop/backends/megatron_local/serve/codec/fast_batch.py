"""The engine arrays of a `/forward_backward` batch decoded by `fast_scan`, made per datum only
where they are read.

`fast_scan` joins every datum's tokens and inputs into one array per field (one row per datum
when all are of one length). The trainer engine takes a list of per-datum `DatumArrays`, but the
server only hands that list to the trainer actor, and Ray pickles each of its arrays on its own:
for 342 datums (1,026 views) 4.7 ms to pickle and 1.8 ms to unpickle, against ~30 us for the
three joined arrays; making the views in the server (three views, two dicts and an object per
datum) costs another ~0.35 ms. So:

- `JoinedBatch` holds the joined arrays (token ids int32, as on the wire: half the bytes to
  pickle); `datums()` makes the per-datum `DatumArrays` once, all at once (the tokens as int64,
  the engine's dtype; every array a view of a joined one), and caches them.
- `BatchDatum` is a `DatumArrays` that holds only (batch, index) and reads its fields from
  `batch.datums()` when first read.
- `DatumList` is the list of a batch's `BatchDatum`s. Pickled (as Ray does with the actor call's
  argument) it is the batch alone, and it unpickles as a plain list of plain `DatumArrays`. A
  list changed since it was made (or one `BatchDatum`) pickles item by item, each item still as
  a plain `DatumArrays`.

So the engine receives what it always did, and the arrays cross Ray once per call.
"""

from __future__ import annotations

from itertools import repeat
from operator import is_, itemgetter
from typing import Any

import numpy as np

from oneloop.backends.megatron_local.engines.base import DatumArrays

_TARGET = b"target_tokens"
_new = object.__new__
_set = object.__setattr__


class JoinedBatch:
    """Tokens (int32 as on the wire, made int64 with the datums), targets and inputs of every
    datum, flat with `lengths`, or 2-D (one row per datum, `lengths` None); checked by the
    decoder."""

    __slots__ = ("_datums", "fields", "lengths", "tokens")

    def __init__(self, tokens: np.ndarray, fields: dict[bytes, np.ndarray], lengths: Any) -> None:
        self.tokens, self.fields, self.lengths = tokens, fields, lengths
        self._datums: list[DatumArrays] | None = None

    def __len__(self) -> int:
        return len(self.tokens) if self.lengths is None else len(self.lengths)

    def datums(self) -> list[DatumArrays]:
        """One plain `DatumArrays` per datum, its arrays views of the batch's (made once)."""
        if self._datums is None:
            tokens = self.tokens.astype(np.int64)  # the engine's dtype (the wire's is int32)
            self._datums = datum_arrays(tokens, dict(self.fields), self.lengths)
        return self._datums

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.tokens, self.fields, self.lengths)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.tokens, self.fields, self.lengths = state
        self._datums = None


class BatchDatum(DatumArrays):
    """Datum `_index` of `_batch`, its fields read from `_batch.datums()` (module docstring)."""

    __slots__ = ("_batch", "_index")
    _batch: JoinedBatch
    _index: int

    @property
    def tokens(self) -> np.ndarray:  # type: ignore[override]
        return self._batch.datums()[self._index].tokens

    @property
    def targets(self) -> np.ndarray:  # type: ignore[override]
        return self._batch.datums()[self._index].targets

    @property
    def inputs(self) -> dict[str, np.ndarray]:  # type: ignore[override]
        return self._batch.datums()[self._index].inputs

    def __reduce__(self) -> tuple[Any, ...]:
        return _datum_at, (self._batch, self._index)


_set_batch, _set_index = BatchDatum._batch.__set__, BatchDatum._index.__set__  # type: ignore[attr-defined]


def _datum_at(batch: JoinedBatch, index: int) -> DatumArrays:
    return batch.datums()[index]


def _datums_of(batch: JoinedBatch) -> list[DatumArrays]:
    return list(batch.datums())


class DatumList(list[DatumArrays]):
    """The `BatchDatum`s of one batch, in order; pickles as the batch (module docstring)."""

    __slots__ = ("_batch", "_items")

    def __init__(self, batch: JoinedBatch) -> None:
        count = len(batch)
        items = list(map(_new, repeat(BatchDatum, count)))
        list(map(_set_batch, items, repeat(batch)))  # (C-level calls, no per-datum bytecode)
        list(map(_set_index, items, range(count)))
        super().__init__(items)
        self._batch, self._items = batch, items

    def __reduce__(self) -> tuple[Any, ...]:
        items = self._items
        if len(self) == len(items) and all(map(is_, self, items)):
            return _datums_of, (self._batch,)
        return list, (list(self),)


def datum_arrays(
    tokens: np.ndarray, fields: dict[bytes, np.ndarray], lengths: list[int] | np.ndarray | None
) -> list[DatumArrays]:
    """One `DatumArrays` per datum, every array a view of the batch's arrays (`lengths` None:
    2-D arrays, one row per datum); built without the frozen dataclass's per-field
    `__setattr__` (the same fields as `DatumArrays(...)`)."""
    targets = fields.pop(_TARGET)
    names = [name.decode() for name in fields]
    if lengths is None:  # the uniform layout: one row per datum
        columns = [list(tokens), list(targets), *(list(v) for v in fields.values())]
    else:
        ends = np.cumsum(lengths).tolist()
        views = itemgetter(*map(slice, [0, *ends[:-1]], ends))
        columns = [views(flat) for flat in (tokens, targets, *fields.values())]
        if len(lengths) == 1:  # itemgetter of one item gives the item, not a tuple
            columns = [[column] for column in columns]
    if len(names) == 1:
        name = names[0]
        states = [
            {"tokens": ids, "targets": target, "inputs": {name: value}}
            for ids, target, value in zip(*columns, strict=True)
        ]
    else:
        states = [
            {"tokens": ids, "targets": target, "inputs": dict(zip(names, values, strict=True))}
            for ids, target, *values in zip(*columns, strict=True)
        ]
    out = list(map(_new, repeat(DatumArrays, len(states))))
    list(map(_set, out, repeat("__dict__"), states))  # (C-level calls, no per-datum bytecode)
    return out
