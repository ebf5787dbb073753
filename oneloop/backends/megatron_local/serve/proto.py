"""Protobuf conversion between the Tinker wire format and `tinker.types` (the server side).

The SDK ships the schema as `tinker.proto.tinker_public_pb2` (package `tinker_public`) and only the
client halves of the codec (`request_conv.forward_backward_request_to_proto`,
`response_conv.deserialize_*`). This module owns the other halves:

- `decode_forward_backward(body)`: a `ForwardBackwardRequest` message -> `DecodedForwardBackward`
  (model id, seq id, `forward_only`, and a `tinker.types.ForwardBackwardInput`). The datums are
  decoded by `proto_data.decode_data` (batched buffers; token chunks hold `TokenIds`, no Python
  int per token). `loss_fn_config_v2` (number | text) supersedes the legacy float-only
  `loss_fn_config` map when set; the SDK never sends `seq_id` 0 for forward_backward (it uses
  request id + 1).
- `encode_forward_backward_output(out)`: `ForwardBackwardOutput` -> bytes. Per-datum fields are
  packed into `ArrayRecord`s of `BatchedTensor`s (concatenated bytes + int64 byte offsets,
  n + 1 of them, + the trailing shape); the SDK rebuilds each datum's shape as
  `[size / prod(trailing), *trailing]`. Field names must be the same for every datum. The bytes
  are joined straight from the arrays' buffers (no per-datum `tobytes` copy).
- `encode_sample_response(resp)`: `SampleResponse` -> bytes. Tokens int32, logprobs float32,
  prompt logprobs float32 with NaN for "not computed"; top-k as dense `(length, k)` matrices with
  the sentinel (token 0, logprob -99999.0) for empty cells. `sequence_id` is not on the wire: the
  SDK stamps the ids from the asample acknowledgement (`sample_sequence_ids`) onto the sequences.
  The numpy fields (`tokens_np`, `logprobs_np`, `prompt_logprobs_np`) are used when present, so
  the SDK's lazy Python lists are never built. A batch of >= `UNIFORM_MIN_SEQUENCES` sequences
  of one length (every sample ran to `max_tokens`) is written as one byte matrix
  (`_encode_uniform_sequences`); any other response goes through the generated message class.

Every malformed input raises `WireError` (400) naming the offending field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np
from google.protobuf.message import DecodeError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB, TopkLogprobs

from .proto_data import decode_data
from .wire import WireError

_WIRE_DTYPES = (np.dtype(np.float32), np.dtype(np.int64))
_PB_OF_NAME = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
# `custom` needs a loss uploaded through create_custom_loss, which this server does not offer.
LOSS_FNS: frozenset[str] = frozenset(get_args(types.LossFnType)) - {"custom"}
# Below this many sequences the byte-matrix encoder's fixed numpy cost (~10 us) outweighs the
# ~1 us per sequence it saves over the generated class (measured: 8 x 32 tokens 17 us vs 12 us,
# 64 x 32 tokens 50 us vs 85 us).
UNIFORM_MIN_SEQUENCES = 16


@dataclass(frozen=True)
class DecodedForwardBackward:
    """A decoded `/forward_backward` body."""

    model_id: str
    seq_id: int
    forward_only: bool
    input: types.ForwardBackwardInput
    num_tokens: int

    def submit(self, client: Any) -> Any:
        """Start the call on a training client (`forward` or `forward_backward`)."""
        fb = self.input
        call = client.forward if self.forward_only else client.forward_backward
        return call(fb.data, fb.loss_fn, fb.loss_fn_config)


def decode_forward_backward(body: bytes) -> DecodedForwardBackward:
    """Parse and validate a `ForwardBackwardRequest` protobuf (the reference path: `proto_scan`
    decodes the usual bodies straight into engine arrays and falls back to this one)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise WireError(f"body: not a ForwardBackwardRequest protobuf ({e})") from e
    config = check_header(msg, has_data=bool(msg.data))
    data, num_tokens = decode_data(msg.data)
    return DecodedForwardBackward(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        forward_only=msg.forward_only,
        input=types.ForwardBackwardInput(
            data=data, loss_fn=msg.loss_fn, loss_fn_config=config or None  # type: ignore[arg-type]
        ),
        num_tokens=num_tokens,
    )


