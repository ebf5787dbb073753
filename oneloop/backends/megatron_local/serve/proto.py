"""Protobuf conversion between the Tinker wire format and `tinker.types` (the server side).

The SDK ships the schema as `tinker.proto.tinker_public_pb2` (package `tinker_public`) and only the
client halves of the codec (`request_conv.forward_backward_request_to_proto`,
`response_conv.deserialize_*`). This module owns the other halves:

- `decode_forward_backward(body)`: a `ForwardBackwardRequest` message -> `DecodedForwardBackward`
  (model id, seq id, `forward_only`, and a `tinker.types.ForwardBackwardInput`). Wire facts: token
  chunks are packed int32 bytes; tensors are `dense` bytes or `sparse_csr` (values in the declared
  dtype, crow/col indices as int64 bytes) with dtype FLOAT32 or INT64 and an explicit shape;
  `loss_fn_config_v2` (number | text) supersedes the legacy float-only `loss_fn_config` map when
  set; the SDK never sends `seq_id` 0 for forward_backward (it uses request id + 1).
- `encode_forward_backward_output(out)`: `ForwardBackwardOutput` -> bytes. Per-datum fields are
  packed into `ArrayRecord`s of `BatchedTensor`s (concatenated bytes + int64 byte offsets,
  n + 1 of them, + the trailing shape); the SDK rebuilds each datum's shape as
  `[size / prod(trailing), *trailing]`. Field names must be the same for every datum.
- `encode_sample_response(resp)`: `SampleResponse` -> bytes. Tokens int32, logprobs float32,
  prompt logprobs float32 with NaN for "not computed"; top-k as dense `(length, k)` matrices with
  the sentinel (token 0, logprob -99999.0) for empty cells. `sequence_id` is not on the wire: the
  SDK stamps the ids from the asample acknowledgement (`sample_sequence_ids`) onto the sequences.

Every malformed input raises `WireError` (400) naming the offending field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import numpy as np
from google.protobuf.message import DecodeError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB, TopkLogprobs

from .wire import WireError

_NP_OF_DTYPE = {pb.DTYPE_FLOAT32: np.dtype(np.float32), pb.DTYPE_INT64: np.dtype(np.int64)}
_NAME_OF_DTYPE = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64"}
_PB_OF_NAME = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
# `custom` needs a loss uploaded through create_custom_loss, which this server does not offer.
LOSS_FNS: frozenset[str] = frozenset(get_args(types.LossFnType)) - {"custom"}
# A tensor's declared shape may not promise more elements than this (guards `prod(shape)`).
_MAX_TENSOR_ELEMENTS = 1 << 31


@dataclass(frozen=True)
class DecodedForwardBackward:
    """A decoded `/forward_backward` body."""

    model_id: str
    seq_id: int
    forward_only: bool
    input: types.ForwardBackwardInput
    num_tokens: int


def decode_forward_backward(body: bytes) -> DecodedForwardBackward:
    """Parse and validate a `ForwardBackwardRequest` protobuf."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise WireError(f"body: not a ForwardBackwardRequest protobuf ({e})") from e
    if not msg.model_id:
        raise WireError("model_id: required")
    if msg.seq_id < 0:
        raise WireError(f"seq_id: must be >= 0, got {msg.seq_id}")
    if msg.loss_fn not in LOSS_FNS:
        raise WireError(f"loss_fn: must be one of {sorted(LOSS_FNS)}, got {msg.loss_fn!r}")
    if not msg.data:
        raise WireError("data: at least one datum is required")
    config: dict[str, float | str] = {}
    if msg.loss_fn_config_v2:
        for key, value in msg.loss_fn_config_v2.items():
            which = value.WhichOneof("value")
            if which is None:
                raise WireError(f"loss_fn_config_v2[{key!r}]: needs a number or a text value")
            config[key] = value.text if which == "text" else value.number
    else:
        config.update(msg.loss_fn_config.items())
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise WireError(f"loss_fn_config[{key!r}]: must be finite, got {value}")
    data = [_decode_datum(d, f"data[{i}]") for i, d in enumerate(msg.data)]
    return DecodedForwardBackward(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        forward_only=msg.forward_only,
        input=types.ForwardBackwardInput(
            data=data, loss_fn=msg.loss_fn, loss_fn_config=config or None  # type: ignore[arg-type]
        ),
        num_tokens=sum(d.model_input.length for d in data),
    )


