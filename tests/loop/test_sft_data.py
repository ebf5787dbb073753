"""The generic SFT warm start: any chat-conversation JSONL with tool calls (`sft.data: <path>`).

Unit tests of the reader's errors (each names the file, the line and the field), of the rendering
(assistant turns weighted, laid out as the agent lays out a trajectory) and of the config field.
The contract test (`scripts/train.py --config demo-cpu` with `sft.data` pointing at a file the test
writes warm-starts from that file) is test_train_script.py's two-step run, which uses these helpers.
"""

import json
from pathlib import Path

import pytest

from oneloop.agents.renderer import ChatRenderer
from oneloop.errors import ConfigError
from oneloop.loop.config import load_config
from oneloop.loop.sft import read_conversations, render_conversations

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
# A word the demo task family never writes: its presence proves where the SFT tokens came from.
MARKER = "zebrafinch"


def conversation(a: int, b: int, *, tools: bool = True, string_arguments: bool = False) -> dict:
    arguments = {"a": a, "b": b}
    call = {
        "id": "call_0",
        "type": "function",
        "function": {
            "name": "add",
            "arguments": json.dumps(arguments) if string_arguments else arguments,
        },
    }
    record: dict = {
        "messages": [
            {"role": "system", "content": f"You are {MARKER}."},
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": str(a + b)},
            {"role": "assistant", "content": f"{MARKER} says {a + b}."},
        ]
    }
    if tools:
        record["tools"] = TOOLS
    return record


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_reads_every_conversation_in_file_order(tmp_path: Path) -> None:
    records = [
        conversation(1, 2),
        conversation(3, 4, tools=False),
        conversation(5, 6, string_arguments=True),
    ]
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps(records[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in records[1:])
    )
    read = read_conversations(path)
    assert [c.messages[1]["content"] for c in read] == [
        "What is 1 + 2?",
        "What is 3 + 4?",
        "What is 5 + 6?",
    ]
    assert read[0].tools is not None and read[1].tools is None
    assert [c.source for c in read] == [f"{path}, line 1", f"{path}, line 3", f"{path}, line 4"]


GOOD = conversation(1, 2)


def edited(change) -> dict:
    record = json.loads(json.dumps(GOOD))
    change(record)
    return record


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("{not json", "(line)"),
        ("[1, 2]", "(line)"),
        (edited(lambda r: r.update(extra=1)), "extra"),
        (edited(lambda r: r.pop("messages")), "messages"),
        (edited(lambda r: r.update(messages=[])), "messages"),
        (edited(lambda r: r["messages"].__setitem__(1, "hi")), "messages[1]"),
        (edited(lambda r: r["messages"][1].update(role="robot")), "messages[1].role"),
        (edited(lambda r: r["messages"][1].update(content=None)), "messages[1].content"),
        (edited(lambda r: r["messages"][2].update(content=3)), "messages[2].content"),
        (edited(lambda r: r["messages"][2].update(tool_calls={})), "messages[2].tool_calls"),
        (
            edited(lambda r: r["messages"][2]["tool_calls"][0]["function"].pop("name")),
            "messages[2].tool_calls[0].function.name",
        ),
        (
            edited(lambda r: r["messages"][2]["tool_calls"][0]["function"].update(arguments="{x")),
            "messages[2].tool_calls[0].function.arguments",
        ),
        (
            edited(lambda r: r["messages"][2]["tool_calls"][0]["function"].update(arguments=[1])),
            "messages[2].tool_calls[0].function.arguments",
        ),
        (
            edited(lambda r: r["messages"][2]["tool_calls"][0].update(type="code")),
            "messages[2].tool_calls[0].type",
        ),
        (
            edited(lambda r: r["messages"][3].update(tool_calls=[{"function": {"name": "add"}}])),
            "messages[3].tool_calls",
        ),
        (edited(lambda r: r.update(messages=r["messages"][:2])), "messages"),
        (edited(lambda r: r.update(messages=r["messages"][2:])), "messages[0].role"),
        (edited(lambda r: r.update(messages=r["messages"][:4])), "messages[3].role"),
        (edited(lambda r: r["messages"].__setitem__(3, r["messages"][4])), "messages[3].role"),
        (edited(lambda r: r.update(tools={"add": {}})), "tools"),
        (edited(lambda r: r.update(tools=[{"name": "add"}])), "tools[0]"),
        (edited(lambda r: r["tools"][0]["function"].update(name="")), "tools[0].function.name"),
    ],
)
def test_a_bad_line_names_the_file_the_line_and_the_field(tmp_path: Path, line, field) -> None:
    text = line if isinstance(line, str) else json.dumps(line)
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n" + text + "\n")
    with pytest.raises(ConfigError) as caught:
        read_conversations(path)
    assert str(caught.value).startswith(f"sft.data: {path}, line 3: {field}: "), caught.value


