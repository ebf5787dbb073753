"""Batched decoding of forward_backward datums (`codec.reference_datums`) and the numpy-first
encoders: the same values as the per-element paths, no Python int per token, errors still name
the field."""

import math
import pickle
import re

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_sample_response

from oneloop.backends.megatron_local.sampling_client import token_ids
from oneloop.backends.megatron_local.serve.codec.reference import decode_forward_backward
from oneloop.backends.megatron_local.serve.codec.reference_datums import TokenIds
from oneloop.backends.megatron_local.serve.codec.sample_encoder import encode_sample_response
from oneloop.backends.megatron_local.training_client import datum_to_arrays
from oneloop.errors import WireError


def _datum(chunks: list[list[int]], weights: list[float] | None = None) -> types.Datum:
    n = sum(len(c) for c in chunks)
    weights = [1.0] * n if weights is None else weights
    return types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=c) for c in chunks]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=list(range(n)), dtype="int64", shape=[n]),
            "weights": types.TensorData(data=weights, dtype="float32", shape=[n]),
        },
    )


def _body(data: list[types.Datum]) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id="s:train:0",
        seq_id=1,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_decoded_tokens_are_an_int32_array_behind_a_sequence_of_ints():
    data = [_datum([[5, 6, 7]]), _datum([[1], [2, 3]])]
    decoded = decode_forward_backward(_body(data)).input.data
    chunk = decoded[1].model_input.chunks[1]
    assert isinstance(chunk.tokens, TokenIds)
    assert chunk.tokens == [2, 3] and chunk.tokens != [2, 4] and chunk.tokens != [2]
    assert [type(t) for t in chunk.tokens] == [int, int]
    assert (chunk.tokens[0], chunk.tokens[-1], chunk.tokens[:1]) == (2, 3, [2])
    assert np.asarray(chunk.tokens).dtype == np.int32
    assert not np.asarray(chunk.tokens).flags.writeable
    assert decoded[1].model_input.to_ints() == [1, 2, 3]
    assert pickle.loads(pickle.dumps(chunk.tokens)) == [2, 3]
    with pytest.raises(ValueError, match="copy"):
        np.asarray(chunk.tokens, dtype=np.int64, copy=False)


def test_engine_arrays_match_the_in_process_datum():
    data = [_datum([[9, 8, 7, 6]], [0.0, 1.0, 1.0, 0.5]), _datum([[4, 4], [3]])]
    decoded = decode_forward_backward(_body(data)).input.data
    for i, (got, want) in enumerate(zip(decoded, data, strict=True)):
        a, b = datum_to_arrays(got, "cross_entropy", i), datum_to_arrays(want, "cross_entropy", i)
        assert a.tokens.dtype == b.tokens.dtype == np.int64
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.targets, b.targets)
        np.testing.assert_array_equal(a.inputs["weights"], b.inputs["weights"])
    assert token_ids(types.ModelInput(chunks=[])).shape == (0,)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ([_datum([[1]]), _datum([[2], [3, -4]])], "data[1].model_input[1].tokens"),
        (
            [_datum([[1]]), _datum([[2]]), _datum([[3, 4]], [1.0, math.inf])],
            "data[2].loss_fn_inputs['weights']",
        ),
    ],
)
def test_a_bad_value_found_in_the_joined_buffer_names_its_datum(data, field):
    with pytest.raises(WireError, match=re.escape(field)):
        decode_forward_backward(_body(data))


def test_sample_response_encodes_numpy_and_list_fields_alike():
    tokens, logprobs = [4, 5, 6], [-0.5, -1.0, -2.0]
    prompt = np.array([np.nan, -1.5, -0.25], np.float32)
    from_np = types.SampleResponse(
        sequences=[types.SampledSequence(
            stop_reason="stop", sequence_id="x/v1/0",
            tokens_np=np.array(tokens, np.int32), logprobs_np=np.array(logprobs, np.float32),
        )],  # fmt: skip
        prompt_logprobs_np=prompt,
    )
    from_lists = types.SampleResponse(
        sequences=[types.SampledSequence(
            stop_reason="stop", sequence_id="x/v1/0",
            _tokens_list=tokens, _logprobs_list=logprobs,
        )],  # fmt: skip
        _prompt_logprobs_list=[None, -1.5, -0.25],
    )
    assert encode_sample_response(from_np) == encode_sample_response(from_lists)
    back = deserialize_sample_response(encode_sample_response(from_np))
    assert back.sequences[0].tokens == tokens
    assert back.prompt_logprobs == [None, -1.5, -0.25]


def test_fast_builders_make_the_objects_the_public_constructors_make():
    """The decoder builds chunks, model inputs, tensors and datums without re-validating
    (`codec.reference_types`); with the pinned SDK it must take that path and the objects must be
    the public constructors' (same fields, same behaviour)."""
    from oneloop.backends.megatron_local.serve.codec import reference_types

    assert reference_types.FAST
    ids = TokenIds(np.array([3, 4, 5], np.int32))
    chunk = reference_types.token_chunk(ids)
    assert chunk == types.EncodedTextChunk.model_construct(tokens=ids)
    assert chunk.model_fields_set == {"tokens"} and chunk.type == "encoded_text"
    model_input = reference_types.model_input([chunk])
    assert model_input == types.ModelInput(chunks=[chunk]) and model_input.length == 3
    values = np.array([1.0, 2.0, 0.5], np.float32)
    tensor = reference_types.tensor(values, "float32", [3])
    public = types.TensorData(data=values, dtype="float32", shape=[3])
    assert vars(tensor) == vars(public) and tensor.to_numpy() is values
    grid = reference_types.tensor(np.arange(6, dtype=np.int64), "int64", [2, 3])
    assert grid.to_numpy().shape == (2, 3) and grid.tolist() == [[0, 1, 2], [3, 4, 5]]
    read_only = np.frombuffer(values.tobytes(), np.float32)  # the public path copies it
    assert reference_types.tensor(read_only, "float32", None).to_numpy().flags.writeable
    datum = reference_types.datum(model_input, {"weights": tensor}, None, None)
    assert vars(datum) == vars(types.Datum(model_input=model_input,
                                           loss_fn_inputs={"weights": tensor}))
    with pytest.raises(AssertionError, match="pair"):
        reference_types.datum(model_input, {}, [], None)
