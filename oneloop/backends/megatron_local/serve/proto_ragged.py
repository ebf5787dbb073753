"""Checking the framing of many datums of different lengths at once (`proto_scan`'s ragged
batches), with no Python work per datum.

A datum in the SDK's form with one token chunk and the inputs of the first datum (same names,
order, dtypes and shape fields) is a fixed sequence of segments: constant bytes (tags, keys,
dtypes), varints whose values follow from the datum's token count T (nested lengths, the
shape), and payloads of `itemsize * T` bytes. So a record's byte width is a strictly increasing
function of T: T is read off every record's width at once (`searchsorted`), every varint's
value computed for every datum, and the bytes every datum must hold outside its payloads
(grouped by the byte widths of their varints) compared with the body in one gather. Equal framing
bytes mean the same parse as the strict reader's, so each payload's offset follows. Any
mismatch gives None and `proto_scan` reads the datums one by one.
"""

from __future__ import annotations

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
_TABLES_MAX = 64  # structures kept (a training run sends one or two)


def _width_table(structure: tuple[tuple[bytes, int, bool], ...], most: int) -> np.ndarray:
    """Record widths for token counts 0..most (at least), cached per structure."""
    table = _TABLES.get(structure)
    if table is None or len(table) <= most:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        size = max(most + 1, 2 * len(table) if table is not None else 0)
        table = _TABLES[structure] = _record_width(list(structure), np.arange(size, dtype=np.int64))
    return table


def ragged_layout(
    body: bytes, starts: np.ndarray, widths: np.ndarray, structure: Structure
) -> tuple[np.ndarray, dict[int, np.ndarray]] | None:
    """Each record's token count and each payload's absolute offsets (key -1: tokens, else the
    input index), for records at `starts` of byte `widths`; None unless every record has the
    framing `structure` implies for its token count."""
    per_token = 4 + sum(_ITEMSIZE[dtype] for _, dtype, _ in structure)
    most = int(widths.max()) // per_token + 1
    table = _width_table(tuple(structure), most)
    t = np.searchsorted(table, widths)
    if (t > most).any() or (t < 1).any() or (table[np.minimum(t, most)] != widths).any():
        return None
    segments = _segments(structure, t)
    bytes_of = np.stack([varint_widths(v) for kind, v in segments if kind == "varint"], axis=1)
    # Records whose varints all have the same widths share one framing layout: group them by a
    # code of the widths (4 bits each) that vary in this batch (usually one or two).
    varying = np.flatnonzero((bytes_of != bytes_of[0]).any(axis=0))
    if len(varying) > 15:
        return None
    code = (bytes_of[:, varying] << (4 * np.arange(len(varying)))).sum(axis=1)
    groups, which = np.unique(code, return_inverse=True)
    offsets: dict[int, np.ndarray] = {}
    data = np.frombuffer(body, np.uint8)
    for group in range(len(groups)):
        rows = np.flatnonzero(which == group) if len(groups) > 1 else np.arange(len(t))
        if not _framing_matches(data, starts[rows], segments, rows, bytes_of[rows[0]], offsets):
            return None
    return t, offsets


def _framing_matches(
    data: np.ndarray,
    starts: np.ndarray,
    segments: list[tuple[str, object]],
    rows: np.ndarray,
    varint_bytes: np.ndarray,
    offsets: dict[int, np.ndarray],
) -> bool:
    """Whether the records at `starts` (datums `rows`, whose varints have `varint_bytes`
    bytes) hold the framing `segments` describe; fills in their payload offsets."""
    at = np.zeros(len(rows), np.int64)
    const_at: list[np.ndarray] = []  # a constant byte's record offset = its base + k
    const_k: list[int] = []
    const_byte: list[int] = []
    varint_at: list[np.ndarray] = []
    varint_byte: list[np.ndarray] = []
    varint = 0
    for kind, value in segments:
        if kind == "const":
            for k, byte in enumerate(value):  # type: ignore[arg-type]
                const_at.append(at)
                const_k.append(k)
                const_byte.append(byte)
            at = at + len(value)  # type: ignore[arg-type]
        elif kind == "varint":
            values = value[rows]  # type: ignore[index]
            count = int(varint_bytes[varint])
            varint += 1
            for j in range(count):
                varint_at.append(at + j)
                varint_byte.append(((values >> (7 * j)) & 0x7F) | (0x80 if j < count - 1 else 0))
            at = at + count
        else:
            key, sizes = value  # type: ignore[misc]
            offsets.setdefault(key, np.zeros(len(sizes), np.int64))
            offsets[key][rows] = starts + at
            at = at + sizes[rows]
    const_columns = np.stack(const_at, axis=1) + np.array(const_k)
    if not (data[starts[:, None] + const_columns] == np.array(const_byte, np.uint8)).all():
        return False
    got = data[starts[:, None] + np.stack(varint_at, axis=1)]
    return bool((got == np.stack(varint_byte, axis=1)).all())


def encode_varint(value: int) -> bytes:
    """The protobuf base-128 varint of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
