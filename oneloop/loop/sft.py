"""SFT warm start through the same seam: any chat-conversation JSONL with tool calls.

`sft.data` names a JSONL file with one conversation per line, in the OpenAI chat shape:

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "...",
                   "tool_calls": [{"type": "function", "function": {"name": "...",
                                   "arguments": {...} or "<JSON text>"}}]}, ...],
     "tools": [{"type": "function", "function": {"name": "...", "description": "...",
                "parameters": {...}}}]}                                      (tools optional)

`read_conversations` checks every line and raises ConfigError naming the file, the line number and
the field. Each conversation is rendered by the project's renderer
(`ChatRenderer.conversation_tokens`) exactly as the agent lays out a trajectory: the messages before
the first assistant turn are the initial prompt (with the tool list), assistant turns are closed by
the stop token, the messages between them are observation deltas. So the warm start teaches the
token layout the agent samples in; weights are 1 on the assistant turns, the loss `cross_entropy`.
Extra keys of a message (`tool_call_id`, `name`, ...) go to the chat template as they are.

Nothing here knows the demo: `sft.data: demo` is resolved by the loop to the demonstrations that
`oneloop.agents.demo_tasks.demonstrations` writes beside the generated demo tasks.
"""

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tinker import types

from oneloop.agents.renderer import ChatRenderer, RendererError
from oneloop.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
FIELDS = ("messages", "tools")
Fail = Callable[[str, str], ConfigError]
"""Builds the error for (field, why) of one line."""


@dataclass(frozen=True)
class Conversation:
    """One line of an SFT data file: its chat messages and tool list (None = no tools)."""

    source: str
    """Where it came from, `<file>, line <n>` (error messages name it)."""
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None


def read_conversations(path: Path) -> list[Conversation]:
    """Every conversation of the JSONL file `path`, in file order (blank lines skipped)."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"sft.data: cannot read {path}: {error.strerror or error}") from None
    conversations = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            conversations.append(parse_conversation(line, f"{path}, line {number}"))
    if not conversations:
        raise ConfigError(f"sft.data: {path} holds no conversations (one JSON object per line)")
    return conversations


def parse_conversation(line: str, source: str) -> Conversation:
    """One JSONL line as a Conversation; ConfigError `sft.data: <source>: <field>: <why>`."""

    def fail(field: str, why: str) -> ConfigError:
        return ConfigError(f"sft.data: {source}: {field}: {why}")

    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise fail("(line)", f"not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise fail("(line)", 'expected a JSON object {"messages": [...], "tools": [...]}')
    for key in record:
        if key not in FIELDS:
            raise fail(key, f"unknown field (expected {', '.join(FIELDS)})")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise fail("messages", "expected a non-empty list of chat messages")
    for index, message in enumerate(messages):
        _check_message(message, f"messages[{index}]", fail)
    _check_layout([m["role"] for m in messages], fail)
    tools = record.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise fail("tools", "expected a list of tool specs")
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict):
                raise fail(f"tools[{index}]", 'expected {"type": "function", "function": {...}}')
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise fail(f"tools[{index}].function.name", "expected a non-empty string")
    return Conversation(source, tuple(messages), tuple(tools) if tools else None)


def _check_message(message: Any, field: str, fail: Fail) -> None:
    if not isinstance(message, dict):
        raise fail(field, "expected an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise fail(f"{field}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
    content = message.get("content")
    calls = message.get("tool_calls")
    if role == "assistant" and calls is not None:
        if content is not None and not isinstance(content, str):
            raise fail(f"{field}.content", "expected a string or null")
        if not isinstance(calls, list) or not calls:
            raise fail(f"{field}.tool_calls", "expected a non-empty list of tool calls")
        for index, call in enumerate(calls):
            _check_tool_call(call, f"{field}.tool_calls[{index}]", fail)
    elif calls is not None:
        raise fail(f"{field}.tool_calls", f"only assistant messages call tools, not {role}")
    elif not isinstance(content, str):
        raise fail(f"{field}.content", f"expected a string, got {type(content).__name__}")


def _check_tool_call(call: Any, field: str, fail: Fail) -> None:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise fail(field, 'expected {"type": "function", "function": {"name", "arguments"}}')
    if call.get("type", "function") != "function":
        raise fail(f"{field}.type", f"expected 'function', got {call['type']!r}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise fail(f"{field}.function.name", "expected a non-empty string")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise fail(f"{field}.function.arguments", "a string must hold a JSON object") from None
    if not isinstance(arguments, dict):
        raise fail(f"{field}.function.arguments", "expected a JSON object (or its JSON text)")


def _check_layout(roles: list[str], fail: Fail) -> None:
    """The layout the agent builds: a prompt, then assistant turns with observations between."""
    if "assistant" not in roles:
        raise fail("messages", "no assistant message: nothing to learn")
    if roles[0] == "assistant":
        raise fail("messages[0].role", "the conversation opens with a prompt, not the assistant")
    if roles[-1] != "assistant":
        raise fail(f"messages[{len(roles) - 1}].role", "the last message must be the assistant's")
    for index in range(1, len(roles)):
        if roles[index] == roles[index - 1] == "assistant":
            raise fail(
                f"messages[{index}].role",
                "two assistant turns in a row; a tool result or user message comes between them",
            )


def render_conversations(
    conversations: Sequence[Conversation], renderer: ChatRenderer
) -> list[tuple[list[int], list[float]]]:
    """(token ids, weights) of each conversation as the agent would lay it out; a template that
    cannot render one raises ConfigError naming its file and line."""
    rendered = []
    for conversation in conversations:
        try:
            rendered.append(renderer.conversation_tokens(conversation.messages, conversation.tools))
        except RendererError as error:
            raise ConfigError(f"sft.data: {conversation.source}: {error}") from None
    return rendered


def sft_datum(tokens: Sequence[int], weights: Sequence[float], scale: float) -> types.Datum:
    """Next-token datum: targets shifted by one, weights scaled (token-mean over the batch)."""
    w = np.asarray(weights[1:], dtype=np.float32) * scale
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens[:-1])),
        loss_fn_inputs={"target_tokens": list(tokens[1:]), "weights": w},
    )


async def sft_warm_start(
    trainer: Any,
    demos: list[tuple[list[int], list[float]]],
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    timeout_s: float,
    log: Any,
    lr_schedule: str = "constant",
) -> None:
    """`steps` cross_entropy steps over shuffled rendered conversations (token-mean per batch),
    at a constant rate or one decaying linearly to 0 (`lr_schedule`)."""
    if lr_schedule not in ("constant", "linear"):
        raise ValueError(f"sft.lr_schedule: expected 'constant' or 'linear', got {lr_schedule!r}")
    rng = np.random.default_rng(seed)
    for step in range(steps):
        rate = learning_rate * (1.0 - step / steps if lr_schedule == "linear" else 1.0)
        adam = types.AdamParams(learning_rate=rate, grad_clip_norm=1.0)
        picks = rng.choice(len(demos), size=min(batch_size, len(demos)), replace=False)
        batch = [demos[i] for i in picks]
        total = sum(sum(w) for _, w in batch)
        data = [sft_datum(t, w, 1.0 / total) for t, w in batch]
        fwd = trainer.forward_backward(data, "cross_entropy")
        opt = trainer.optim_step(adam)
        async with asyncio.timeout(timeout_s):
            out = await fwd
            await opt
        log(step, {"sft/loss_per_token": out.metrics["loss:sum"], "sft/tokens": float(total),
                   "sft/learning_rate": rate})  # fmt: skip
