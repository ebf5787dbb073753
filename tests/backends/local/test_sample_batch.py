"""Sample responses with batched sequences (`sample_batch`): the SDK objects they build on access
are the ones the local sampling client built before, and `oneloop serve` encodes them from the
batch into the very bytes the generated message class writes."""

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

from oneloop.backends.megatron_local.engines.base import SampledArrays
from oneloop.backends.megatron_local.sample_batch import (
    SampledBatch,
    SampledSequences,
    build_sequences,
    sample_response,
)
from oneloop.backends.megatron_local.serve.codec import sample_encoder
from oneloop.backends.megatron_local.serve.codec.sample_encoder import encode_sample_response


def _generic(resp: types.SampleResponse) -> bytes:
    """The generated-class encoding of `resp`'s content (SDK objects in a plain list, the joined
    encoder switched off)."""
    plain = types.SampleResponse(
        sequences=list(resp.sequences),
        prompt_logprobs_np=resp.prompt_logprobs_np,
        _prompt_logprobs_list=resp._prompt_logprobs_list,
        prompt_cache_hit_tokens=resp.prompt_cache_hit_tokens,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sample_encoder, "JOIN_MIN_SEQUENCES", 1 << 30)
        return encode_sample_response(plain)


def _engine_sequences(rng: np.random.Generator, lengths: list[int], stops: list[str]
                      ) -> list[SampledArrays]:  # fmt: skip
    return [
        SampledArrays(
            tokens=rng.integers(0, 2**31 - 1, n).astype(np.int32),
            logprobs=-rng.random(n, dtype=np.float32) * 30,
            stop_reason=stop,
        )
        for n, stop in zip(lengths, stops, strict=True)
    ]


@st.composite
def batched(draw):
    """A response as the local sampling client makes it: 1-70 sequences, all one length or
    ragged (empty ones included), stop reasons alike or mixed, with or without prompt
    logprobs; at times rebuilt the way `oneloop serve` cuts prompt logprobs to the last n."""
    n = draw(st.integers(1, 70))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    length = draw(st.integers(0, 300))
    lengths = (
        [length] * n if draw(st.booleans())
        else [int(rng.integers(0, draw(st.integers(1, 300)))) for _ in range(n)]
    )  # fmt: skip
    stops = (
        [draw(st.sampled_from(["stop", "length"]))] * n if draw(st.booleans())
        else [draw(st.sampled_from(["stop", "length"])) for _ in range(n)]
    )  # fmt: skip
    prompt = draw(st.sampled_from([None, np.array([np.nan, -1.5, -0.25], np.float32)]))
    resp = sample_response(_engine_sequences(rng, lengths, stops), prompt, "s-1", 7, 2048)
    if prompt is not None and draw(st.booleans()):
        resp = types.SampleResponse(
            sequences=resp.sequences, _prompt_logprobs_list=[None, None, -0.25]
        )
    return resp


@settings(max_examples=300, deadline=None)
@given(resp=batched())
def test_batched_bytes_are_the_generated_class_bytes(resp):
    assert type(resp.sequences) is SampledSequences
    encoded = encode_sample_response(resp)
    assert encoded == _generic(resp)
    back = deserialize_sample_response(encoded)
    assert [s.tokens for s in back.sequences] == [s.tokens for s in resp.sequences]


def test_encoding_reads_the_batch_and_builds_no_sdk_objects():
    rng = np.random.default_rng(0)
    resp = sample_response(_engine_sequences(rng, [32] * 64, ["length"] * 64), None, "s", 1, 0)
    encoded = encode_sample_response(resp)
    assert resp.sequences._built is None  # the batch alone was read
    back = deserialize_sample_response(encoded)
    assert [s.tokens for s in back.sequences] == [s.tokens for s in resp.sequences]


