"""The server half of the protobuf codec against the SDK's own client half (round trips)."""

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from oneloop.backends.megatron_local.serve.codec.forward_backward_encoder import (
    encode_forward_backward_output,
)
from oneloop.backends.megatron_local.serve.codec.reference import decode_forward_backward
from oneloop.backends.megatron_local.serve.codec.sample_encoder import encode_sample_response
from oneloop.errors import WireError


def _request(data, loss_fn="ppo", config=None, seq_id=3):
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="sess-1:train:0",
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req)


def _datum(tokens, weights=None, sparse=False):
    n = len(tokens)
    inputs = {
        "target_tokens": types.TensorData(
            data=np.array(tokens[1:] + [0], np.int64), dtype="int64", shape=[n]
        ),
        "advantages": types.TensorData(
            data=np.linspace(-1, 1, n, dtype=np.float32), dtype="float32", shape=[n]
        ),
        "logprobs": types.TensorData(
            data=-np.arange(n, dtype=np.float32), dtype="float32", shape=[n]
        ),
    }
    if weights is not None:
        inputs["weights"] = types.TensorData(
            data=np.array(weights, np.float32), dtype="float32", shape=[n]
        )
    if sparse:
        dense = np.zeros((3, 4), np.int64)
        dense[0, 1], dense[2, 3] = 7, 9
        import torch

        inputs["extra"] = types.TensorData.from_torch_sparse(torch.from_numpy(dense))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def test_forward_backward_request_round_trip():
    data = [_datum([1, 2, 3, 4], [0, 1, 1, 1]), _datum([5, 6], sparse=True)]
    msg = _request(data, config={"clip_low_threshold": 0.8, "mode": "x"})
    msg.forward_only = True
    decoded = decode_forward_backward(msg.SerializeToString())
    assert (decoded.model_id, decoded.seq_id, decoded.forward_only) == ("sess-1:train:0", 3, True)
    assert decoded.input.loss_fn == "ppo"
    assert decoded.input.loss_fn_config == {"clip_low_threshold": pytest.approx(0.8), "mode": "x"}
    assert decoded.num_tokens == 6
    for got, want in zip(decoded.input.data, data, strict=True):
        assert got.model_input.to_ints() == want.model_input.to_ints()
        assert sorted(got.loss_fn_inputs) == sorted(want.loss_fn_inputs)
        for key, td in want.loss_fn_inputs.items():
            assert got.loss_fn_inputs[key].dtype == td.dtype
            np.testing.assert_array_equal(got.loss_fn_inputs[key].to_numpy(), td.to_numpy())
    sparse = decoded.input.data[1].loss_fn_inputs["extra"]
    assert sparse.sparse_crow_indices is not None


def test_provenance_spans_round_trip():
    datum = _datum([1, 2, 3]).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s/v1/0", length=3)],
        loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="s/v1/0", offset=1, length=3)],
    )
    decoded = decode_forward_backward(_request([datum]).SerializeToString())
    assert decoded.input.data[0].model_input_spans == datum.model_input_spans
    assert decoded.input.data[0].loss_fn_input_spans == datum.loss_fn_input_spans


def _mutated(mutate):
    msg = _request([_datum([1, 2, 3])])
    mutate(msg)
    return msg.SerializeToString()


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda m: setattr(m, "loss_fn", "nope"), "loss_fn"),
        (lambda m: setattr(m, "model_id", ""), "model_id"),
        (lambda m: m.ClearField("data"), "data"),
        (lambda m: setattr(m.data[0].model_input[0].encoded_text, "tokens", b"abc"), "tokens"),
        (
            lambda m: setattr(
                m.data[0].model_input[0].encoded_text, "tokens", np.array([-1], np.int32).tobytes()
            ),
            "tokens",
        ),
        (lambda m: m.data[0].model_input[0].image.SetInParent(), "model_input[0]"),
        (lambda m: m.data[0].loss_fn_inputs["advantages"].shape.append(2), "advantages"),
        (
            lambda m: setattr(m.data[0].loss_fn_inputs["advantages"], "dtype", pb.DTYPE_INT32),
            "dtype",
        ),
        (
            lambda m: setattr(
                m.data[0].loss_fn_inputs["advantages"],
                "dense",
                np.array([1, math.nan, 2], np.float32).tobytes(),
            ),
            "finite",
        ),
        (lambda m: m.loss_fn_config_v2["k"].SetInParent(), "loss_fn_config_v2"),
    ],
)
def test_malformed_forward_backward_names_the_field(mutate, field):
    with pytest.raises(WireError, match=re.escape(field)) as info:
        decode_forward_backward(_mutated(mutate))
    assert info.value.status == 400


def test_bad_sparse_tensor_is_rejected():
    def mutate(m):
        t = m.data[0].loss_fn_inputs["advantages"]
        t.ClearField("shape")
        t.shape.extend([2, 2])
        t.sparse_csr.values = np.ones(2, np.float32).tobytes()
        t.sparse_csr.crow_indices = np.array([0, 1, 5], np.int64).tobytes()
        t.sparse_csr.col_indices = np.array([0, 1], np.int64).tobytes()

    with pytest.raises(WireError, match="sparse_csr"):
        decode_forward_backward(_mutated(mutate))


def test_garbage_body_is_a_wire_error():
    with pytest.raises(WireError, match="protobuf"):
        decode_forward_backward(b"\xff\xff\xff\xff not a proto")