def _decode_datum(msg: pb.Datum, where: str) -> types.Datum:
    chunks: list[types.EncodedTextChunk] = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(
                f"{where}.model_input[{j}]: only token (encoded_text) chunks are supported, "
                f"got {kind or 'an empty chunk'}"
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"{where}.model_input[{j}].tokens: byte length is not a multiple of 4")
        tokens = np.frombuffer(raw, dtype=np.int32)
        if tokens.size and int(tokens.min()) < 0:
            raise WireError(f"{where}.model_input[{j}].tokens: token ids must be >= 0")
        # Validated above; model_construct skips re-validating every int through pydantic.
        chunks.append(types.EncodedTextChunk.model_construct(tokens=tokens.tolist()))
    if not chunks:
        raise WireError(f"{where}.model_input: at least one chunk is required")
    inputs = {
        name: _decode_tensor(t, f"{where}.loss_fn_inputs[{name!r}]")
        for name, t in msg.loss_fn_inputs.items()
    }
    spans = [_decode_span(s, f"{where}.model_input_spans[{k}]")
             for k, s in enumerate(msg.model_input_spans)]
    loss_spans = [_decode_span(s, f"{where}.loss_fn_input_spans[{k}]")
                  for k, s in enumerate(msg.loss_fn_input_spans)]
    if bool(spans) != bool(loss_spans):
        raise WireError(f"{where}: model_input_spans and loss_fn_input_spans come as a pair")
    try:
        return types.Datum(
            model_input=types.ModelInput.model_construct(chunks=chunks),
            loss_fn_inputs=inputs,
            model_input_spans=spans or None,
            loss_fn_input_spans=loss_spans or None,
        )
    except (ValueError, TypeError, AssertionError) as e:
        raise WireError(f"{where}: {e}") from e


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


def _decode_tensor(msg: pb.Tensor, where: str) -> types.TensorData:
    np_dtype = _NP_OF_DTYPE.get(msg.dtype)
    if np_dtype is None:
        raise WireError(f"{where}.dtype: must be FLOAT32 or INT64, got {pb.DType.Name(msg.dtype)}")
    shape = list(msg.shape)
    if any(s < 0 for s in shape):
        raise WireError(f"{where}.shape: dimensions must be >= 0, got {shape}")
    expected = math.prod(shape) if shape else None
    if expected is not None and expected > _MAX_TENSOR_ELEMENTS:
        raise WireError(f"{where}.shape: {shape} is too large")
    encoding = msg.WhichOneof("encoding")
    if encoding == "sparse_csr":
        return _decode_sparse(msg, np_dtype, shape, where)
    raw = msg.dense if encoding == "dense" else b""
    if len(raw) % np_dtype.itemsize:
        raise WireError(f"{where}.dense: byte length is not a multiple of {np_dtype.itemsize}")
    arr = np.frombuffer(raw, dtype=np_dtype)
    if expected is not None and arr.size != expected:
        raise WireError(f"{where}: shape {shape} needs {expected} values, got {arr.size}")
    if np_dtype.kind == "f" and not np.isfinite(arr).all():
        raise WireError(f"{where}: values must be finite")
    return types.TensorData(data=arr, dtype=_NAME_OF_DTYPE[msg.dtype], shape=shape or None)


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
                        f"{np_dtype.itemsize}")
    crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
    col = np.frombuffer(csr.col_indices, dtype=np.int64)
    values = np.frombuffer(csr.values, dtype=np_dtype)
    rows, cols = shape
    if crow.size != rows + 1 or (crow.size and (crow[0] != 0 or np.any(np.diff(crow) < 0))):
        raise WireError(f"{where}.sparse_csr.crow_indices: must be {rows + 1} non-decreasing "
                        "row pointers starting at 0")
    if int(crow[-1]) != col.size or col.size != values.size:
        raise WireError(f"{where}.sparse_csr: crow_indices[-1], len(col_indices) and "
                        "len(values) must agree")
    if col.size and (int(col.min()) < 0 or int(col.max()) >= cols):
        raise WireError(f"{where}.sparse_csr.col_indices: must lie in [0, {cols})")
    if np_dtype.kind == "f" and not np.isfinite(values).all():
        raise WireError(f"{where}.sparse_csr.values: values must be finite")
    return types.TensorData(
        data=values,
        dtype=_NAME_OF_DTYPE[msg.dtype],
        shape=shape,
        sparse_crow_indices=crow.tolist(),
        sparse_col_indices=col.tolist(),
    )


