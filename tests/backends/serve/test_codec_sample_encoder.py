"""The joined `SampleResponse` encoder (`codec.sample_encoder`) writes the very bytes the generated
message class writes, for every response it takes, and leaves every other response to it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

from oneloop.backends.megatron_local.serve.codec import sample_encoder
from oneloop.backends.megatron_local.serve.codec.sample_encoder import encode_sample_response


def _generic(resp: types.SampleResponse, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """The generated-class encoding of `resp` (the joined encoder switched off)."""
    with monkeypatch.context() as patch:
        patch.setattr(sample_encoder, "JOIN_MIN_SEQUENCES", 1 << 30)
        return encode_sample_response(resp)


ODD_TOKENS = ["int64", "2-D", "strided", "list", "none"]


@st.composite
def responses(draw):
    """Mostly responses the joined encoder takes (ragged or equal lengths, with or without
    logprobs, empty sequences), with at times one sequence in a form it must decline."""
    n = draw(st.integers(sample_encoder.JOIN_MIN_SEQUENCES, 24))
    equal = draw(st.booleans())
    length = draw(st.integers(0, 40))
    with_logprobs = draw(st.booleans())
    odd = draw(
        st.sampled_from(
            [None, None, None, "logprobs_missing", "logprobs_short", "topk", *ODD_TOKENS]
        )
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sequences = []
    for i in range(n):
        size = length if equal else int(rng.integers(0, 300))
        tokens = rng.integers(0, 2**31 - 1, size).astype(np.int32)
        logprobs = -rng.random(size, dtype=np.float32) if with_logprobs else None
        extra = {}
        if i == n - 1 and odd is not None:
            if odd == "logprobs_missing":
                logprobs = None if with_logprobs else np.zeros(size, np.float32)
            elif odd == "logprobs_short" and size:
                logprobs = np.zeros(size - 1, np.float32)
            elif odd == "topk":
                extra["_topk_logprobs_list"] = [[(1, -0.5)]] * size
            elif odd == "int64":
                tokens = tokens.astype(np.int64)
            elif odd == "2-D" and size % 2 == 0:
                tokens = tokens.reshape(2, -1)
                logprobs = None if logprobs is None else logprobs.reshape(2, -1)
            elif odd == "strided":
                tokens = np.repeat(tokens, 2)[::2]
            elif odd in ("list", "none"):
                extra["_tokens_list"] = tokens.tolist() if odd == "list" else None
                tokens = None
        stop = draw(st.sampled_from(["stop", "length"]))
        sequences.append(
            types.SampledSequence(
                stop_reason=stop,
                sequence_id=f"x/v1/{i}",
                tokens_np=tokens,
                logprobs_np=logprobs,
                **extra,
            )
        )
    prompt = draw(st.sampled_from([None, [None, -1.5, -0.25]]))
    return types.SampleResponse(
        sequences=sequences,
        _prompt_logprobs_list=prompt,
        prompt_cache_hit_tokens=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=200, deadline=None)
@given(resp=responses())
def test_joined_bytes_are_the_generated_class_bytes(resp):
    with pytest.MonkeyPatch.context() as monkeypatch:
        want = _generic(resp, monkeypatch)
    assert encode_sample_response(resp) == want
    back = deserialize_sample_response(want)
    assert [s.stop_reason for s in back.sequences] == [s.stop_reason for s in resp.sequences]


def test_the_usual_batch_takes_the_joined_encoder():
    rng = np.random.default_rng(0)
    resp = types.SampleResponse(
        sequences=[
            types.SampledSequence(
                stop_reason="length",
                sequence_id=f"x/v1/{i}",
                tokens_np=rng.integers(0, 9, 32).astype(np.int32),
                logprobs_np=-rng.random(32, dtype=np.float32),
            )
            for i in range(64)
        ]
    )
    assert sample_encoder._encode_joined(resp) is not None
    back = deserialize_sample_response(encode_sample_response(resp))
    for got, want in zip(back.sequences, resp.sequences, strict=True):
        assert got.tokens_np.tobytes() == want.tokens_np.tobytes()
        assert got.logprobs_np.tobytes() == want.logprobs_np.tobytes()
        assert got.stop_reason == "length"
    # nothing lazy was built on the way (the SDK's list properties stay uncomputed)
    assert all("tokens" not in vars(s) and "topk_logprobs" not in vars(s) for s in resp.sequences)


def test_an_unknown_stop_reason_is_named_by_the_generated_class():
    seqs = [
        types.SampledSequence(
            stop_reason="stop", sequence_id=f"x/v1/{i}", tokens_np=np.arange(3, dtype=np.int32)
        )
        for i in range(8)
    ]
    object.__setattr__(seqs[5], "stop_reason", "eos")
    with pytest.raises(ValueError, match=r"sequences\[5\]\.stop_reason"):
        encode_sample_response(types.SampleResponse(sequences=seqs))