def test_sequences_are_the_sdk_objects_built_before():
    """Same stop reasons, ids, arrays (the engine's own, not copies) as `build_sequences`, the
    eager conversion the client made before batching."""
    rng = np.random.default_rng(1)
    engine = _engine_sequences(rng, [3, 0, 5], ["stop", "length", "stop"])
    resp = sample_response(engine, None, "sampler-ab", 4, 1024)
    seqs = resp.sequences
    eager = build_sequences(engine, "sampler-ab", 4, 1024)
    assert len(seqs) == 3 and seqs.version == 4
    assert [s.sequence_id for s in seqs] == ["sampler-ab/v4/1024", "sampler-ab/v4/1025",
                                             "sampler-ab/v4/1026"]  # fmt: skip
    assert [s.sequence_id for s in seqs] == [s.sequence_id for s in eager]
    assert all(s.tokens_np is e.tokens and s.logprobs_np is e.logprobs
               for s, e in zip(seqs, engine, strict=True))  # fmt: skip
    assert [s.stop_reason for s in seqs] == ["stop", "length", "stop"]
    assert seqs[1:] == list(seqs)[1:] and seqs[-1] is seqs[2]
    assert seqs == list(seqs) and list(seqs) == seqs and seqs != list(seqs)[:2]
    assert seqs[0] is seqs[0]  # built once
    assert repr(seqs).startswith("[SampledSequence(")
    batch = seqs.batch
    assert batch.tokens.dtype == np.int32 and batch.logprobs.dtype == np.float32
    assert batch.lengths.tolist() == [3, 0, 5] and batch.ends.tolist() == [3, 3, 8]
    assert batch.tokens[3:8].tolist() == engine[2].tokens.tolist()
    assert not batch.uniform


def test_pickled_and_copied_responses_keep_their_sequences():
    rng = np.random.default_rng(2)
    resp = sample_response(_engine_sequences(rng, [4] * 6, ["stop"] * 6), None, "s", 2, 0)
    for other in (pickle.loads(pickle.dumps(resp)), copy.deepcopy(resp)):
        assert type(other.sequences) is SampledSequences
        assert [s.tokens for s in other.sequences] == [s.tokens for s in resp.sequences]
        assert [s.sequence_id for s in other.sequences] == [s.sequence_id for s in resp.sequences]
        assert encode_sample_response(other) == _generic(resp)


@pytest.mark.parametrize("odd", ["logprobs_short", "logprobs_int64", "tokens_int64", "2-D",
                                 "logprobs_missing"])  # fmt: skip
def test_off_contract_engine_output_gets_plain_sdk_objects(odd):
    """Sequences the batch cannot hold (outside the engine contract) are converted at once,
    as before, and encoded by the per-sequence encoders."""
    rng = np.random.default_rng(3)
    engine = _engine_sequences(rng, [4] * 8, ["stop"] * 8)
    last = engine[-1]
    tokens, logprobs = last.tokens, last.logprobs
    if odd == "logprobs_short":
        logprobs = logprobs[:-1]
    elif odd == "logprobs_int64":
        logprobs = logprobs.astype(np.float64)
    elif odd == "tokens_int64":
        tokens = tokens.astype(np.int64)
    elif odd == "2-D":
        tokens, logprobs = tokens.reshape(2, 2), logprobs.reshape(2, 2)
    else:
        logprobs = None
    engine[-1] = SampledArrays(tokens=tokens, logprobs=logprobs, stop_reason="stop")  # type: ignore[arg-type]
    assert SampledBatch.of(engine) is None
    resp = sample_response(engine, None, "s", 1, 0)
    assert type(resp.sequences) is list
    assert encode_sample_response(resp) == _generic(resp)


def test_no_sequences_gets_an_empty_list():
    resp = sample_response([], None, "s", 1, 0)
    assert resp.sequences == [] and encode_sample_response(resp) == b""


def test_serve_checks_a_batch_version_without_building_sdk_objects():
    from oneloop.backends.megatron_local.serve.codec.sample_versions import check_fixed_version

    rng = np.random.default_rng(4)
    resp = sample_response(_engine_sequences(rng, [4] * 8, ["stop"] * 8), None, "s", 2, 0)
    check_fixed_version(resp, 2, "s")
    assert resp.sequences._built is None
    with pytest.raises(RuntimeError, match=r"sequences\[0\]: .* version 3 but .* version 2"):
        check_fixed_version(resp, 3, "s")


def test_serve_ack_reads_a_batch_version_without_building_sdk_objects():
    from oneloop.backends.megatron_local.serve.codec.sample_versions import sampled_versions

    rng = np.random.default_rng(5)
    resp = sample_response(_engine_sequences(rng, [3, 5, 2], ["stop"] * 3), None, "s", 7, 0)
    assert sampled_versions(resp) == [7, 7, 7]
    assert resp.sequences._built is None
    plain = types.SampleResponse(sequences=list(resp.sequences))  # SDK objects: read per id
    assert sampled_versions(plain) == [7, 7, 7]
