"""The fast way from a `/forward_backward` body straight to the trainer engine's arrays.

The reference path (`reference.decode_forward_backward`, then the local client's `datum_to_arrays`)
parses the body with the generated message class, builds a `tinker.types.Datum` per datum and
converts each to `DatumArrays` after `losses.validate_datum_inputs`: tens of microseconds of
Python per datum. `scan_forward_backward` reads the datums' bytes itself and makes the same
`DatumArrays` directly, checked per field over the whole batch:

- The request's top-level fields are walked once. Every field other than `data` (model id, seq
  id, loss, its config: a few bytes) is parsed by the generated class and checked by
  `reference.check_header`, so their meaning is protobuf's own.
- A datum is read by a strict reader that accepts only the form the SDK writes: token chunks
  (non-empty, whole int32s), then `loss_fn_inputs` entries (key, then a dense tensor: bytes,
  dtype, optional 1-D shape, in that order), no spans, no other field.
- When every datum record has the same byte length (equal-length sequences, the usual training
  batch) only the first is read: every other record's bytes outside the payloads (tags, lengths,
  keys, dtypes, shapes) are compared with the first's in one numpy operation. Equal framing bytes
  mean equal structure, so each payload is one strided (datums, length) view of the body.
  Otherwise, from `RAGGED_BATCH_MIN_DATUMS` datums on, the framing of all datums is computed
  from their lengths and checked at once (`fast_ragged`); below that, or if that check
  declines, each datum is read in turn. Either way each field's payloads are then joined.
- Values are checked per field over the batch: token ids and targets >= 0, floats finite; keys
  are exactly `target_tokens` (int64) and the loss's inputs (float32), all of the datum's length.
- The datums are a `fast_batch.DatumList` over the joined arrays: each datum's views are made
  when first read, and the list crosses Ray to the trainer actor as the joined arrays, once.

Anything else (another form, a value the checks refuse, a malformed body) gives None, and the
caller decodes the body on the reference path, which answers as it always did: the same
`WireError` naming the field, or the same accepted request. So this path changes speed, never an
answer (tests/backends/serve/test_codec_fast_scan.py checks it against the reference on random
and edge inputs). Little-endian hosts only, like the reference's `np.frombuffer` reads of the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import sub
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from oneloop.backends.megatron_local.engines.base import DatumArrays
from oneloop.backends.megatron_local.losses import REQUIRED_INPUTS
from oneloop.backends.megatron_local.serve.codec import reference
from oneloop.backends.megatron_local.serve.codec.fast_batch import DatumList, JoinedBatch
from oneloop.backends.megatron_local.serve.codec.fast_ragged import ragged_layout
from oneloop.errors import WireError

_TARGET = b"target_tokens"
_SEQUENCE_MASK = b"sequence_ratio_mask"  # gspo: each datum must mark a token (losses.py)
_INT64, _FLOAT32 = pb.DTYPE_INT64, pb.DTYPE_FLOAT32
_ITEMSIZE = {_FLOAT32: 4, _INT64: 8}
# loss -> {input name (bytes, as on the wire): wire dtype}: what `validate_datum_inputs` accepts
# and `datum_to_arrays` passes through unconverted (other dtypes take the reference path).
_EXPECTED = {
    loss: {_TARGET: _INT64, **{name.encode(): _FLOAT32 for name in inputs}}
    for loss, inputs in REQUIRED_INPUTS.items()
}
_DATA_TAG = 0x1A  # ForwardBackwardRequest field 3 (data), length-delimited
# Below this many datums a ragged batch is read datum by datum: the batch check's fixed numpy
# cost (~60 us) outweighs the ~5 us per datum it saves (thread CPU time, min of 41: 8 datums of
# 50-200 tokens 85 us vs 98 us, 16: 106 vs 162, 64: 231 vs 543; 342 datums of 512-1024 tokens
# ~1.3 ms vs ~2.6 ms).
RAGGED_BATCH_MIN_DATUMS = 8


class _Other(Exception):
    """The body is not in the form this reader takes: use the reference path."""


@dataclass(frozen=True)
class ScannedForwardBackward:
    """A `/forward_backward` body decoded into the trainer engine's arrays."""

    model_id: str
    seq_id: int
    forward_only: bool
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    arrays: list[DatumArrays]  # a `fast_batch.DatumList`
    num_tokens: int

    def submit(self, client: Any) -> Any:
        """Start the call on a local training client (its `forward_backward_arrays`)."""
        return client.forward_backward_arrays(
            self.arrays, self.loss_fn, self.loss_fn_config, self.forward_only
        )


