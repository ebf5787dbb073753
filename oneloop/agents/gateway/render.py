"""Between OpenAI messages and our renderer: template messages in, OpenAI replies out.

This module owns the conversions the gateway needs around `oneloop.agents.renderer` and
`oneloop.agents.tool_parsing` (it re-implements neither):

* `template_messages` — validated wire messages → the dicts chat templates expect (tool-call
  arguments as objects, `developer` as `system`, text parts joined, tool results neutralised so
  a tool's output can never forge chat structure, exactly as our MCP agent does);
* `message_key` — the comparable form of a message, used to decide whether a request extends
  the session's history (what a client echoes back may differ in representation: `null` vs `""`
  content, re-serialised arguments, extra keys);
* `reply_message` — sampled tokens → an OpenAI assistant message (`content`, parsed
  `tool_calls` with ids, `finish_reason`), and `cut_at_stop` for the request's `stop` strings.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from oneloop.agents.gateway.wire import GatewayHttpError, Message
from oneloop.agents.renderer import ChatRenderer


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GatewayHttpError(
            400, f"{where}: not valid JSON ({exc.msg})", param=where, code="invalid_value"
        ) from None
    if not isinstance(value, dict):
        raise GatewayHttpError(400, f"{where}: expected a JSON object", param=where)
    return value


def template_messages(
    messages: Sequence[Message], renderer: ChatRenderer, *, offset: int = 0
) -> list[dict[str, Any]]:
    """The chat-template form of `messages` (`offset`: index of the first one in the request,
    for error paths)."""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages, start=offset):
        role = "system" if message.role == "developer" else message.role
        item: dict[str, Any] = {"role": role, "content": message.text()}
        if message.role == "tool":
            if message.tool_call_id is None:
                raise GatewayHttpError(
                    400, f"messages.{index}.tool_call_id: required on a tool message",
                    param=f"messages.{index}.tool_call_id",
                )  # fmt: skip
            item["content"] = renderer.neutralize(item["content"])
            item["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise GatewayHttpError(
                    400, f"messages.{index}.tool_calls: only assistant messages carry tool calls",
                    param=f"messages.{index}.tool_calls",
                )  # fmt: skip
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(
                            call.function.arguments,
                            f"messages.{index}.tool_calls.{j}.function.arguments",
                        ),
                    },
                }
                for j, call in enumerate(message.tool_calls)
            ]
        out.append(item)
    return out


def message_key(message: Message) -> tuple[Any, ...]:
    """What makes two messages the same conversation turn (representation differences aside)."""
    calls: tuple[Any, ...] = ()
    if message.tool_calls:
        parsed = []
        for call in message.tool_calls:
            try:
                arguments = json.dumps(json.loads(call.function.arguments), sort_keys=True)
            except json.JSONDecodeError:
                arguments = call.function.arguments
            parsed.append((call.function.name, arguments))
        calls = tuple(parsed)
    role = "system" if message.role == "developer" else message.role
    return (role, message.text(), message.name, calls, message.tool_call_id)


@dataclass(frozen=True)
class Reply:
    """One sampled choice as the client sees it."""

    message: dict[str, Any]  # OpenAI's assistant message
    finish_reason: str  # stop | length | tool_calls
    text: str  # the decoded reply (stop token and stop string removed)
    key: tuple[Any, ...]  # message_key of `message`


def cut_at_stop(
    renderer: ChatRenderer, tokens: Sequence[int], stops: Sequence[str]
) -> int | None:
    """The number of leading tokens whose text first contains one of `stops` (the reply is cut
    there: a prefix of what was sampled, so it stays exact TITO), or None when none occurs."""
    if not stops:
        return None
    text = renderer.decode(tokens)
    if not any(stop in text for stop in stops):
        return None
    low, high = 1, len(tokens)  # the shortest prefix whose text holds a stop string
    while low < high:
        middle = (low + high) // 2
        piece = renderer.decode(tokens[:middle])
        if any(stop in piece for stop in stops):
            high = middle
        else:
            low = middle + 1
    return low


def reply_message(
    renderer: ChatRenderer, tokens: Sequence[int], *, stops: Sequence[str], cut: bool,
    tools_offered: bool,
) -> Reply:  # fmt: skip
    """The assistant message of sampled `tokens`. `cut`: the tokens were cut at a stop string
    (its text and what follows it are dropped, as OpenAI does)."""
    stopped = renderer.ends_with_stop(tokens)
    body = list(tokens[:-1]) if stopped else list(tokens)
    text = renderer.decode(body)
    if cut:
        positions = [text.find(s) for s in stops if s in text]
        text = text[: min(positions)] if positions else text
    parsed = renderer.parse_reply(tokens) if tools_offered and not cut else None
    calls: list[dict[str, Any]] = []
    content: str | None = text
    reasoning = None
    if parsed is not None and parsed.tool_calls:
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in parsed.tool_calls
        ]
        # The model's own words beside the calls; with a malformed call the whole text stays,
        # so nothing the model wrote is hidden from the agent.
        content = parsed.content if not parsed.errors else text
        reasoning = parsed.reasoning
        content = content or None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        finish = "tool_calls"
    elif stopped or cut:
        finish = "stop"
    else:
        finish = "length"
    return Reply(message, finish, text, message_key(Message.model_validate(message)))
