"""The OpenAI-compatible TITO gateway on the real local backend (tiny model) and the official
`openai` client: well-formed answers, exact token accounting, segments, 4xx on bad input."""

import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oneloop.agents.gateway import Gateway, GatewayConfig, SamplingDefaults
from oneloop.agents.gateway.render import reply_message
from oneloop.agents.tito import Trajectory

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                     "b": {"type": "number"}}},
}}]  # fmt: skip


@pytest.fixture(scope="module")
def gateway(local_service, tiny_model_path):
    from oneloop.tiny.model import TINY_MODEL_NAME

    client = local_service.create_sampling_client(base_model=TINY_MODEL_NAME).result()
    config = GatewayConfig(
        tokenizer_path=str(tiny_model_path), max_sessions=24,
        defaults=SamplingDefaults(context_window=1024, max_tokens=16, request_timeout_s=120),
    )  # fmt: skip
    with Gateway(config, client) as gw:
        yield gw


def client_for(gateway, session):
    return openai.OpenAI(base_url=gateway.session_url(session), api_key="x", max_retries=0)


def segments(gateway, session):
    return httpx.get(f"{gateway.base_url}/sessions/{session}", timeout=30).json()


def test_openai_client_chat_stream_n_and_completions(gateway):
    oa = client_for(gateway, "chat")
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    whole = oa.chat.completions.create(
        model="oneloop", messages=messages, tools=TOOLS, seed=7, max_tokens=12,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = whole.choices[0]
    assert choice.finish_reason in {"stop", "length", "tool_calls"}
    assert choice.message.role == "assistant"
    assert whole.usage.completion_tokens == len(choice.token_ids) <= 12
    # Streaming, same seed and prompt (a fresh session): the same tokens, chunked.
    stream = client_for(gateway, "chat-stream").chat.completions.create(
        model="oneloop", messages=messages, tools=TOOLS, seed=7, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].token_ids == choice.token_ids
    assert last.choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    if choice.finish_reason != "tool_calls":
        assert text == (choice.message.content or "")
    # n > 1: independent samples in one request.
    many = client_for(gateway, "chat-n").chat.completions.create(
        model="oneloop", messages=messages, n=3, max_tokens=12, temperature=1.0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    ids = [tuple(c.token_ids) for c in many.choices]
    assert len(ids) == 3 and len(set(ids)) >= 2
    # Completions, then one that extends the reply's exact ids: continued, not a new segment.
    done = client_for(gateway, "cmpl").completions.create(
        model="oneloop", prompt="1 2 3", max_tokens=8, extra_body={"return_token_ids": True}
    )
    assert isinstance(done.choices[0].text, str)
    state = segments(gateway, "cmpl")
    prompt_ids = state["segments"][0]["segments"][0]["tokens"]
    follow = prompt_ids + done.choices[0].token_ids + [5, 6]
    client_for(gateway, "cmpl").completions.create(model="oneloop", prompt=follow, max_tokens=4)
    state = segments(gateway, "cmpl")
    assert state["counters"]["continued"] == 1 and state["counters"]["new_segments"] == 1
    for session in ("chat", "chat-stream", "chat-n", "cmpl"):
        for data in segments(gateway, session)["segments"]:
            Trajectory.from_json(data).to_datum(1.0)  # digests re-checked


def test_conversation_continues_and_an_edited_history_is_a_new_segment(gateway):
    oa = client_for(gateway, "conv")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    first = oa.chat.completions.create(model="oneloop", messages=messages, max_tokens=10,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "and 4 * 5?"})
    second = oa.chat.completions.create(model="oneloop", messages=messages, max_tokens=10,
                                        extra_body={"return_token_ids": True})  # fmt: skip
    state = segments(gateway, "conv")
    assert state["counters"]["continued"] == 1
    assert state["counters"]["history_rewrites"] == 0
    [data] = state["segments"]
    trajectory = Trajectory.from_json(data)
    sampled = [list(s.tokens) for s in trajectory.sampled_segments]
    assert sampled == [first.choices[0].token_ids, second.choices[0].token_ids]
    assert [s.kind for s in trajectory.segments] == ["prompt", "sampled", "observation", "sampled"]
    # An agent that summarises: the earlier turns are replaced, so a new segment starts.
    edited = [messages[0], {"role": "user", "content": "summary: asked 2 sums"}]
    oa.chat.completions.create(model="oneloop", messages=edited, max_tokens=6)
    state = segments(gateway, "conv")
    assert state["counters"]["new_segments"] == 2
    assert state["counters"]["history_rewrites"] == 1
    assert len(state["segments"]) == 2
    assert Trajectory.from_json(state["segments"][0]).tokens == trajectory.tokens


def test_tool_calls_parse_into_openai_shape(gateway):
    renderer = gateway.store.renderer
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    tokens = renderer.encode(text) + [renderer.stop_token_ids[0]]
    reply = reply_message(renderer, tokens, stops=[], cut=False, tools_offered=True)
    assert reply.finish_reason == "tool_calls"
    [call] = reply.message["tool_calls"]
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}