def decode_request(body: bytes) -> ScannedForwardBackward | reference.DecodedForwardBackward:
    """The fast path's result, or the reference decoder's (which raises `WireError`)."""
    return scan_forward_backward(body) or reference.decode_forward_backward(body)


def scan_forward_backward(body: bytes) -> ScannedForwardBackward | None:
    """`body` decoded and checked into engine arrays, or None (see the module docstring)."""
    try:
        header, records = _split(body)
        msg = pb.ForwardBackwardRequest.FromString(header)
        config = reference.check_header(msg, has_data=bool(records.starts))
        expected = _EXPECTED.get(msg.loss_fn)
        if expected is None:
            return None
        arrays, num_tokens = _arrays(body, records, expected)
        if _SEQUENCE_MASK in expected and not all(d.inputs["sequence_ratio_mask"].any()
                                                  for d in arrays):  # fmt: skip
            return None  # a datum marks no token: the reference path names it
    except (_Other, WireError, DecodeError, IndexError, ValueError):
        return None
    return ScannedForwardBackward(
        model_id=msg.model_id, seq_id=msg.seq_id, forward_only=msg.forward_only,
        loss_fn=msg.loss_fn, loss_fn_config=config or None, arrays=arrays,
        num_tokens=num_tokens,
    )  # fmt: skip


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of the base-128 varint at `pos`."""
    byte = buf[pos]
    if byte < 0x80:
        return byte, pos + 1
    value, shift = byte & 0x7F, 7
    while True:
        pos += 1
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos + 1
        shift += 7
        if shift > 63:
            raise _Other


class _Records(NamedTuple):
    """The body's datum records: where each starts (its tag), its payload starts, and it ends."""

    starts: list[int]
    payloads: list[int]
    ends: list[int]


def _split(body: bytes) -> tuple[bytes, _Records]:
    """The request's non-`data` fields as one message, and the datum records."""
    starts: list[int] = []
    payloads: list[int] = []
    ends: list[int] = []
    header: list[bytes] = []
    add_start, add_payload, add_end = starts.append, payloads.append, ends.append
    pos, end = 0, len(body)
    while pos < end:
        start = pos
        if body[pos] == _DATA_TAG:
            byte = body[pos + 1]
            if byte < 0x80:
                at = pos + 2
                pos = at + byte
            elif (second := body[pos + 2]) < 0x80:  # a record of 128 bytes to 16 KiB
                at = pos + 3
                pos = at + ((byte & 0x7F) | second << 7)
            else:
                size, at = _varint(body, pos + 1)
                pos = at + size
            add_start(start)
            add_payload(at)
            add_end(pos)
            continue
        key, pos = _varint(body, pos)
        wire_type = key & 7
        if key >> 3 == 3 or wire_type not in (0, 1, 2, 5):
            raise _Other  # data of another wire type, or a group
        if wire_type == 0:
            pos = _varint(body, pos)[1]
        elif wire_type == 2:
            size, pos = _varint(body, pos)
            pos += size
        else:
            pos += 8 if wire_type == 1 else 4
        header.append(body[start:pos])
    if pos != end:
        raise _Other  # the last field runs past the body
    return b"".join(header), _Records(starts, payloads, ends)


# One datum's layout: token chunks [(offset, bytes)] and inputs [(name, dtype, offset, bytes,
# has a shape field)].
_Layout = tuple[list[tuple[int, int]], list[tuple[bytes, int, int, int, bool]]]


