"""Protobuf conversion between the Tinker wire format and `tinker.types` (the server side).

The SDK ships the schema as `tinker.proto.tinker_public_pb2` (package `tinker_public`) and only the
client halves of the codec (`request_conv.forward_backward_request_to_proto`,
`response_conv.deserialize_*`). This module owns the other halves:

- `decode_forward_backward(body)`: a `ForwardBackwardRequest` message -> `DecodedForwardBackward`
  (model id, seq id, `forward_only`, and a `tinker.types.ForwardBackwardInput`): the reference
  path, taken for the bodies `proto_scan` (straight to engine arrays) does not take. The datums are
  decoded by `proto_data.decode_data` (batched buffers; token chunks hold `TokenIds`, no Python
  int per token). `loss_fn_config_v2` (number | text) supersedes the legacy float-only
  `loss_fn_config` map when set; the SDK never sends `seq_id` 0 for forward_backward (it uses
  request id + 1).
- `encode_forward_backward_output(out)`: `ForwardBackwardOutput` -> bytes. Per-datum fields are
  packed into `ArrayRecord`s of `BatchedTensor`s (concatenated bytes + int64 byte offsets,
  n + 1 of them, + the trailing shape); the SDK rebuilds each datum's shape as
  `[size / prod(trailing), *trailing]`. Field names must be the same for every datum. The bytes
  are joined straight from the arrays' buffers (no per-datum `tobytes` copy).
- `encode_sample_response(resp)`: `SampleResponse` -> bytes, re-exported from `proto_sample`.

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

from .proto_data import decode_data
from .proto_sample import encode_sample_response as encode_sample_response
from .wire import WireError

_WIRE_DTYPES = (np.dtype(np.float32), np.dtype(np.int64))
_PB_OF_NAME = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
# `custom` needs a loss uploaded through create_custom_loss, which this server does not offer.
LOSS_FNS: frozenset[str] = frozenset(get_args(types.LossFnType)) - {"custom"}


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