def post(gateway, path, body, headers=None):
    return httpx.post(f"{gateway.base_url}{path}", content=body, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})  # fmt: skip


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "oneloop"}, "messages"),
    ({"model": "oneloop", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"model": "oneloop", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": "oneloop", "messages": [{"role": "user", "content": "x"}], "bogus": 1}, "bogus"),
    ({"model": "oneloop", "messages": [{"role": "user", "content": "x"}],
      "frequency_penalty": 1.0}, "frequency_penalty"),
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "oneloop", "messages": [{"role": "assistant", "content": "",
      "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f",
      "arguments": "{nope"}}]}]}, "messages.0.tool_calls.0.function.arguments"),
])  # fmt: skip
def test_bad_requests_get_openai_shaped_4xx_naming_the_field(gateway, body, param):
    response = post(gateway, "/s/bad/v1/chat/completions", json.dumps(body))
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_session_cap_is_a_429(gateway):
    store = gateway.store
    names = [f"cap-{i}" for i in range(store.max_sessions - len(store.sessions))]
    try:
        for name in names:
            gateway.open_session(name, store.sampler)
        response = post(gateway, "/s/one-too-many/v1/completions",
                        json.dumps({"model": "oneloop", "prompt": "1", "max_tokens": 1}))
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "too_many_sessions"
    finally:
        for name in names:
            gateway.close_session(name)


SCALARS = st.none() | st.booleans() | st.integers(-3, 5) | st.floats(allow_nan=False)
JSON = st.recursive(
    SCALARS | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = st.sampled_from(["model", "messages", "prompt", "n", "tools", "tool_choice", "stop",
                          "max_tokens", "temperature", "stream", "seed", "logprobs"])  # fmt: skip


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=st.one_of(
        st.binary(max_size=40),
        JSON.map(lambda v: json.dumps(v).encode()),
        st.dictionaries(FIELDS, JSON, max_size=5).map(
            lambda d: json.dumps({"model": "oneloop", "max_tokens": 1, **d}).encode()
        ),
    ),
    path=st.sampled_from(["/s/fuzz/v1/chat/completions", "/s/fuzz/v1/completions"]),
)
def test_fuzzed_bodies_never_get_a_5xx(gateway, body, path):
    response = post(gateway, path, body)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) >= {"message", "type", "param"}


def test_n_choices_continue_from_the_echoed_one_and_stop_strings_cut_exactly(gateway):
    oa = client_for(gateway, "branch")
    messages = [{"role": "user", "content": "Name a number."}]
    first = oa.chat.completions.create(model="oneloop", messages=messages, n=2, max_tokens=8,
                                       seed=3, extra_body={"return_token_ids": True})  # fmt: skip
    chosen = first.choices[1]
    messages += [chosen.message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
    oa.chat.completions.create(model="oneloop", messages=messages, max_tokens=4)
    state = segments(gateway, "branch")
    assert state["counters"]["continued"] == 1 and state["counters"]["unchosen_choices"] == 1
    sampled = Trajectory.from_json(state["segments"][-1]).sampled_segments
    assert list(sampled[0].tokens) == chosen.token_ids
    # `stop`: the reply is cut where the stop string first appears, its tokens a sampled prefix.
    whole = client_for(gateway, "stop-a").completions.create(
        model="oneloop", prompt="1 2 3", max_tokens=16, seed=5,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    text = whole.choices[0].text
    assert len(text) >= 2, "seed 5 samples a reply of several characters"
    stop = text[len(text) // 2]
    cut = client_for(gateway, "stop-b").completions.create(
        model="oneloop", prompt="1 2 3", max_tokens=16, seed=5, stop=[stop],
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    kept = cut.choices[0].token_ids
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    assert 1 <= len(kept) and whole.choices[0].token_ids[: len(kept)] == kept
    [data] = segments(gateway, "stop-b")["segments"]
    assert list(Trajectory.from_json(data).sampled_segments[0].tokens) == cut.choices[0].token_ids


def test_a_rewritten_history_trains_every_segment_once_per_trial(gateway):
    """Regression: after an agent rewrote its history only the session's last segment trained
    (the earlier ones were kept in the record, counted, and dropped). Every segment trains now,
    with its trial's reward, and the group's advantages count each trial once."""
    from oneloop.agents.gateway.trial import METADATA_GATEWAY
    from oneloop.agents.trials import TrajectoryResult, TrialOutcome, TrialTimings
    from oneloop.loop.advantages import ScoredGroup, build_datums

    def trial(session: str, rewrite: bool, reward: float) -> TrajectoryResult:
        oa = client_for(gateway, session)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        oa.chat.completions.create(model="oneloop", messages=messages, max_tokens=6)
        if rewrite:
            edited = [messages[0], {"role": "user", "content": "summary: said hi"}]
            oa.chat.completions.create(model="oneloop", messages=edited, max_tokens=6)
        *earlier, last = segments(gateway, session)["segments"]
        return TrajectoryResult(
            outcome=TrialOutcome.OK, reward=reward, trajectory=last, timings=TrialTimings(),
            error=None, attempts=1, trial_name=session,
            agent_stats={METADATA_GATEWAY: {"earlier_segments": earlier}},
        )  # fmt: skip

    results = [trial("rewrote", True, 1.0), trial("plain", False, 0.0)]
    assert [len(r.trajectories) for r in results] == [2, 1]
    group = ScoredGroup.of_trials("0:0", "task", 0, [
        ([Trajectory.from_json(t) for t in r.trajectories], float(r.reward or 0.0))
        for r in results
    ])  # fmt: skip
    # Trial mean 0.5: +0.5 for both segments of the rewarded trial, -0.5 for the other (a mean
    # over trajectories would give 2/3 and let the rewriting trial count twice).
    assert group.advantages(std_normalize=False).tolist() == [0.5, 0.5, -0.5]
    datums, masks = build_datums([group], "token_sum", std_normalize=False)  # hash-checked
    assert len(datums) == 3
    for datum, mask, expected in zip(datums, masks, [0.5, 0.5, -0.5], strict=True):
        advantages = datum.loss_fn_inputs["advantages"].to_numpy()
        assert mask.any() and set(advantages[mask].tolist()) == {expected}