def _output(lengths, extra_field=False):
    outputs = []
    for n in lengths:
        d = {"logprobs": types.TensorData.from_numpy(-np.arange(n, dtype=np.float32) / 7)}
        if extra_field:
            d["topk"] = types.TensorData.from_numpy(np.arange(n * 2, dtype=np.int64).reshape(n, 2))
        outputs.append(d)
    return types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=outputs,
        metrics={"loss:sum": 1.5, "tokens:sum": float(sum(lengths))},
    )


@pytest.mark.parametrize("lengths", [[], [3], [1, 5, 2], [0, 4]])
def test_forward_backward_output_round_trip(lengths):
    out = _output(lengths, extra_field=bool(lengths))
    back = deserialize_forward_backward_output(encode_forward_backward_output(out))
    assert back.metrics == out.metrics
    assert back.loss_fn_output_type == "ArrayRecord"
    assert len(back.loss_fn_outputs) == len(lengths)
    for got, want in zip(back.loss_fn_outputs, out.loss_fn_outputs, strict=True):
        for key, td in want.items():
            assert got[key].dtype == td.dtype
            np.testing.assert_array_equal(got[key].to_numpy(), td.to_numpy())


def test_output_with_different_fields_per_datum_is_refused():
    out = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[
            {"a": types.TensorData(data=[1.0], dtype="float32")},
            {"b": types.TensorData(data=[1.0], dtype="float32")},
        ],
    )
    with pytest.raises(ValueError, match="same fields"):
        encode_forward_backward_output(out)


def test_sample_response_round_trip():
    resp = types.SampleResponse(
        sequences=[
            types.SampledSequence(
                stop_reason="stop",
                sequence_id="x/v2/0",
                tokens_np=np.array([4, 5, 6], np.int32),
                logprobs_np=np.array([-0.5, -1.0, -2.0], np.float32),
            ),
            types.SampledSequence(
                stop_reason="length", sequence_id="x/v2/1", tokens_np=np.array([], np.int32)
            ),
        ],
        _prompt_logprobs_list=[None, -1.25, -3.5],
        _topk_prompt_logprobs_list=[None, [(3, -0.1), (9, -2.0)], [(1, -0.5)]],
        prompt_cache_hit_tokens=2,
    )
    back = deserialize_sample_response(encode_sample_response(resp))
    assert [s.stop_reason for s in back.sequences] == ["stop", "length"]
    assert [s.tokens for s in back.sequences] == [[4, 5, 6], []]
    assert back.sequences[0].logprobs == [-0.5, -1.0, -2.0]
    assert back.sequences[1].logprobs is None
    assert back.prompt_logprobs == [None, -1.25, -3.5]
    assert back.topk_prompt_logprobs == [None, [(3, pytest.approx(-0.1)), (9, -2.0)], [(1, -0.5)]]
    assert back.prompt_cache_hit_tokens == 2


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40), min_size=1, max_size=6),
    st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]),
)
def test_request_round_trip_property(token_lists, loss_fn):
    data = [_datum(t) for t in token_lists]
    decoded = decode_forward_backward(_request(data, loss_fn=loss_fn).SerializeToString())
    assert [d.model_input.to_ints() for d in decoded.input.data] == token_lists
    assert decoded.input.loss_fn == loss_fn


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_the_decoder(body):
    try:
        decode_forward_backward(body)
    except WireError as e:
        assert e.status == 400


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),  # sequences (16 and more take the byte-matrix encoder)
    st.integers(0, 300),  # tokens each (varint lengths of 1 and 2 bytes)
    st.booleans(),  # logprobs
    st.lists(st.sampled_from(["stop", "length"]), min_size=1, max_size=3),
    st.sampled_from([None, [None, -1.5, -0.25]]),
    st.integers(-(2**31), 2**31 - 1),
    st.booleans(),  # one sequence a token shorter (not uniform)
)
def test_sample_response_bytes_parse_to_the_expected_message(
    n, length, with_logprobs, stops, prompt, hits, ragged
):
    """Whichever encoder a response takes (byte matrix for uniform batches, generated class
    otherwise), the bytes parse to the message the fields describe, presence included."""
    rng = np.random.default_rng(n * 1000 + length)
    sequences, want = [], pb.SampleResponse(prompt_cache_hit_tokens=hits)
    for i in range(n):
        size = length - 1 if ragged and i == n - 1 and length else length
        tokens = rng.integers(0, 2**31 - 1, size).astype(np.int32)
        logprobs = -rng.random(size, dtype=np.float32) if with_logprobs else None
        stop = stops[i % len(stops)]
        sequences.append(types.SampledSequence(stop_reason=stop, sequence_id=f"x/v1/{i}",
                                               tokens_np=tokens, logprobs_np=logprobs))
        seq = want.sequences.add(tokens=tokens.tobytes(), stop_reason=pb.STOP_REASON_STOP
                                 if stop == "stop" else pb.STOP_REASON_LENGTH)
        if logprobs is not None:
            seq.logprobs = logprobs.tobytes()
    if prompt is not None:
        want.prompt_logprobs = np.array([math.nan, *prompt[1:]], np.float32).tobytes()
    resp = types.SampleResponse(sequences=sequences, _prompt_logprobs_list=prompt,
                                prompt_cache_hit_tokens=hits)
    body = encode_sample_response(resp)
    assert pb.SampleResponse.FromString(body) == want
    back = deserialize_sample_response(body)
    assert [s.tokens for s in back.sequences] == [s.tokens_np.tolist() for s in sequences]
    assert [s.stop_reason for s in back.sequences] == [s.stop_reason for s in sequences]
    assert back.prompt_logprobs == prompt and back.prompt_cache_hit_tokens == hits
