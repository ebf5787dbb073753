"""Checking the framing of many datums of different lengths at once (`fast_scan`'s ragged
batches), with no Python work per datum.

A datum in the SDK's form with one token chunk and the inputs of the first datum (same names,
order, dtypes and shape fields) is a fixed sequence of segments: constant bytes (tags, keys,
dtypes), varints whose values follow from the datum's token count T (nested lengths, the
shape), and payloads of `itemsize * T` bytes. So a record's byte width is a strictly increasing
function of T, and T is read off every record's width at once (`searchsorted` in a table of
widths). A record of T tokens must hold fixed bytes at fixed offsets outside its payloads; those
(offset, byte) pairs are tabled per T (cached per structure, up to `FRAMES_TABLE_MAX_T`), so
the framing of every datum is one table lookup and one gather-and-compare against the body
(~70 us for 340 datums, where a computation per varint-width class took ~650 us). Equal framing
bytes mean the same parse as the strict reader's, so each payload's offset follows. Any
mismatch gives None and `fast_scan` reads the datums one by one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

# A datum's inputs in wire order: (name as on the wire, wire dtype, has a shape field).
Structure = list[tuple[bytes, int, bool]]
_ITEMSIZE = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_INT64: 8}
# A varint of k + 1 bytes holds values from 2**(7 k) on.
_VARINT_LIMITS = np.array([1 << (7 * k) for k in range(1, 9)], np.int64)  # int64 values


def varint_widths(values: np.ndarray) -> np.ndarray:
    """Bytes of the base-128 varint of each (non-negative) value."""
    return np.searchsorted(_VARINT_LIMITS, values, side="right") + 1


def _segments(structure: Structure, t: np.ndarray) -> list[tuple[str, object]]:
    """The datum record for token counts `t`, as ("const", bytes) | ("varint", values) |
    ("payload", (key, byte counts)) in wire order; key -1 is the tokens, else the input index."""
    vw = varint_widths
    tokens = 4 * t
    text = 1 + vw(tokens) + tokens  # EncodedTextChunk
    chunk = 1 + vw(text) + text  # Chunk
    entries: list[tuple[str, object]] = []
    size = 1 + vw(chunk) + chunk
    for index, (name, dtype, has_shape) in enumerate(structure):
        data = _ITEMSIZE[dtype] * t
        tensor = 1 + vw(data) + data + 2 + ((2 + vw(t)) if has_shape else 0)
        key = b"\x0a" + encode_varint(len(name)) + name + b"\x12"
        entry = len(key) + vw(tensor) + tensor
        size = size + 1 + vw(entry) + entry
        entries += [("const", b"\x12"), ("varint", entry), ("const", key),
                    ("varint", tensor), ("const", b"\x0a"), ("varint", data),
                    ("payload", (index, data)), ("const", bytes([0x18, dtype]))]  # fmt: skip
        if has_shape:
            entries += [("const", b"\x22"), ("varint", vw(t)), ("varint", t)]
    return [("const", b"\x1a"), ("varint", size), ("const", b"\x0a"), ("varint", chunk),
            ("const", b"\x0a"), ("varint", text), ("const", b"\x0a"), ("varint", tokens),
            ("payload", (-1, tokens)), *entries]  # fmt: skip


def _record_width(structure: Structure, t: np.ndarray) -> np.ndarray:
    width = np.zeros(t.shape, np.int64)
    for kind, value in _segments(structure, t):
        if kind == "const":
            width += len(value)  # type: ignore[arg-type]
        elif kind == "varint":
            width += varint_widths(value)  # type: ignore[arg-type]
        else:
            width += value[1]  # type: ignore[index]
    return width


_TABLES: dict[tuple[tuple[bytes, int, bool], ...], np.ndarray] = {}
_TABLES_MAX = 8  # structures kept in each cache (a training run sends one or two)


def _width_table(structure: tuple[tuple[bytes, int, bool], ...], most: int) -> np.ndarray:
    """Record widths for token counts 0..most (at least), cached per structure."""
    table = _TABLES.get(structure)
    if table is None or len(table) <= most:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        size = max(most + 1, 2 * len(table) if table is not None else 0)
        table = _TABLES[structure] = _record_width(list(structure), np.arange(size, dtype=np.int64))
    return table


class _Frames(NamedTuple):
    """The framing of records of token counts `t` (one row per count)."""

    offsets: np.ndarray  # (rows, F) int32: record offsets of the framing bytes
    values: np.ndarray  # (rows, F) uint8: the byte each must hold
    payloads: np.ndarray  # (rows, 1 + inputs) int64: record offsets of the tokens, then inputs


# Rows of a shorter varint are padded to the longest one's columns with a check of the record's
# first byte, which is always the data tag (`fast_scan` split the body at it).
_PAD_OFFSET, _PAD_BYTE = 0, 0x1A


def _frames(structure: Structure, t: np.ndarray) -> _Frames:
    """Every framing byte (offset, value) and payload offset of records of token counts `t`."""
    at = np.zeros(t.shape, np.int64)
    offsets: list[np.ndarray] = []
    values: list[np.ndarray | int] = []
    payloads: list[np.ndarray] = []
    for kind, value in _segments(structure, t):
        if kind == "const":
            for k, byte in enumerate(value):  # type: ignore[arg-type]
                offsets.append(at + k)
                values.append(byte)
            at = at + len(value)  # type: ignore[arg-type]
        elif kind == "varint":
            number: np.ndarray = value  # type: ignore[assignment]
            width = varint_widths(number)
            for j in range(int(width.max())):
                byte = ((number >> (7 * j)) & 0x7F) | np.where(j < width - 1, 0x80, 0)
                offsets.append(np.where(j < width, at + j, _PAD_OFFSET))
                values.append(np.where(j < width, byte, _PAD_BYTE))
            at = at + width
        else:
            payloads.append(at)
            at = at + value[1]  # type: ignore[index]
    rows = len(t)
    return _Frames(
        np.stack([np.broadcast_to(o, rows) for o in offsets], axis=1).astype(np.int32),
        np.stack([np.broadcast_to(v, rows) for v in values], axis=1).astype(np.uint8),
        np.stack(payloads, axis=1),
    )


_FRAMES: dict[tuple[tuple[bytes, int, bool], ...], _Frames] = {}
# Token counts below this take their framing from a table cached per structure (2-3 MB at most
# for three inputs); a batch with a longer datum computes its rows' framing itself (~0.2 ms).
FRAMES_TABLE_MAX_T = 4096


def _frame_table(structure: tuple[tuple[bytes, int, bool], ...], most: int) -> _Frames:
    """The framing of token counts 0..most (at least), cached per structure."""
    table = _FRAMES.get(structure)
    if table is None or len(table.offsets) <= most:
        if len(_FRAMES) >= _TABLES_MAX:
            _FRAMES.clear()
        size = max(most + 1, 2 * len(table.offsets) if table is not None else 0)
        size = min(size, FRAMES_TABLE_MAX_T)
        table = _FRAMES[structure] = _frames(list(structure), np.arange(size, dtype=np.int64))
    return table


def ragged_layout(
    body: bytes, starts: np.ndarray, widths: np.ndarray, structure: Structure
) -> tuple[np.ndarray, np.ndarray] | None:
    """Each record's token count, and each payload's absolute offset (records x (1 + inputs):
    the tokens, then the inputs in `structure` order), for records at `starts` of byte
    `widths`; None unless every record has the framing `structure` implies for its token
    count. The framing bytes of all records are compared with the body in one gather."""
    per_token = 4 + sum(_ITEMSIZE[dtype] for _, dtype, _ in structure)
    key = tuple(structure)
    width = _width_table(key, int(widths.max()) // per_token + 1)
    t = np.searchsorted(width, widths)
    if t.min() < 1 or t.max() >= len(width) or (width[t] != widths).any():
        return None
    if t.max() < FRAMES_TABLE_MAX_T:
        table = _frame_table(key, int(t.max()))
        offsets, values, payloads = table.offsets[t], table.values[t], table.payloads[t]
    else:
        offsets, values, payloads = _frames(structure, t)
    data = np.frombuffer(body, np.uint8)
    column = starts[:, None]
    if not (data[column + offsets] == values).all():
        return None
    return t, column + payloads


def encode_varint(value: int) -> bytes:
    """The protobuf base-128 varint of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
