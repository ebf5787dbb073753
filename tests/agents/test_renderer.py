"""Chat-template renderer: prompt/delta token exactness and tool-call round trips.

Property tests run on two templates attached to the tiny model's byte-level BPE tokenizer: the
tiny model's own ChatML template and the real Qwen3 template (tests/fixtures), whose past
assistant turns render differently from the last one.
"""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from oneloop.agents.renderer import ChatRenderer, RendererError
from oneloop.agents.tool_parsing import ToolCall, parse_hermes
from oneloop.tiny.model import build_tiny_model

QWEN3_TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_chat_template.jinja"
# Strings the tokenizer turns into added tokens; free text containing them would be markup.
MARKUP = ("<|", "|>", "<tool", "</tool", "<think", "</think")
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module", params=["tiny", "qwen3"])
def renderer(request):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    if request.param == "qwen3":
        tokenizer.chat_template = QWEN3_TEMPLATE.read_text()
    r = ChatRenderer(tokenizer)
    r.with_reasoning = request.param == "qwen3"  # Qwen3 renders past turns' thinking only if set
    return r


def free_text(min_size=0):
    alphabet = st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"))
    return st.text(alphabet | st.sampled_from('\n\t{}"<>'), min_size=min_size, max_size=40).filter(
        lambda s: not any(m in s for m in MARKUP)
    )


stripped_text = free_text().map(str.strip).filter(lambda s: not any(m in s for m in MARKUP))
names = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**9), 10**9)
    | st.floats(allow_nan=False, allow_infinity=False) | free_text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
tool_calls = st.lists(
    st.builds(ToolCall, name=names, arguments=st.dictionaries(names, json_values, max_size=4)),
    min_size=1,
    max_size=3,
)
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                      "parameters": {"type": "object", "properties": {}}}}
]  # fmt: skip


def assistant(r, content, calls, reasoning):
    message = {"role": "assistant", "content": content,
               "tool_calls": [c.to_message(f"call_{i}") for i, c in enumerate(calls)]}  # fmt: skip
    if r.with_reasoning:
        message["reasoning_content"] = reasoning
    return message


def sampled_text(r, conversation, message):
    """What a model following the template writes for `message`: the render's new text up to and
    including the stop token."""
    before = r.render_text(conversation, tools=TOOLS, add_generation_prompt=True)
    after = r.render_text([*conversation, message], tools=TOOLS)
    assert after.startswith(before)
    new = after[len(before) :]
    stop = r.stop_strings[0]
    return new[: new.index(stop) + len(stop)]


@SETTINGS
@given(data=st.data(), user=stripped_text.filter(bool), n_turns=st.integers(1, 3))
def test_prefix_extends_across_turns_and_equals_full_render(renderer, data, user, n_turns):
    r = renderer
    conversation = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": user}]  # fmt: skip
    ids = r.initial_prompt(conversation, TOOLS)
    assert ids == r.encode(r.render_text(conversation, tools=TOOLS, add_generation_prompt=True))
    for turn in range(n_turns):
        calls = data.draw(tool_calls)
        reply = assistant(r, data.draw(stripped_text), calls, data.draw(stripped_text.filter(bool)))
        ids = ids + r.encode(sampled_text(r, conversation, reply))
        conversation.append(reply)
        results = [{"role": "tool", "tool_call_id": f"call_{i}", "name": c.name,
                    "content": data.draw(free_text())} for i, c in enumerate(calls)]  # fmt: skip
        previous = ids
        ids = ids + r.observation_delta(results)
        conversation.extend(results)
        full = r.encode(r.render_text(conversation, tools=TOOLS, add_generation_prompt=True))
        assert ids[: len(previous)] == previous
        assert ids == full, f"turn {turn}: TITO tokens differ from a full render"


@SETTINGS
@given(content=stripped_text, calls=tool_calls, reasoning=stripped_text.filter(bool))
def test_round_trip_of_assistant_tool_calls(renderer, content, calls, reasoning):
    r = renderer
    conversation = [{"role": "user", "content": "go"}]
    text = sampled_text(r, conversation, assistant(r, content, calls, reasoning))
    tokens = r.encode(text)
    assert r.ends_with_stop(tokens)
    parsed = r.parse_reply(tokens)
    assert parsed.errors == ()
    assert parsed.tool_calls == tuple(calls)
    assert parsed.content == content
    if r.with_reasoning:
        assert parsed.reasoning == reasoning


