"""Decoding the datums of a `ForwardBackwardRequest` protobuf into `tinker.types.Datum`s (the
reference decoder's datums; `codec.reference` decodes the rest of the request).

Wire facts (the SDK's `request_conv`): each datum's `model_input` is a list of chunks, token chunks
holding packed int32 bytes; each `loss_fn_inputs` tensor is `dense` bytes or `sparse_csr` (values
in the declared dtype, crow/col indices as int64 bytes), dtype FLOAT32 or INT64, with an explicit
shape (a missing shape means 1-D).

Why it is batched: a request carries up to 1,024 datums of up to tens of thousands of tokens, and
the server must not spend Python work per token. So the whole request is decoded in two passes:
the first walks the datums and collects the raw bytes of every token chunk and every dense tensor
(one list per dtype) with their shape checks; then each dtype's bytes are joined into one buffer,
validated in one numpy call (token ids >= 0, floats finite), and every chunk and tensor becomes a
view of that buffer. Token chunks hold `TokenIds` (an int32 array behind `Sequence[int]`), so no
Python int is made per token; the local backend reads them back with `np.asarray`.

Every malformed input raises `WireError` (400) naming the offending field.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from oneloop.backends.megatron_local.serve.codec import reference_types
from oneloop.errors import WireError

NP_OF_DTYPE = {pb.DTYPE_FLOAT32: np.dtype(np.float32), pb.DTYPE_INT64: np.dtype(np.int64)}
NAME_OF_DTYPE = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64"}
# A tensor's declared shape may not promise more elements than this (guards `prod(shape)`).
_MAX_TENSOR_ELEMENTS = 1 << 31


class TokenIds(Sequence[int]):
    """Token ids decoded from the wire: a read-only int32 array behind the `Sequence[int]` that
    `EncodedTextChunk.tokens` declares, so decoding makes no Python object per token.

    Indexing and iteration give Python ints, `np.asarray` takes the array without a copy, and ==
    compares by value with any sequence of ints. Pydantic cannot write it as JSON: decoded
    requests go to the backend, never back onto a JSON wire.
    """

    __slots__ = ("_ids",)

    def __init__(self, ids: np.ndarray) -> None:
        self._ids = ids

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self._ids[index].tolist()
        return int(self._ids[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids.tolist())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if dtype is None or np.dtype(dtype) == self._ids.dtype:
            return self._ids.copy() if copy else self._ids
        if copy is False:
            raise ValueError(f"TokenIds: int32 ids cannot become {dtype} without a copy")
        return self._ids.astype(dtype)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return bool(np.array_equal(self._ids, other._ids))
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == len(self._ids) and self._ids.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares by value like a list

    def __repr__(self) -> str:
        return f"TokenIds({self._ids.tolist()})"


class _Dense(NamedTuple):
    """A dense tensor waiting for its slice of the request's buffer of `dtype`."""

    dtype: int
    size: int
    shape: list[int] | None


_Input = types.TensorData | _Dense
_ITEMSIZE = {dtype: np_dtype.itemsize for dtype, np_dtype in NP_OF_DTYPE.items()}
# One datum waiting for its views: (number of token chunks, [(name, _Dense | sparse TensorData)],
# model_input_spans, loss_fn_input_spans).
_Pending = tuple[int, list[tuple[str, _Input]], list[Any], list[Any]]


