"""Building the `tinker.types` a decoded request consists of, without re-validating what the
reference decoder (`codec.reference_datums`) has already checked: quick construction of the
reference path's objects (the fast path, `codec.fast_scan`, builds no `tinker.types` at all).

A `/forward_backward` body holds up to 1,024 datums, and the public constructors cost a few
microseconds each (pydantic's `model_construct` alone ~5 us; `TensorData.__init__` converts
and reshapes; `Datum.__post_init__` coerces every input). The decoder has already checked
everything those constructors would (token ids are int32 >= 0 behind `TokenIds`, tensors are
numpy views of the declared dtype and shape, spans come as a pair), so these builders set the
same attributes directly: the objects are equal, field for field, to the public constructors'.

They rely on the layout of tinker 0.38's types (pydantic models `EncodedTextChunk`,
`ModelInput`; frozen dataclasses `TensorData`, `Datum`). `FAST` is True only when that layout
is the one found at import; otherwise every builder calls the public constructor, which is
slower but always right (tests/backends/serve/test_codec_reference_datums.py checks both give equal
objects).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from tinker import types

_new = object.__new__
_set = object.__setattr__
_TOKENS = frozenset({"tokens"})
_CHUNKS = frozenset({"chunks"})
_NUMPY = {"float32": np.dtype(np.float32), "int64": np.dtype(np.int64)}


def _layout_is_known() -> bool:
    def pydantic_fields(cls: Any) -> list[str]:
        return list(getattr(cls, "model_fields", {}))

    return (
        pydantic_fields(types.EncodedTextChunk) == ["tokens", "type"]
        and pydantic_fields(types.ModelInput) == ["chunks"]
        and not types.EncodedTextChunk.__private_attributes__
        and not types.ModelInput.__private_attributes__
        and [f.name for f in dataclasses.fields(types.TensorData)]
        == ["dtype", "shape", "sparse_crow_indices", "sparse_col_indices", "_numpy"]
        and [f.name for f in dataclasses.fields(types.Datum)]
        == ["model_input", "loss_fn_inputs", "model_input_spans", "loss_fn_input_spans"]
        and not hasattr(types.TensorData, "__slots__")
        and not hasattr(types.Datum, "__slots__")
    )


FAST = _layout_is_known()


def _pydantic(cls: type, values: dict[str, Any], fields_set: frozenset[str]) -> Any:
    obj = _new(cls)
    _set(obj, "__dict__", values)
    _set(obj, "__pydantic_fields_set__", set(fields_set))
    _set(obj, "__pydantic_extra__", None)
    _set(obj, "__pydantic_private__", None)
    return obj


def token_chunk(tokens: Any) -> types.EncodedTextChunk:
    """`EncodedTextChunk(tokens=tokens)` for already-checked token ids."""
    if not FAST:
        return types.EncodedTextChunk.model_construct(tokens=tokens)
    return _pydantic(types.EncodedTextChunk, {"tokens": tokens, "type": "encoded_text"}, _TOKENS)


def model_input(chunks: list[types.EncodedTextChunk]) -> types.ModelInput:
    """`ModelInput(chunks=chunks)` for chunks made by `token_chunk`."""
    if not FAST:
        return types.ModelInput(chunks=chunks)
    return _pydantic(types.ModelInput, {"chunks": chunks}, _CHUNKS)


def tensor(values: np.ndarray, dtype: str, shape: list[int] | None) -> types.TensorData:
    """`TensorData(data=values, dtype=dtype, shape=shape)` for a writable 1-D array already of
    `dtype` (`shape` None or its one dimension), or of `shape` when it has several."""
    if not FAST or values.dtype != _NUMPY[dtype] or not values.flags.writeable:
        return types.TensorData(data=values, dtype=dtype, shape=shape)  # type: ignore[arg-type]
    if shape is not None and len(shape) != 1:
        values = values.reshape(shape)
    out = _new(types.TensorData)
    _set(out, "__dict__", {"dtype": dtype, "shape": shape, "sparse_crow_indices": None,
                           "sparse_col_indices": None, "_numpy": values})  # fmt: skip
    return out


def datum(
    model_input: types.ModelInput,
    loss_fn_inputs: dict[str, types.TensorData],
    model_input_spans: list[Any] | None,
    loss_fn_input_spans: list[Any] | None,
) -> types.Datum:
    """`Datum(...)` for `TensorData` inputs and span lists that come as a pair (or both None)."""
    if not FAST or (model_input_spans is None) != (loss_fn_input_spans is None):
        return types.Datum(model_input=model_input, loss_fn_inputs=loss_fn_inputs,  # type: ignore[arg-type]
                           model_input_spans=model_input_spans,
                           loss_fn_input_spans=loss_fn_input_spans)  # fmt: skip
    out = _new(types.Datum)
    _set(out, "__dict__", {"model_input": model_input, "loss_fn_inputs": loss_fn_inputs,
                           "model_input_spans": model_input_spans,
                           "loss_fn_input_spans": loss_fn_input_spans})  # fmt: skip
    return out