def check_header(msg: pb.ForwardBackwardRequest, has_data: bool) -> dict[str, float | str]:
    """Check a request's fields other than the datums; its loss config (empty when none)."""
    if not msg.model_id:
        raise WireError("model_id: required")
    if msg.seq_id < 0:
        raise WireError(f"seq_id: must be >= 0, got {msg.seq_id}")
    if msg.loss_fn not in LOSS_FNS:
        raise WireError(f"loss_fn: must be one of {sorted(LOSS_FNS)}, got {msg.loss_fn!r}")
    if not has_data:
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
    return config


def encode_forward_backward_output(out: types.ForwardBackwardOutput) -> bytes:
    """Serialize a `ForwardBackwardOutput` the way `response_conv` reads it back."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord")
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    outputs = list(out.loss_fn_outputs)
    if not outputs:
        return msg.SerializeToString()
    names = sorted(outputs[0])
    arrays = [[_dense(d[n]) for n in names] for d in _check_same_fields(outputs, names)]
    signatures = [tuple((a.dtype, a.shape[1:]) for a in row) for row in arrays]
    # One record per run of datums whose fields share dtype and trailing shape.
    start = 0
    while start < len(arrays):
        end = start + 1
        while end < len(arrays) and signatures[end] == signatures[start]:
            end += 1
        record = msg.loss_fn_outputs.add(type_tag=msg.loss_fn_output_type, num_datums=end - start)
        for column, name in enumerate(names):
            group = [row[column] for row in arrays[start:end]]
            offsets = np.zeros(len(group) + 1, dtype=np.int64)
            np.cumsum([g.nbytes for g in group], out=offsets[1:])
            batched = record.fields[name]
            batched.data = b"".join(group)  # contiguous arrays: joined from their buffers
            batched.offsets = offsets.tobytes()
            batched.dtype = _PB_OF_NAME[_dtype_name(group[0])]
            batched.trailing_shape.extend(group[0].shape[1:])
        start = end
    return msg.SerializeToString()


def _check_same_fields(
    outputs: list[dict[str, types.TensorData]], names: list[str]
) -> list[dict[str, types.TensorData]]:
    keys = set(names)
    for i, datum in enumerate(outputs):
        if datum.keys() != keys:
            raise ValueError(
                f"loss_fn_outputs[{i}] has fields {sorted(datum)}, loss_fn_outputs[0] has {names}:"
                " the protobuf result needs the same fields for every datum"
            )
    return outputs


def _dense(td: types.TensorData) -> np.ndarray:
    arr = td.to_numpy()
    if arr.dtype in _WIRE_DTYPES and arr.ndim == 1 and arr.flags.c_contiguous:
        return arr  # the usual case: a 1-D float32 / int64 array goes as it is
    arr = np.ascontiguousarray(arr)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    return arr.astype(np.int64 if arr.dtype.kind in "iub" else np.float32, copy=False)


def _dtype_name(arr: np.ndarray) -> str:
    return "int64" if arr.dtype == np.int64 else "float32"


def encode_sample_response(resp: types.SampleResponse) -> bytes:
    """Serialize a `SampleResponse` the way `response_conv.deserialize_sample_response` reads it."""
    uniform = _encode_uniform_sequences(resp)
    if uniform is not None:
        return uniform
    msg = pb.SampleResponse(prompt_cache_hit_tokens=int(resp.prompt_cache_hit_tokens))
    for i, seq in enumerate(resp.sequences):
        if seq.stop_reason not in _STOP_REASONS:
            raise ValueError(f"sequences[{i}].stop_reason: unknown {seq.stop_reason!r}")
        out = msg.sequences.add(stop_reason=_STOP_REASONS[seq.stop_reason])
        tokens = seq.tokens_np if seq.tokens_np is not None else seq.tokens
        out.tokens = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        logprobs = seq.logprobs_np if seq.logprobs_np is not None else seq.logprobs
        if logprobs is not None:
            out.logprobs = np.ascontiguousarray(logprobs, dtype=np.float32).tobytes()
        if seq.topk_logprobs is not None:
            _fill_topk(out.topk_sampled_logprobs, _as_topk(seq.topk_logprobs_np,
                                                            seq.topk_logprobs))
    if resp.prompt_logprobs_np is not None:  # NaN already marks "not computed"
        msg.prompt_logprobs = np.ascontiguousarray(resp.prompt_logprobs_np, np.float32).tobytes()
    elif resp.prompt_logprobs is not None:
        values = resp.prompt_logprobs
        msg.prompt_logprobs = np.array(
            [math.nan if v is None else v for v in values], dtype=np.float32
        ).tobytes()
    if resp.topk_prompt_logprobs is not None:
        _fill_topk(msg.topk_prompt_logprobs,
                   _as_topk(resp.topk_prompt_logprobs_np, resp.topk_prompt_logprobs))
    return msg.SerializeToString()


def _encode_uniform_sequences(resp: types.SampleResponse) -> bytes | None:
    """The bytes of a response whose sequences all hold numpy tokens of one length (and all
    numpy logprobs of that length, or none), without top-k; None for any other response.

    Such sequences (every sample ran to `max_tokens`, the usual case of a batch) serialize to
    records of one layout and size, so the whole `sequences` field is one (n, record) byte
    matrix filled column block by column block: field headers broadcast, tokens and logprobs
    written from one `np.concatenate` each. `stop_reason` is written even when it is 0 (an explicit
    default, read the same as an absent one). The rest of the message follows as a second,
    generated-class serialization (concatenated protobuf messages merge)."""
    seqs = resp.sequences
    if len(seqs) < UNIFORM_MIN_SEQUENCES or resp.topk_prompt_logprobs_np is not None or (
        resp.topk_prompt_logprobs is not None
    ):
        return None
    tokens = [seq.tokens_np for seq in seqs]
    logprobs = [seq.logprobs_np for seq in seqs]
    first = tokens[0]
    if first is None or first.ndim != 1 or any(t is None for t in tokens):
        return None
    length = first.shape[0]
    shape = (length,)
    with_logprobs = logprobs[0] is not None
    if (
        any(t.shape != shape for t in tokens)
        or any(seq.topk_logprobs_np is not None or seq.topk_logprobs is not None for seq in seqs)
        or (with_logprobs and any(lp is None or lp.shape != shape for lp in logprobs))
        or (not with_logprobs and any(seq.logprobs is not None for seq in seqs))
    ):
        return None
    try:
        stops = [_STOP_REASONS[seq.stop_reason] for seq in seqs]
    except KeyError:
        return None  # the generated-class path names the sequence
    size = 4 * length
    tok_head = b"\x12" + _varint(size)  # SampledSequence field 2: tokens
    lp_head = b"\x1a" + _varint(size) if with_logprobs else b""  # field 3: logprobs
    body = 2 + len(tok_head) + size + (len(lp_head) + size if with_logprobs else 0)
    head = b"\x0a" + _varint(body)  # SampleResponse field 1: sequences
    out = np.empty((len(seqs), len(head) + body), np.uint8)
    at = len(head)
    out[:, :at] = np.frombuffer(head, np.uint8)
    out[:, at] = 0x08  # field 1: stop_reason
    out[:, at + 1] = stops
    at += 2
    for field, arrays, dtype in ((tok_head, tokens, np.int32), (lp_head, logprobs, np.float32)):
        if not field:
            continue
        out[:, at : at + len(field)] = np.frombuffer(field, np.uint8)
        at += len(field)
        out[:, at : at + size].view(dtype)[:] = np.concatenate(arrays).reshape(len(seqs), -1)
        at += size
    rest = pb.SampleResponse(prompt_cache_hit_tokens=int(resp.prompt_cache_hit_tokens))
    if resp.prompt_logprobs_np is not None:
        rest.prompt_logprobs = np.ascontiguousarray(resp.prompt_logprobs_np, np.float32).tobytes()
    elif resp.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in resp.prompt_logprobs]
        rest.prompt_logprobs = np.array(values, dtype=np.float32).tobytes()
    return b"".join((out.data, rest.SerializeToString()))


def _varint(value: int) -> bytes:
    """The protobuf base-128 varint of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


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