def _read_datum(buf: bytes, pos: int, end: int) -> _Layout:
    """The layout of the datum payload buf[pos:end] in the SDK's form; raises `_Other` (or
    IndexError) for anything else. Offsets are absolute."""
    chunks: list[tuple[int, int]] = []
    inputs: list[tuple[bytes, int, int, int, bool]] = []
    while pos < end:
        tag = buf[pos]
        size, pos = _varint(buf, pos + 1)
        stop = pos + size
        if tag == 0x0A:  # model_input: Chunk{encoded_text: EncodedTextChunk{tokens}}
            if buf[pos] != 0x0A:
                raise _Other
            size, pos = _varint(buf, pos + 1)
            if pos + size != stop or buf[pos] != 0x0A:
                raise _Other
            size, pos = _varint(buf, pos + 1)
            if pos + size != stop or not size or size & 3:
                raise _Other
            chunks.append((pos, size))
        elif tag == 0x12:  # loss_fn_inputs entry: key, then value Tensor{dense, dtype, shape}
            if buf[pos] != 0x0A:
                raise _Other
            size, pos = _varint(buf, pos + 1)
            name = buf[pos : pos + size]
            pos += size
            if buf[pos] != 0x12:
                raise _Other
            size, pos = _varint(buf, pos + 1)
            if pos + size != stop or buf[pos] != 0x0A:
                raise _Other
            size, at = _varint(buf, pos + 1)
            pos = at + size
            dtype = buf[pos + 1]
            if buf[pos] != 0x18 or dtype not in _ITEMSIZE or size % _ITEMSIZE[dtype]:
                raise _Other
            pos += 2
            has_shape = pos < stop
            if has_shape:  # packed int64, one dimension equal to the element count
                if buf[pos] != 0x22:
                    raise _Other
                length, pos = _varint(buf, pos + 1)
                dim, after = _varint(buf, pos)
                if after != pos + length or dim * _ITEMSIZE[dtype] != size:
                    raise _Other
                pos = after
            if pos != stop:
                raise _Other
            inputs.append((name, dtype, at, size, has_shape))
        else:
            raise _Other
        pos = stop
    if pos != end or not chunks:
        raise _Other
    return chunks, inputs


def _check_inputs(layout: _Layout, expected: dict[bytes, int]) -> int:
    """The datum's token count, if its inputs are exactly the loss's, of its length and dtype."""
    chunks, inputs = layout
    tokens = sum(size for _, size in chunks) >> 2
    if len(inputs) != len(expected) or len({name for name, *_ in inputs}) != len(inputs):
        raise _Other
    for name, dtype, _, size, _ in inputs:
        if expected.get(name) != dtype or size != tokens * _ITEMSIZE[dtype]:
            raise _Other
    return tokens


def _arrays(
    body: bytes, records: _Records, expected: dict[bytes, int]
) -> tuple[list[DatumArrays], int]:
    starts, _, ends = records
    layout = _read_datum(body, records.payloads[0], ends[0])
    _check_inputs(layout, expected)  # raises unless the first datum's inputs are the loss's
    width = ends[0] - starts[0]
    uniform = starts[1:] == ends[:-1] and set(map(sub, ends, starts)) == {width}
    same = _uniform(body, starts[0], len(starts), layout, width) if uniform else None
    lengths: list[int] | np.ndarray | None = None  # None: 2-D arrays, one row per datum
    if same is not None:
        tokens, fields = same
    else:  # ragged, or equal widths framed otherwise (e.g. chunked otherwise)
        tokens, fields, lengths = _ragged_batch(body, records, layout) or _ragged(
            body, records, expected
        )
    return DatumList(JoinedBatch(tokens, fields, lengths)), int(tokens.size)


def _checked_tokens(ids: np.ndarray) -> np.ndarray:
    """The int32 token ids, if all are >= 0 (the reference path names the datum and chunk of a
    negative one); `JoinedBatch` makes them int64 where the datums are made."""
    if ids.size and ids.min() < 0:
        raise _Other
    return ids


def _checked(name: bytes, values: np.ndarray) -> np.ndarray:
    """An input's values over the batch, if the reference accepts them: targets >= 0, the
    loss's float inputs finite. Each path checks a field right after it copies it (while it is
    still in cache)."""
    if name == _TARGET:
        if values.size and values.min() < 0:
            raise _Other
    elif not np.isfinite(values).all():
        raise _Other
    return values


