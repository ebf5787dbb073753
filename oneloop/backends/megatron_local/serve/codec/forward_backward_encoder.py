"""Encoding a `ForwardBackwardOutput` result the way the SDK's `response_conv` reads it back.

Per-datum fields are packed into `ArrayRecord`s of `BatchedTensor`s (concatenated bytes + int64
byte offsets, n + 1 of them, + the trailing shape); the SDK rebuilds each datum's shape as
`[size / prod(trailing), *trailing]`. Field names must be the same for every datum. The bytes
are joined straight from the arrays' buffers (no per-datum `tobytes` copy).
"""

from __future__ import annotations

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

_WIRE_DTYPES = (np.dtype(np.float32), np.dtype(np.int64))
_PB_OF_NAME = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}


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
