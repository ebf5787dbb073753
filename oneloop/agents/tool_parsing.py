"""Parsing an assistant reply's text into content, reasoning and tool calls.

This module owns the reply grammar of Qwen3 / Hermes-style models:
`[<think>reasoning</think>] content <tool_call>{"name": ..., "arguments": {...}}</tool_call> ...`.
A malformed call (unclosed tag, a stray closing tag, invalid JSON, a missing name, arguments that
are not an object) is kept as a `ToolCallParseError` value so the agent can send a repair message;
nothing the model wrote is silently dropped. It also owns `truncate_middle`, which shortens the
tool results the model is shown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call: a tool name and its JSON-object arguments."""

    name: str
    arguments: dict[str, Any]

    def to_message(self, call_id: str) -> dict[str, Any]:
        """The OpenAI-shaped `tool_calls` entry chat templates expect."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolCallParseError:
    """A tool call the model tried to make but got wrong; `raw` is the offending text."""

    raw: str
    reason: str


@dataclass(frozen=True)
class ParsedReply:
    """An assistant reply split into its parts. `errors` is empty when every call parsed."""

    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    errors: tuple[ToolCallParseError, ...]


def parse_hermes(text: str) -> ParsedReply:
    """Split `text` (the reply without its stop token) into reasoning, content and tool calls.

    Tool calls are only looked for after `</think>` when the reply has a reasoning block.
    """
    reasoning: str | None = None
    body = text
    if THINK_CLOSE in text:
        before, _, body = text.partition(THINK_CLOSE)
        reasoning = before.split(THINK_OPEN, 1)[-1].strip("\n")
    content_parts: list[str] = []
    calls: list[ToolCall] = []
    errors: list[ToolCallParseError] = []
    position = 0
    while True:
        start = body.find(TOOL_CALL_OPEN, position)
        outside = body[position:] if start < 0 else body[position:start]
        if TOOL_CALL_CLOSE in outside:
            errors.append(
                ToolCallParseError(
                    outside, f"{TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}"
                )
            )
            outside = outside.replace(TOOL_CALL_CLOSE, "")
        content_parts.append(outside)
        if start < 0:
            break
        inner_start = start + len(TOOL_CALL_OPEN)
        end = body.find(TOOL_CALL_CLOSE, inner_start)
        nested = body.find(TOOL_CALL_OPEN, inner_start)
        if end < 0 or 0 <= nested < end:
            stop = len(body) if end < 0 else nested
            errors.append(ToolCallParseError(body[start:stop], f"{TOOL_CALL_OPEN} is never closed"))
            if end < 0:
                break
            position = nested
            continue
        raw = body[inner_start:end]
        call = _parse_call(raw)
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(call)
        position = end + len(TOOL_CALL_CLOSE)
    return ParsedReply(
        content="".join(content_parts).strip(),
        reasoning=reasoning,
        tool_calls=tuple(calls),
        errors=tuple(errors),
    )


def _parse_call(raw: str) -> ToolCall | ToolCallParseError:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCallParseError(raw, f"invalid JSON: {exc.msg} at char {exc.pos}")
    if not isinstance(value, dict):
        return ToolCallParseError(raw, f"expected a JSON object, got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallParseError(raw, 'missing "name" (a non-empty string)')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        # Some models double-encode the arguments; accept a string holding a JSON object.
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCallParseError(raw, '"arguments" is a string that is not a JSON object')
    if not isinstance(arguments, dict):
        return ToolCallParseError(
            raw, f'"arguments" must be a JSON object, got {type(arguments).__name__}'
        )
    return ToolCall(name=name, arguments=arguments)


def truncate_middle(text: str, max_chars: int) -> str:
    """`text` if it fits, else its first 2/3 and last 1/3 of `max_chars` around a cut marker."""
    if len(text) <= max_chars:
        return text
    head = max_chars * 2 // 3
    tail = max_chars - head
    cut = len(text) - head - tail
    marker = f"\n[... {cut} characters truncated ...]\n"
    return text[:head] + marker + (text[-tail:] if tail else "")