def _uniform(
    body: bytes, base: int, count: int, layout: _Layout, width: int
) -> tuple[np.ndarray, dict[bytes, np.ndarray]] | None:
    """Tokens (datums, T) int64 and each input (datums, T), checked, for `count` records of
    one byte `width` laid end to end from `base`, if every record's framing bytes equal the
    first's (else None)."""
    rows = np.frombuffer(body, np.uint8, count=count * width, offset=base)
    rows = rows.reshape(count, width)
    chunks, inputs = layout
    framing = np.ones(width, bool)
    for at, size in chunks:
        framing[at - base : at - base + size] = False
    for _, _, at, size, _ in inputs:
        framing[at - base : at - base + size] = False
    columns = np.flatnonzero(framing)
    heads = rows[:, columns]
    if not (heads[1:] == heads[0]).all():
        return None
    parts = [rows[:, at - base : at - base + size].view(np.int32) for at, size in chunks]
    tokens = _checked_tokens(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1))
    fields = {
        name: _checked(name, rows[:, at - base : at - base + size].view(
            np.int64 if dtype == _INT64 else np.float32).copy())
        for name, dtype, at, size, _ in inputs
    }  # fmt: skip
    return tokens, fields


def _ragged_batch(
    body: bytes, records: _Records, layout: _Layout
) -> tuple[np.ndarray, dict[bytes, np.ndarray], np.ndarray] | None:
    """Like `_ragged`, for datums framed as the first one is (one token chunk; same inputs),
    their framing checked all at once (`fast_ragged`); None for any other batch."""
    chunks, inputs = layout
    if len(chunks) != 1 or len(records.starts) < RAGGED_BATCH_MIN_DATUMS:
        return None
    starts = np.array(records.starts, np.int64)
    widths = np.array(records.ends, np.int64) - starts
    found = ragged_layout(body, starts, widths, [(n, d, s) for n, d, _, _, s in inputs])
    if found is None:
        return None
    t, offsets = found
    sizes = t[:, None] * np.array([4] + [_ITEMSIZE[dtype] for _, dtype, *_ in inputs], np.int64)
    view = memoryview(body)
    spans = zip(offsets.T.tolist(), (offsets + sizes).T.tolist(), strict=True)  # tokens, inputs
    tokens = _checked_tokens(np.frombuffer(_join(b"", view, *next(spans)), np.int32))
    fields = {
        name: _checked(name, np.frombuffer(
            _join(bytearray(), view, *span),  # writable
            np.int64 if dtype == _INT64 else np.float32,
        ))
        for (name, dtype, *_), span in zip(inputs, spans, strict=True)
    }  # fmt: skip
    return tokens, fields, t


def _join(empty: bytes | bytearray, view: memoryview, starts: list[int], ends: list[int]) -> Any:
    """The bytes view[a:b] of every (a, b) of (`starts`, `ends`), joined in one copy (into a
    `bytes` or a `bytearray`, as `empty` is). The slices are made here and dropped on return:
    one field's (~340 for a 256k-token batch) rather than every field's alive at once, so fewer
    objects for the cyclic GC to count and traverse during the call."""
    return empty.join([view[a:b] for a, b in zip(starts, ends, strict=True)])


def _ragged(
    body: bytes, records: _Records, expected: dict[bytes, int]
) -> tuple[np.ndarray, dict[bytes, np.ndarray], list[int] | np.ndarray]:
    """Tokens int64 and each input, checked, all datums joined (datum by datum), and each
    datum's length."""
    view = memoryview(body)
    token_parts: list[memoryview] = []
    parts: dict[bytes, list[memoryview]] = {name: [] for name in expected}
    lengths: list[int] = []
    for start, end in zip(records.payloads, records.ends, strict=True):
        layout = _read_datum(body, start, end)
        lengths.append(_check_inputs(layout, expected))
        for at, size in layout[0]:
            token_parts.append(view[at : at + size])
        for name, _, at, size, _ in layout[1]:
            parts[name].append(view[at : at + size])
    tokens = _checked_tokens(np.frombuffer(b"".join(token_parts), np.int32))
    fields = {
        name: _checked(name, np.frombuffer(bytearray().join(p), np.int64
                       if expected[name] == _INT64 else np.float32))  # one copy, writable
        for name, p in parts.items()
    }  # fmt: skip
    return tokens, fields, lengths
