"""The demo family's calculator MCP server (stdio): `python -m oneloop.agents.demo_tasks.server`.

This module owns the tools the demo tasks expose: `add`, `subtract`, `multiply`, `divide` and
`submit_answer(answer)`. `submit_answer` writes the answer to `--answer-path` (default
`/logs/agent/answer.txt`), which the task's verifier reads. The server must therefore run inside
the trial's environment: in a container that is the container; in the no-container environment the
agent starts it through `NoContainerEnvironment.stdio_command`, which runs it in the trial's private
mount namespace where `/logs/agent` is that trial's own directory. Started anywhere else (no
`/logs/agent` directory), it exits at once with an error instead of writing where no verifier looks.

Fault-injection flags for tests: `--hang-tool NAME` (that tool never returns), `--huge-tool NAME`
(that tool returns `HUGE_RESULT_CHARS` characters), `--crash-after N` (the process exits with
status 3 on the N-th tool call, before answering it), `--exit-after-tool-replies N` (the process
exits with status 3 right after its N-th reply to `tools/list` or `tools/call` is written out: a
crash mid-trial once the client holds that answer; N = 1 dies right after listing its tools, N = 2
answers the first tool call and then dies). The connect handshake is not counted: a client may
probe `server/discover`, fall back to `initialize`, or re-probe after a probe timed out under load
(mcp 2.3's `auto` mode), so counting every reply would crash at a different point per client.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools import Tool

DEFAULT_ANSWER_PATH = "/logs/agent/answer.txt"
HUGE_RESULT_CHARS = 1_000_000
CRASH_EXIT_CODE = 3
TOOL_NAMES = ("add", "subtract", "multiply", "divide", "submit_answer")
# Models write numbers as JSON numbers or strings; both are accepted and parsed exactly.
Number = int | float | str
# The schemas the model is shown. The agent renders every tool's schema into every prompt, and the
# SDK's generated ones (anyOf for `Number`, titles) made 93 % of a demo prompt's tokens, so each
# tool advertises this plain form instead; arguments are still validated against `Number`.
_BINARY_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
}
_ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "number"}},
    "required": ["answer"],
}


def _format(value: Fraction) -> str:
    """Integers print as integers; other exact results as a reduced decimal or fraction."""
    if value.denominator == 1:
        return str(value.numerator)
    as_float = float(value)
    return repr(round(as_float, 10))


def _parse(name: str, text: Number) -> Fraction:
    try:
        return Fraction(str(text).strip())
    except (ValueError, ZeroDivisionError) as exc:
        raise ToolError(f"argument {name}={text!r} is not a number") from exc


def build_server(
    answer_path: Path,
    hang_tool: str | None = None,
    huge_tool: str | None = None,
    crash_after: int | None = None,
) -> MCPServer:
    """The calculator server with the given answer path and fault-injection knobs."""
    calls = 0

    async def _faults(tool: str) -> str | None:
        nonlocal calls
        calls += 1
        if crash_after is not None and calls >= crash_after:
            sys.stderr.write(f"calculator server: injected crash on tool call {calls}\n")
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)  # a crash, on purpose: no cleanup, no reply
        if tool == hang_tool:
            await asyncio.Event().wait()  # never set: the call hangs until the client gives up
        if tool == huge_tool:
            return "9" * HUGE_RESULT_CHARS
        return None

    async def add(a: Number, b: Number) -> str:
        return await _faults("add") or _format(_parse("a", a) + _parse("b", b))

    async def subtract(a: Number, b: Number) -> str:
        return await _faults("subtract") or _format(_parse("a", a) - _parse("b", b))

    async def multiply(a: Number, b: Number) -> str:
        return await _faults("multiply") or _format(_parse("a", a) * _parse("b", b))

    async def divide(a: Number, b: Number) -> str:
        fault = await _faults("divide")
        if fault is not None:
            return fault
        divisor = _parse("b", b)
        if divisor == 0:
            raise ToolError("argument b=0: division by zero")
        return _format(_parse("a", a) / divisor)

    async def submit_answer(answer: Number) -> str:
        fault = await _faults("submit_answer")
        if fault is not None:
            return fault
        text = str(answer).strip()
        if not text or "\n" in text:
            raise ToolError("argument answer must be one non-empty line")
        answer_path.parent.mkdir(parents=True, exist_ok=True)
        answer_path.write_text(text + "\n")
        return f"answer {text!r} recorded"

    tools = [
        _tool(add, "a + b", _BINARY_SCHEMA),
        _tool(subtract, "a - b", _BINARY_SCHEMA),
        _tool(multiply, "a * b", _BINARY_SCHEMA),
        _tool(divide, "a / b", _BINARY_SCHEMA),
        _tool(submit_answer, "Submit the final answer once.", _ANSWER_SCHEMA),
    ]
    return MCPServer(
        name="calculator",
        instructions="Exact arithmetic tools. Call submit_answer(answer) once with the result.",
        tools=tools,
    )


def _tool(fn: Any, description: str, schema: dict[str, Any]) -> Tool:
    """A tool validated by its signature but advertised with the short `schema`."""
    tool = Tool.from_function(fn, description=description)
    return tool.model_copy(update={"parameters": schema})


class ExitAfterToolReplies(io.BufferedIOBase):
    """Standard output for `--exit-after-tool-replies`: bytes pass through to `out`; once the
    `limit`-th reply to `tools/list` or `tools/call` (a JSON-RPC message with an `id` whose result
    holds `tools` or `content`) has been flushed, the process exits with `CRASH_EXIT_CODE`: the
    client already holds that reply, the next request gets none. The MCP stdio transport writes
    one message per line and flushes after each."""

    def __init__(self, out: io.BufferedIOBase, limit: int) -> None:
        super().__init__()
        self._out, self._limit = out, limit
        self._pending = b""
        self.replies = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any, /) -> int:
        self._out.write(data)
        self._pending += bytes(data)
        return len(data)

    def flush(self) -> None:
        self._out.flush()
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not a protocol message (stray output)
            result = message.get("result") if isinstance(message, dict) else None
            if isinstance(result, dict) and "id" in message:
                self.replies += bool(result.keys() & {"tools", "content"})
        if self.replies >= self._limit:
            sys.stderr.write(f"calculator server: injected crash after reply {self.replies}\n")
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)  # a crash, on purpose: no cleanup


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answer-path", default=DEFAULT_ANSWER_PATH)
    parser.add_argument("--hang-tool", choices=TOOL_NAMES)
    parser.add_argument("--huge-tool", choices=TOOL_NAMES)
    parser.add_argument("--crash-after", type=int)
    parser.add_argument("--exit-after-tool-replies", type=int)
    args = parser.parse_args(argv)
    for flag in ("crash_after", "exit_after_tool_replies"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    answer_path = Path(args.answer_path)
    if not answer_path.parent.is_dir():
        sys.exit(
            f"calculator server: {answer_path.parent} does not exist; start the server inside "
            "the trial's environment (e.g. through NoContainerEnvironment.stdio_command)"
        )
    if args.exit_after_tool_replies is not None:
        # Not backed by fd 1, so the MCP stdio transport writes through this object in place.
        out = ExitAfterToolReplies(sys.stdout.buffer, args.exit_after_tool_replies)
        sys.stdout = io.TextIOWrapper(out)
    build_server(answer_path, args.hang_tool, args.huge_tool, args.crash_after).run("stdio")


if __name__ == "__main__":
    main()