def decode_data(msgs: Sequence[pb.Datum]) -> tuple[list[types.Datum], int]:
    """All datums of a request and their number of tokens (see the module docstring)."""
    token_parts: list[bytes] = []
    dense_parts: dict[int, list[bytes]] = {dtype: [] for dtype in NP_OF_DTYPE}
    pending: list[_Pending] = []
    itemsize = _ITEMSIZE
    for i, msg in enumerate(msgs):
        chunks = msg.model_input
        for chunk in chunks:
            raw = chunk.encoded_text.tokens  # b"" when another arm of the oneof is set
            if not raw or len(raw) & 3:
                _check_chunks(msg, i)  # raises unless this is an empty token chunk
            token_parts.append(raw)
        if not chunks:
            raise WireError(f"data[{i}].model_input: at least one chunk is required")
        inputs: list[tuple[str, _Input]] = []
        for name, tensor in msg.loss_fn_inputs.items():
            raw, dtype, shape = tensor.dense, tensor.dtype, tensor.shape
            size = len(raw) // itemsize.get(dtype, 1)
            if raw and dtype in itemsize and size * itemsize[dtype] == len(raw) and (
                not shape or (len(shape) == 1 and shape[0] == size)
            ):  # the usual 1-D dense tensor, checked here in a few comparisons
                dense_parts[dtype].append(raw)
                inputs.append((name, (dtype, size, [size] if shape else None)))  # a _Dense
                continue
            plan, raw = _plan_tensor(tensor, i, name)
            if isinstance(plan, tuple):  # a _Dense
                dense_parts[plan.dtype].append(raw)
            inputs.append((name, plan))
        spans: list[Any] = []
        loss_spans: list[Any] = []
        if msg.model_input_spans or msg.loss_fn_input_spans:
            spans = [_decode_span(s, f"data[{i}].model_input_spans[{k}]")
                     for k, s in enumerate(msg.model_input_spans)]  # fmt: skip
            loss_spans = [_decode_span(s, f"data[{i}].loss_fn_input_spans[{k}]")
                          for k, s in enumerate(msg.loss_fn_input_spans)]  # fmt: skip
            if bool(spans) != bool(loss_spans):
                raise WireError(
                    f"data[{i}]: model_input_spans and loss_fn_input_spans come as a pair"
                )
        pending.append((len(chunks), inputs, spans, loss_spans))

    tokens = np.frombuffer(b"".join(token_parts), dtype=np.int32)  # read-only, shared by views
    if tokens.size and int(tokens.min()) < 0:
        i, j = _token_owner(pending, _part_of(token_parts, 4, int(np.argmax(tokens < 0))))
        raise WireError(f"data[{i}].model_input[{j}].tokens: token ids must be >= 0")
    values: dict[int, np.ndarray] = {}
    for dtype, parts in dense_parts.items():
        # A bytearray join is one copy and leaves the buffer writable, so TensorData keeps the
        # views as they are instead of copying each one.
        values[dtype] = np.frombuffer(bytearray().join(parts), dtype=NP_OF_DTYPE[dtype])
    floats = values[pb.DTYPE_FLOAT32]
    if floats.size and not np.isfinite(floats).all():
        bad = int(np.argmax(~np.isfinite(floats)))
        part = _part_of(dense_parts[pb.DTYPE_FLOAT32], 4, bad)
        i, name = _dense_owner(pending, pb.DTYPE_FLOAT32, part)
        raise WireError(f"data[{i}].loss_fn_inputs[{name!r}]: values must be finite")
    data = _assemble(pending, tokens, [len(p) >> 2 for p in token_parts], values)
    return data, int(tokens.size)


def _check_chunks(msg: pb.Datum, i: int) -> None:
    """Raise for the first chunk of datum `i` that is not a token chunk of whole int32s."""
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(
                f"data[{i}].model_input[{j}]: only token (encoded_text) chunks are "
                f"supported, got {kind or 'an empty chunk'}"
            )
        if len(chunk.encoded_text.tokens) % 4:
            raise WireError(
                f"data[{i}].model_input[{j}].tokens: byte length is not a multiple of 4"
            )


def _token_owner(pending: list[_Pending], part: int) -> tuple[int, int]:
    """(datum, chunk) of the `part`-th token chunk of the request."""
    for i, (n_chunks, *_) in enumerate(pending):
        if part < n_chunks:
            return i, part
        part -= n_chunks
    raise AssertionError("token part out of range")


def _dense_owner(pending: list[_Pending], dtype: int, part: int) -> tuple[int, str]:
    """(datum, input name) of the `part`-th dense tensor of `dtype` in the request."""
    for i, (_, inputs, *_) in enumerate(pending):
        for name, plan in inputs:
            if isinstance(plan, tuple) and plan[0] == dtype:  # a _Dense
                if not part:
                    return i, name
                part -= 1
    raise AssertionError("dense part out of range")


def _assemble(
    pending: list[_Pending],
    tokens: np.ndarray,
    chunk_sizes: list[int],
    values: dict[int, np.ndarray],
) -> list[types.Datum]:
    """The datums, every token chunk and dense tensor a view of the request's buffers. Dense
    plans are `_Dense` or plain (dtype, size, shape) tuples (the decoder's fast path)."""
    rt = reference_types
    token_chunk, model_input, tensor, datum = rt.token_chunk, rt.model_input, rt.tensor, rt.datum
    data: list[types.Datum] = []
    token_at = chunk_index = 0
    value_at = dict.fromkeys(values, 0)
    for i, (n_chunks, inputs, spans, loss_spans) in enumerate(pending):
        if n_chunks == 1:
            end = token_at + chunk_sizes[chunk_index]
            # Checked above (int32, >= 0): no pydantic walk over every id.
            chunks = [token_chunk(TokenIds(tokens[token_at:end]))]
            token_at = end
        else:
            chunks = []
            for size in chunk_sizes[chunk_index : chunk_index + n_chunks]:
                chunks.append(token_chunk(TokenIds(tokens[token_at : token_at + size])))
                token_at += size
        chunk_index += n_chunks
        tensors: dict[str, types.TensorData] = {}
        for name, plan in inputs:
            if isinstance(plan, tuple):
                dtype, size, shape = plan
                at = value_at[dtype]
                value_at[dtype] = at + size
                tensors[name] = tensor(values[dtype][at : at + size], NAME_OF_DTYPE[dtype], shape)
            else:
                tensors[name] = plan
        try:
            data.append(datum(model_input(chunks), tensors, spans or None, loss_spans or None))
        except (ValueError, TypeError, AssertionError) as e:
            raise WireError(f"data[{i}]: {e}") from e
    return data