def test_a_missing_or_empty_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"sft\.data: cannot read .*nope\.jsonl"):
        read_conversations(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ConfigError, match=r"sft\.data: .*empty\.jsonl holds no conversations"):
        read_conversations(tmp_path / "empty.jsonl")


def test_rendering_weights_the_assistant_turns_as_the_agent_lays_them_out(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    renderer = ChatRenderer.from_pretrained(tiny_model_path)
    path = write_jsonl(
        tmp_path / "data.jsonl", [conversation(1, 2), conversation(3, 4, tools=False)]
    )
    conversations = read_conversations(path)
    (tokens, weights), _ = render_conversations(conversations, renderer)
    assert len(tokens) == len(weights) and set(weights) == {0.0, 1.0}
    # The prompt is exactly what the agent samples from first: messages before the first
    # assistant turn, with the tools.
    messages = conversations[0].messages
    prompt = renderer.initial_prompt(messages[:2], TOOLS)
    assert tokens[: len(prompt)] == prompt and not any(weights[: len(prompt)])
    trained = renderer.decode([t for t, w in zip(tokens, weights, strict=True) if w])
    untrained = renderer.decode([t for t, w in zip(tokens, weights, strict=True) if not w])
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in trained
    assert f"{MARKER} says 3." in trained and "What is 1 + 2?" in untrained
    # Each assistant turn ends with a stop token, as a sampled reply does.
    ends = [i for i in range(len(weights) - 1) if weights[i] and not weights[i + 1]]
    assert ends and all(tokens[i] in renderer.stop_token_ids for i in [*ends, len(tokens) - 1])


def test_sft_data_is_required_and_demo_needs_the_demo_tasks(tmp_path: Path) -> None:
    assert load_config("demo-cpu").sft.data == "demo"
    assert (
        load_config("demo-cpu", [f"sft.data={tmp_path}/x.jsonl"]).sft.data == tmp_path / "x.jsonl"
    )
    with pytest.raises(ConfigError, match=r"sft\.data"):
        load_config(None, ["sft.steps=2"])
    with pytest.raises(ConfigError, match=r"sft\.data: 'demo'"):
        load_config("demo-cpu", [f"tasks.dir={tmp_path}"])
    # A user's file works with the user's own tasks.
    cfg = load_config("demo-cpu", [f"tasks.dir={tmp_path}", f"sft.data={tmp_path}/x.jsonl"])
    assert cfg.sft.data == tmp_path / "x.jsonl"


def test_demo_warm_start_demonstrates_its_own_tasks_not_the_training_ones(tmp_path: Path) -> None:
    """With `tasks.demo.n_demonstrations` the demonstrations file holds exactly those tasks'
    questions, in order (none of the RL training or held-out ones); without it, the training
    tasks'."""
    import asyncio

    from oneloop.loop.train import sft_data_path, task_dirs

    def demonstrated(run: str, *overrides: str) -> tuple[list[str], object]:
        sizes = ["tasks.demo.n_train=6", "tasks.demo.n_eval=3"]
        cfg = load_config("demo-cpu", [f"run_dir={tmp_path / run}", *sizes, *overrides])
        splits, _, _ = task_dirs(cfg)
        path = asyncio.run(sft_data_path(cfg, splits))
        users = [
            next(m["content"] for m in json.loads(line)["messages"] if m["role"] == "user")
            for line in path.read_text().splitlines()
        ]
        return users, splits

    def asked(tasks) -> list[str]:
        return [f"What is {t.question.text}?" for t in tasks]

    users, splits = demonstrated("apart", "tasks.demo.n_demonstrations=5")
    assert len(users) == len(splits.demonstrations) == 5
    assert [q in u for q, u in zip(asked(splits.demonstrations), users, strict=True)] == [True] * 5
    assert not any(q in u for q in asked(splits.train + splits.eval) for u in users)
    users, splits = demonstrated("same")
    assert splits.demonstrations == ()
    assert [q in u for q, u in zip(asked(splits.train), users, strict=True)] == [True] * 6
    # No warm start, no demonstration tasks drawn.
    cfg = load_config("demo-cpu", [f"run_dir={tmp_path / 'none'}", "tasks.demo.n_train=2",
                                   "tasks.demo.n_demonstrations=5", "sft=null"])  # fmt: skip
    assert task_dirs(cfg)[0].demonstrations == ()
