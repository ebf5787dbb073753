"""TITO trajectories: prompt checks, digests, datum alignment and the JSON form."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker import types

from oneloop.agents.tito import Segment, TitoError, Trajectory, token_digest
from oneloop.backends.sequence_ids import make_sequence_id


def sampled(tokens, logprobs=None, *, sequence_id="", stop_reason="stop"):
    logprobs = [-0.5 - i for i in range(len(tokens))] if logprobs is None else logprobs
    return types.SampledSequence(
        stop_reason=stop_reason,
        sequence_id=sequence_id,
        tokens_np=np.asarray(tokens, dtype=np.int32),
        logprobs_np=np.asarray(logprobs, dtype=np.float32),
    )


def test_datum_aligns_targets_weights_logprobs_and_advantages():
    t = Trajectory.start([10, 11, 12])
    t = t.append_sampled(sampled([20, 21], [-1.0, -2.0]), prompt=t.model_input())
    t = t.append_observation([30])
    t = t.append_sampled(sampled([40], [-3.0]), prompt=t.model_input())
    assert t.tokens == [10, 11, 12, 20, 21, 30, 40]
    datum = t.to_datum(advantage=0.5)
    assert datum.model_input.to_ints() == [10, 11, 12, 20, 21, 30]
    inputs = datum.loss_fn_inputs
    assert inputs["target_tokens"].tolist() == [11, 12, 20, 21, 30, 40]
    assert inputs["target_tokens"].dtype == "int64"
    assert inputs["weights"].tolist() == [0, 0, 1, 1, 0, 1]
    assert inputs["logprobs"].tolist() == [0, 0, -1.0, -2.0, 0, -3.0]
    assert inputs["advantages"].tolist() == [0, 0, 0.5, 0.5, 0, 0.5]
    assert {v.dtype for k, v in inputs.items() if k != "target_tokens"} == {"float32"}


def test_prompt_must_be_the_concatenation_so_far():
    t = Trajectory.start([1, 2, 3])
    with pytest.raises(TitoError, match="first difference at position 2"):
        t.append_sampled(sampled([4]), prompt=[1, 2, 9])
    with pytest.raises(TitoError, match="2 tokens sent, 3 in the trajectory"):
        t.append_sampled(sampled([4]), prompt=types.ModelInput.from_ints([1, 2]))


def test_version_comes_from_the_sequence_id_else_the_fallback():
    t = Trajectory.start([1])
    with_id = t.append_sampled(
        sampled([2], sequence_id=make_sequence_id("ns", 7, 0)), prompt=[1], fallback_version=3
    )
    assert with_id.segments[-1].version == 7
    without = t.append_sampled(sampled([2], sequence_id="opaque"), prompt=[1], fallback_version=3)
    assert without.segments[-1].version == 3


def test_missing_logprobs_is_an_error():
    seq = types.SampledSequence(
        stop_reason="stop", sequence_id="", tokens_np=np.asarray([5], dtype=np.int32)
    )
    with pytest.raises(TitoError, match="sequence.logprobs"):
        Trajectory.start([1]).append_sampled(seq, prompt=[1])


def test_digest_is_rechecked_when_the_datum_is_built():
    t = Trajectory.start([1]).append_sampled(sampled([2, 3]), prompt=[1])
    corrupted = Segment(
        kind="sampled",
        tokens=(2, 4),
        logprobs=t.segments[1].logprobs,
        version=None,
        digest=t.segments[1].digest,
    )
    bad = Trajectory(segments=(t.segments[0], corrupted), length=3)
    with pytest.raises(TitoError, match=r"segments\[1\]: sampled tokens changed"):
        bad.to_datum(1.0)
    data = t.to_json()
    data["segments"][1]["tokens"] = [2, 4]
    with pytest.raises(TitoError, match="changed since sampling"):
        Trajectory.from_json(data)


def test_digest_is_blake2b_of_int32_bytes():
    assert token_digest([1, 2]) == token_digest(np.asarray([1, 2], dtype=np.int64))
    assert token_digest([1, 2]) != token_digest([2, 1])
    assert len(token_digest([])) == 32


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(format=99), "trajectory.format"),
        (lambda d: d["segments"][1].update(logprobs="x"), r"segments\[1\].logprobs"),
        (lambda d: d["segments"][1].update(kind="weird"), r"segments\[1\].kind"),
        (lambda d: d["segments"][0].update(tokens=[1, -2]), r"segments\[0\].tokens"),
        (lambda d: d["segments"][1].update(version="v"), r"segments\[1\].version"),
        (lambda d: d.update(length=99), "length"),
    ],
)
def test_bad_json_names_the_field(mutate, field):
    data = Trajectory.start([1]).append_sampled(sampled([2]), prompt=[1]).to_json()
    mutate(data)
    with pytest.raises(TitoError, match=field):
        Trajectory.from_json(data)


def test_datum_needs_finite_advantage_and_two_tokens():
    with pytest.raises(TitoError, match="at least 2 tokens"):
        Trajectory.start([1]).to_datum(1.0)
    t = Trajectory.start([1]).append_sampled(sampled([2]), prompt=[1])
    with pytest.raises(TitoError, match="advantage"):
        t.to_datum(float("nan"))


token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=12)
turns = st.lists(
    st.tuples(token_ids, st.lists(st.integers(0, 1000), min_size=1, max_size=5)), max_size=6
)


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 50_000), min_size=1, max_size=10), script=turns,
       advantage=st.floats(-10, 10), version=st.integers(0, 100))  # fmt: skip
def test_json_round_trip_and_datum_invariants(prompt, script, advantage, version):
    t = Trajectory.start(prompt)
    for index, (reply, observation) in enumerate(script):
        seq = sampled(reply, [-(i + 1) / 7 for i in range(len(reply))],
                      sequence_id=make_sequence_id("p", version, index))  # fmt: skip
        t = t.append_sampled(seq, prompt=t.model_input())
        t = t.append_observation(observation)
    back = Trajectory.from_json(json.loads(json.dumps(t.to_json())))
    assert back == t
    if t.length < 2:
        return
    datum = t.to_datum(advantage)
    full = t.tokens
    weights = datum.loss_fn_inputs["weights"].to_numpy()
    assert datum.model_input.to_ints() == full[:-1]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == full[1:]
    assert weights.sum() == t.num_sampled_tokens
    sampled_targets = np.asarray(full[1:])[weights == 1].tolist()
    assert sampled_targets == [tok for s in t.sampled_segments for tok in s.tokens]
    logprobs = datum.loss_fn_inputs["logprobs"].to_numpy()[weights == 1]
    expected = np.asarray([x for s in t.sampled_segments for x in s.logprobs], dtype=np.float32)
    assert np.array_equal(logprobs, expected)
    advantages = datum.loss_fn_inputs["advantages"].to_numpy()
    assert np.array_equal(advantages, (weights * np.float32(advantage)).astype(np.float32))
    assert all(s.version == version for s in t.sampled_segments)