def _part_of(parts: list[bytes], itemsize: int, element: int) -> int:
    """Index of the part holding `element` of the concatenation of `parts`."""
    ends = np.cumsum([len(p) // itemsize for p in parts])
    return int(np.searchsorted(ends, element, side="right"))


def _plan_tensor(msg: pb.Tensor, datum: int, name: str) -> tuple[_Input, bytes]:
    """A sparse tensor decoded, or a dense one's `_Dense` and its bytes (each read of a bytes
    field copies it, so it is read once). Field paths are formatted only on error."""
    np_dtype = NP_OF_DTYPE.get(msg.dtype)
    if np_dtype is None:
        # proto3 enums keep unknown values: name them by number (`DType.Name` would raise).
        got = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype
        raise _bad(datum, name, f".dtype: must be FLOAT32 or INT64, got {got}")
    shape = list(msg.shape)
    expected = None
    if shape:
        if min(shape) < 0:
            raise _bad(datum, name, f".shape: dimensions must be >= 0, got {shape}")
        expected = math.prod(shape)
        if expected > _MAX_TENSOR_ELEMENTS:
            raise _bad(datum, name, f".shape: {shape} is too large")
    encoding = msg.WhichOneof("encoding")
    if encoding == "sparse_csr":
        where = f"data[{datum}].loss_fn_inputs[{name!r}]"
        return _decode_sparse(msg, np_dtype, shape, where), b""
    raw = msg.dense if encoding == "dense" else b""
    if len(raw) % np_dtype.itemsize:
        raise _bad(datum, name, f".dense: byte length is not a multiple of {np_dtype.itemsize}")
    size = len(raw) // np_dtype.itemsize
    if expected is not None and size != expected:
        raise _bad(datum, name, f": shape {shape} needs {expected} values, got {size}")
    return _Dense(msg.dtype, size, shape or None), raw


def _bad(datum: int, name: str, detail: str) -> WireError:
    return WireError(f"data[{datum}].loss_fn_inputs[{name!r}]{detail}")


def _decode_sparse(
    msg: pb.Tensor, np_dtype: np.dtype, shape: list[int], where: str
) -> types.TensorData:
    csr = msg.sparse_csr
    if len(shape) != 2:
        raise WireError(f"{where}.shape: a sparse CSR tensor needs a 2-D shape, got {shape}")
    for name in ("crow_indices", "col_indices"):
        if len(getattr(csr, name)) % 8:
            raise WireError(f"{where}.sparse_csr.{name}: byte length is not a multiple of 8")
    if len(csr.values) % np_dtype.itemsize:
        raise WireError(f"{where}.sparse_csr.values: byte length is not a multiple of "
                        f"{np_dtype.itemsize}")  # fmt: skip
    crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
    col = np.frombuffer(csr.col_indices, dtype=np.int64)
    values = np.frombuffer(csr.values, dtype=np_dtype)
    rows, cols = shape
    if crow.size != rows + 1 or (crow.size and (crow[0] != 0 or np.any(np.diff(crow) < 0))):
        raise WireError(f"{where}.sparse_csr.crow_indices: must be {rows + 1} non-decreasing "
                        "row pointers starting at 0")  # fmt: skip
    if int(crow[-1]) != col.size or col.size != values.size:
        raise WireError(f"{where}.sparse_csr: crow_indices[-1], len(col_indices) and "
                        "len(values) must agree")  # fmt: skip
    if col.size and (int(col.min()) < 0 or int(col.max()) >= cols):
        raise WireError(f"{where}.sparse_csr.col_indices: must lie in [0, {cols})")
    if np_dtype.kind == "f" and not np.isfinite(values).all():
        raise WireError(f"{where}.sparse_csr.values: values must be finite")
    return types.TensorData(
        data=values,
        dtype=NAME_OF_DTYPE[msg.dtype],  # type: ignore[arg-type]
        shape=shape,
        sparse_crow_indices=crow.tolist(),
        sparse_col_indices=col.tolist(),
    )


def _decode_span(
    msg: pb.ProvenanceSpan, where: str
) -> types.PromptProvenanceSpan | types.SampledProvenanceSpan:
    kind = msg.WhichOneof("span")
    if kind is None:
        raise WireError(f"{where}: empty provenance span")
    arm = getattr(msg, kind)
    cls = types.SampledProvenanceSpan if kind == "sampled_tokens" else types.PromptProvenanceSpan
    try:
        return cls(sequence_id=arm.sequence_id, offset=arm.offset, length=arm.length)
    except ValueError as e:
        raise WireError(f"{where}: {e}") from e