def encode_forward_backward_output(out: types.ForwardBackwardOutput) -> bytes:
    """Serialize a `ForwardBackwardOutput` the way `response_conv` reads it back."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord")
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    outputs = list(out.loss_fn_outputs)
    if not outputs:
        return msg.SerializeToString()
    names = sorted(outputs[0])
    arrays = [{n: _dense(d[n]) for n in names} for d in _check_same_fields(outputs, names)]
    # One record per run of datums whose fields share dtype and trailing shape.
    start = 0
    while start < len(arrays):
        sig = _signature(arrays[start])
        end = start + 1
        while end < len(arrays) and _signature(arrays[end]) == sig:
            end += 1
        record = msg.loss_fn_outputs.add(type_tag=msg.loss_fn_output_type, num_datums=end - start)
        for name in names:
            group = [a[name] for a in arrays[start:end]]
            offsets = np.zeros(len(group) + 1, dtype=np.int64)
            np.cumsum([g.nbytes for g in group], out=offsets[1:])
            batched = record.fields[name]
            batched.data = b"".join(g.tobytes() for g in group)
            batched.offsets = offsets.tobytes()
            batched.dtype = _PB_OF_NAME[_dtype_name(group[0])]
            batched.trailing_shape.extend(group[0].shape[1:])
        start = end
    return msg.SerializeToString()


def _check_same_fields(
    outputs: list[dict[str, types.TensorData]], names: list[str]
) -> list[dict[str, types.TensorData]]:
    for i, datum in enumerate(outputs):
        if sorted(datum) != names:
            raise ValueError(
                f"loss_fn_outputs[{i}] has fields {sorted(datum)}, loss_fn_outputs[0] has {names}:"
                " the protobuf result needs the same fields for every datum"
            )
    return outputs


def _dense(td: types.TensorData) -> np.ndarray:
    arr = np.ascontiguousarray(td.to_numpy())
    if arr.ndim == 0:
        arr = arr.reshape(1)
    return arr.astype(np.int64 if arr.dtype.kind in "iub" else np.float32, copy=False)


def _dtype_name(arr: np.ndarray) -> str:
    return "int64" if arr.dtype == np.int64 else "float32"


def _signature(fields: dict[str, np.ndarray]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple((n, _dtype_name(a), a.shape[1:]) for n, a in fields.items())


def encode_sample_response(resp: types.SampleResponse) -> bytes:
    """Serialize a `SampleResponse` the way `response_conv.deserialize_sample_response` reads it."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=int(resp.prompt_cache_hit_tokens))
    for i, seq in enumerate(resp.sequences):
        if seq.stop_reason not in _STOP_REASONS:
            raise ValueError(f"sequences[{i}].stop_reason: unknown {seq.stop_reason!r}")
        out = msg.sequences.add(stop_reason=_STOP_REASONS[seq.stop_reason])
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        if seq.logprobs is not None:
            out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk_logprobs is not None:
            _fill_topk(out.topk_sampled_logprobs, _as_topk(seq.topk_logprobs_np,
                                                            seq.topk_logprobs))
    if resp.prompt_logprobs is not None:
        values = resp.prompt_logprobs
        msg.prompt_logprobs = np.array(
            [math.nan if v is None else v for v in values], dtype=np.float32
        ).tobytes()
    if resp.topk_prompt_logprobs is not None:
        _fill_topk(msg.topk_prompt_logprobs,
                   _as_topk(resp.topk_prompt_logprobs_np, resp.topk_prompt_logprobs))
    return msg.SerializeToString()


def _as_topk(
    dense: TopkLogprobs | None, rows: list[list[tuple[int, float]] | None]
) -> TopkLogprobs:
    if dense is not None:
        return dense
    k = max((len(r) for r in rows if r), default=0)
    token_ids = np.zeros((len(rows), k), dtype=np.int32)
    logprobs = np.full((len(rows), k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or []):
            token_ids[i, j], logprobs[i, j] = token, logprob
    return TopkLogprobs(token_ids=token_ids, logprobs=logprobs)


def _fill_topk(msg: pb.TopkLogprobs, topk: TopkLogprobs) -> None:
    length, k = topk.token_ids.shape
    msg.length, msg.k = length, k
    msg.token_ids = np.ascontiguousarray(topk.token_ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(topk.logprobs, dtype=np.float32).tobytes()