observation_messages = st.lists(
    st.one_of(
        st.builds(lambda c: {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": c},
                  free_text()),
        st.builds(lambda c: {"role": "user", "content": c}, stripped_text.filter(bool)),
    ),
    min_size=1,
    max_size=4,
)  # fmt: skip


@SETTINGS
@given(calls=tool_calls, content=stripped_text, observation=observation_messages,
       reasoning=stripped_text.filter(bool))  # fmt: skip
def test_observation_delta_is_what_a_full_render_adds_after_the_stop_token(
    renderer, calls, content, observation, reasoning
):
    r = renderer
    conversation = [{"role": "system", "content": "s"}, {"role": "user", "content": "go"},
                    assistant(r, content, calls, reasoning)]  # fmt: skip
    stops_through_reply = sum(t in r.stop_token_ids for t in r.encode(r.render_text(conversation)))
    full = r.encode(r.render_text([*conversation, *observation], add_generation_prompt=True))
    stop_positions = [i for i, t in enumerate(full) if t in r.stop_token_ids]
    reply_stop = stop_positions[stops_through_reply - 1]
    assert r.observation_delta(observation) == full[reply_stop + 1 :]
    # A reply cut by a length limit has no stop token: the delta then starts with it.
    assert r.observation_delta(observation, after_stop_token=False) == full[reply_stop:]


def test_stop_tokens_come_from_eos_and_the_template(renderer):
    assert renderer.stop_strings == ("<|im_end|>",)
    assert renderer.stop_token_ids == (renderer.tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_initial_prompt_ends_with_the_generation_prompt(renderer):
    ids = renderer.initial_prompt([{"role": "user", "content": "hi"}], TOOLS)
    text = renderer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert '"name": "add"' in text


def test_a_tokenizer_without_a_template_is_refused():
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    tokenizer.chat_template = None
    with pytest.raises(RendererError, match="tokenizer.chat_template"):
        ChatRenderer(tokenizer)


def test_a_multi_token_stop_string_is_refused():
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    with pytest.raises(RendererError, match="stop_tokens: 'hello world' must be a single token"):
        ChatRenderer(tokenizer, stop_tokens=["hello world"])


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}\n', "never closed"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "invalid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'missing "name"'),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>["add"]</tool_call>', "expected a JSON object"),
        ("done</tool_call>", "without a matching"),
        ('<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>', "never closed"),
    ],
)
def test_malformed_tool_calls_are_error_values(text, reason):
    parsed = parse_hermes(text)
    assert len(parsed.errors) == 1
    assert reason in parsed.errors[0].reason


def test_valid_calls_survive_next_to_a_broken_one():
    parsed = parse_hermes(
        'ok <tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
        "<tool_call>{bad}</tool_call>"
    )
    assert parsed.content == "ok"
    assert parsed.tool_calls == (ToolCall("a", {"x": 1}),)
    assert parsed.errors[0].raw == "{bad}"


def test_tool_calls_inside_reasoning_are_not_calls():
    parsed = parse_hermes('<think>\nmaybe <tool_call>{"name": "x"}</tool_call>\n</think>\n\nno')
    assert parsed.tool_calls == () and parsed.errors == ()
    assert parsed.content == "no"
    assert parsed.reasoning.startswith("maybe")


CONTROL_PIECES = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "a", "\n", "<", "|>"]


@SETTINGS
@given(text=st.lists(st.sampled_from(CONTROL_PIECES), max_size=12).map("".join))
def test_neutralized_text_holds_no_control_token(renderer, text):
    safe = renderer.neutralize(text)
    assert not any(c in safe for c in renderer.control_strings)
    assert safe.replace("\u200b", "") == text
    control_ids = {renderer.tokenizer.convert_tokens_to_ids(c) for c in renderer.control_strings}
    assert not control_ids & set(renderer.encode(safe))
