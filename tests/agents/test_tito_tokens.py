"""The trajectory's cached token tuple: prompt checks by identity or by value, pickling, and
trajectories built directly from segments."""

import pickle

import numpy as np
import pytest
from tinker import types

from oneloop.agents.tito import Segment, TitoError, Trajectory


def _sampled(tokens: list[int]) -> types.SampledSequence:
    return types.SampledSequence(
        stop_reason="stop",
        sequence_id="",
        tokens_np=np.asarray(tokens, dtype=np.int32),
        logprobs_np=np.full(len(tokens), -0.5, dtype=np.float32),
    )


def _two_turns() -> Trajectory:
    t = Trajectory.start([1, 2, 3])
    t = t.append_sampled(_sampled([4, 5]), prompt=t.model_input())
    return t.append_observation([6, 7])


def test_any_prompt_equal_to_the_trajectory_is_accepted_and_others_refused():
    t = _two_turns()
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert t.tokens == tokens and t.model_input().to_ints() == tokens
    chunked = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=tokens[:3]),
                                       types.EncodedTextChunk(tokens=tokens[3:])])  # fmt: skip
    for prompt in (t.model_input(), tokens, types.ModelInput.from_ints(tokens),
                   np.asarray(tokens, dtype=np.int64), chunked):  # fmt: skip
        t.check_prompt(prompt)
    for wrong in (tokens[:-1], [*tokens[:-1], 8], [*tokens, 8]):
        with pytest.raises(TitoError, match="first difference"):
            t.check_prompt(wrong)


def test_a_mutated_model_input_list_is_still_checked_by_value():
    t = _two_turns()
    prompt = types.ModelInput.from_ints(t.tokens)
    prompt.chunks[0].tokens[-1] = 99  # a list the caller owns and changed after building
    with pytest.raises(TitoError, match="position 6"):
        t.append_sampled(_sampled([8]), prompt=prompt)


def test_pickle_leaves_the_cache_behind_and_rebuilds_it():
    t = _two_turns()
    state = t.__getstate__()
    assert "_all_tokens" not in state
    back = pickle.loads(pickle.dumps(t))
    assert back == t and back.tokens == t.tokens
    back.check_prompt(back.model_input())


def test_a_trajectory_built_from_segments_has_the_same_tokens():
    t = _two_turns()
    rebuilt = Trajectory(segments=t.segments, length=t.length)
    assert rebuilt.tokens == t.tokens
    assert rebuilt.to_datum(1.0).model_input.to_ints() == t.tokens[:-1]
    assert Trajectory(segments=(Segment("prompt", (3, 4)),), length=2).tokens == [3, 4]
