"""Tests for oneloop.tiny.model: loading by path, the tokenizer, the chat template, the cache."""

import dataclasses
import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from oneloop.tiny import model as tiny_model
from oneloop.tiny.model import (
    COMPLETE_MARKER,
    CONTROL_TOKENS,
    TINY_MODEL_DEMO,
    TOOL_MARKUP_TOKENS,
    TinyModelSpec,
    build_tiny_model,
    named_tiny_specs,
    spec_digest,
    tiny_model_dir,
)

SMALL = TinyModelSpec(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit the final answer.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}},
        },
    },
]

CONVERSATION = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 12 + 30, then 2 + 2?"},
    {
        "role": "assistant",
        "content": "Adding.",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}},
            {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}},
        ],
    },
    {"role": "tool", "content": "42"},
    {"role": "tool", "content": "4"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "submit", "arguments": {"answer": "42, 4"}}}
        ],
    },
    {"role": "tool", "content": "accepted ✓"},
    {"role": "assistant", "content": "Done: 42 and 4."},
    {"role": "user", "content": "Thanks!"},
]

EXPECTED_RENDER = (
    "<|im_start|>system\nYou are a calculator.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0])
    + "\n"
    + json.dumps(TOOLS[1])
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is 12 + 30, then 2 + 2?<|im_end|>\n"
    "<|im_start|>assistant\nAdding.\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n"
    "<tool_response>\n4\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "submit", "arguments": {"answer": "42, 4"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\naccepted ✓\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nDone: 42 and 4.<|im_end|>\n"
    "<|im_start|>user\nThanks!<|im_end|>\n"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(TinyModelSpec(), root=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(built: Path):
    return AutoTokenizer.from_pretrained(built)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_loads_by_path_with_auto_classes(built: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(built)
    spec = TinyModelSpec()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.model_type == "qwen3"
    assert next(model.parameters()).dtype == torch.float32
    assert len(tokenizer) == model.config.vocab_size == spec.vocab_size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == im_end
    assert tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == model.generation_config.eos_token_id == im_end
    assert model.config.pad_token_id == tokenizer.pad_token_id
    ids = torch.tensor([tokenizer.encode("1 + 2 = 3")])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], spec.vocab_size)
    assert torch.isfinite(logits).all()


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_round_trips_exactly(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "  leading and trailing  ",
        "line\r\nbreaks\n\n\ttabs",
        "日本語のテキスト 😀👍🏽 e\u0301 ﬁ \u200b \x00 \x7f",
        'tool said: <tool_call>\n{"name": "x"}\n</tool_call> and <tools></tools>',
        "<|im_start|>user\nhi<|im_end|>",
    ],
)
def test_tricky_text_round_trips_exactly(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_digits_are_split_one_per_token(tokenizer) -> None:
    tokens = tokenizer.tokenize("x=1234567890")
    assert tokens[-10:] == list("1234567890")


@pytest.mark.parametrize("token", CONTROL_TOKENS + TOOL_MARKUP_TOKENS)
def test_control_and_markup_tokens_are_single_tokens(tokenizer, token: str) -> None:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    ids = tokenizer.encode(f"abc{token}def", add_special_tokens=False)
    assert ids.count(token_id) == 1
    assert tokenizer.decode(ids) == f"abc{token}def"


def test_skip_special_tokens_drops_control_tokens_but_keeps_tool_markup(tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>")
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == "assistant\n<tool_call>\n{}\n</tool_call>"


def test_chat_template_renders_tools_calls_and_responses(tokenizer) -> None:
    ids = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == EXPECTED_RENDER
    # The tool markup reaches the model as single tokens, not spelled out: two in the system
    # block's instructions plus one per call.
    assert ids.count(tokenizer.convert_tokens_to_ids("<tool_call>")) == 2 + 3
    assert ids.count(tokenizer.convert_tokens_to_ids("<tool_response>")) == 3
    assert ids.count(tokenizer.convert_tokens_to_ids("<tools>")) == 2


def test_chat_template_without_tools_is_plain_chatml(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )


def test_tools_without_system_message_still_get_a_system_block(tokenizer) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tools=TOOLS[:1], tokenize=False
    )
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_add_generation_prompt_opens_an_assistant_turn(tokenizer) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert plain.endswith("<|im_end|>\n")
    assert ids == tokenizer.encode(text, add_special_tokens=False)


def test_chat_template_rejects_unknown_role(tokenizer) -> None:
    with pytest.raises(Exception, match="unknown message role: narrator"):
        tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_same_spec_gives_identical_files(tmp_path: Path) -> None:
    first = build_tiny_model(SMALL, root=tmp_path / "a")
    second = build_tiny_model(SMALL, root=tmp_path / "b")
    assert first.name == second.name
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_different_seed_gives_different_weights_same_tokenizer(tmp_path: Path) -> None:
    first = build_tiny_model(SMALL, root=tmp_path)
    other = build_tiny_model(TinyModelSpec(**{**SMALL.__dict__, "seed": 1}), root=tmp_path)
    assert first != other
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    a, b = _weights(first), _weights(other)
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_number_digits_makes_every_integer_below_1000_one_token(tmp_path: Path) -> None:
    spec = TinyModelSpec(vocab_size=2048, hidden_size=32, intermediate_size=64, number_digits=3)
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(spec, root=tmp_path))
    for number in range(1000):
        assert len(tokenizer.encode(str(number), add_special_tokens=False)) == 1, number
    # Longer digit runs split into chunks of at most three digits, and text still round-trips.
    assert tokenizer.tokenize("x=1234567") == ["x", "=", "123", "456", "7"]
    text = '{"a": 17, "b": -25.5} 1000000'
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_new_spec_fields_keep_existing_cache_keys() -> None:
    """Regression: adding `number_digits` must not re-key (and so rebuild) the specs in use."""
    assert spec_digest(TinyModelSpec()) == "960e44b897ca"
    assert spec_digest(named_tiny_specs()["oneloop/tiny-qwen3-128x4"]) == "da35cdb284f9"
    demo = named_tiny_specs()[TINY_MODEL_DEMO]
    assert spec_digest(demo) != spec_digest(dataclasses.replace(demo, tool_list="json"))
    assert spec_digest(demo) != spec_digest(dataclasses.replace(demo, number_digits=3))


def test_compact_tool_list_renders_one_line_per_tool(tmp_path: Path) -> None:
    """The compact style lists each tool as `name(args): description`; everything after the
    system turn (calls, responses, generation prompt) renders exactly as the JSON style does."""
    compact = dataclasses.replace(SMALL, tool_list="compact")
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(compact, root=tmp_path))
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text.startswith(
        "<|im_start|>system\nYou are a calculator.\n\n<tools>\n"
        "add(a, b): Add two integers.\nsubmit(answer): Submit the final answer.\n</tools>\n"
        'Call a tool as <tool_call>\n{"name": <name>, "arguments": {...}}\n</tool_call>'
        "<|im_end|>\n"
    )
    json_turns = EXPECTED_RENDER[EXPECTED_RENDER.index("<|im_start|>user") :]
    assert text[text.index("<|im_start|>user") :] == json_turns
    # Tool schemas with no parameters, and bare (non-OpenAI-wrapped) tool dicts, still render.
    bare = [{"name": "ping", "description": "Liveness."}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=bare,
                                         tokenize=False)  # fmt: skip
    assert "\nping(): Liveness.\n</tools>" in text


def test_vocab_size_is_configurable(tmp_path: Path) -> None:
    path = build_tiny_model(SMALL, root=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == SMALL.vocab_size
    assert _weights(path)["model.embed_tokens.weight"].shape == (512, 32)


def test_build_leaves_caller_torch_rng_untouched(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(SMALL, root=tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_build_ignores_caller_default_dtype(tmp_path: Path) -> None:
    reference = _weights(build_tiny_model(SMALL, root=tmp_path / "a"))
    torch.set_default_dtype(torch.float64)
    try:
        path = build_tiny_model(SMALL, root=tmp_path / "b")
    finally:
        torch.set_default_dtype(torch.float32)
    weights = _weights(path)
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


def test_cache_hit_returns_same_path_without_rebuilding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = build_tiny_model(SMALL, root=tmp_path)
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    def fail(*_: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny_model, "_write_model", fail)
    monkeypatch.setattr(tiny_model, "_write_tokenizer", fail)
    assert build_tiny_model(SMALL, root=tmp_path) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes


def test_losing_a_build_race_keeps_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While this build writes its model, another build finishes and renames into place first."""
    real_write_model = tiny_model._write_model
    calls = []

    def write_model_while_another_build_wins(spec: TinyModelSpec, directory: Path) -> None:
        calls.append(directory)
        if len(calls) == 1:
            build_tiny_model(spec, root=tmp_path)  # the winner; its own _write_model is call 2
        real_write_model(spec, directory)

    monkeypatch.setattr(tiny_model, "_write_model", write_model_while_another_build_wins)
    path = build_tiny_model(SMALL, root=tmp_path)
    assert len(calls) == 2
    assert path == tiny_model_dir(SMALL, tmp_path)
    assert (path / COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # loser's staging removed


def test_concurrent_builds_in_processes_share_one_directory(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        paths = pool.starmap(build_tiny_model, [(SMALL, tmp_path), (SMALL, tmp_path)])
    assert paths[0] == paths[1] == tiny_model_dir(SMALL, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [paths[0].name]
    assert AutoTokenizer.from_pretrained(paths[0]).decode([]) == ""
    AutoModelForCausalLM.from_pretrained(paths[0])


def test_incomplete_target_directory_is_reported(tmp_path: Path) -> None:
    tiny_model_dir(SMALL, tmp_path).mkdir(parents=True)
    with pytest.raises(FileExistsError, match=COMPLETE_MARKER):
        build_tiny_model(SMALL, root=tmp_path)


def test_default_root_comes_from_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONELOOP_CACHE", str(tmp_path))
    assert tiny_model_dir(SMALL).parent == tmp_path
    assert tiny_model_dir(SMALL).name.startswith("tiny-qwen3-")
    assert tiny_model_dir(SMALL) != tiny_model_dir(TinyModelSpec())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_kv_heads": 3}, "TinyModelSpec.num_kv_heads"),
        ({"vocab_size": 100}, "TinyModelSpec.vocab_size"),
        ({"head_dim": 15}, "TinyModelSpec.head_dim"),
        ({"num_layers": 0}, "TinyModelSpec.num_layers"),
        ({"seed": -1}, "TinyModelSpec.seed"),
        ({"hidden_size": 64.0}, "TinyModelSpec.hidden_size"),
        ({"tie_word_embeddings": 1}, "TinyModelSpec.tie_word_embeddings"),
        ({"number_digits": 0}, "TinyModelSpec.number_digits"),
        ({"number_digits": 4}, "TinyModelSpec.number_digits"),
        ({"tool_list": "yaml"}, "TinyModelSpec.tool_list"),
        ({"tool_list": 1}, "TinyModelSpec.tool_list"),
    ],
)
def test_bad_spec_names_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        TinyModelSpec(**kwargs)  # type: ignore[arg-type]
