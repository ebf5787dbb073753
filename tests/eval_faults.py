"""Fault injection for the eval tests: a flaky environment and a calculator with broken tools.

* `FlakyStartEnvironment` (load it by import path `tests.eval_faults:FlakyStartEnvironment`): the
  no-container environment whose every other `start()` fails, counted across processes in the
  file `counter_path` (environment kwarg) under an exclusive lock: starts 1, 3, 5, ... fail.
* `python tests/eval_faults.py --answer-path P --error-tool add --traceback-tool subtract`: the
  demo calculator MCP server (same tool list, so prompts match the demo's) where `--error-tool`
  always fails with the MCP `is_error` flag and `--traceback-tool` computes its result but
  returns it after a Python traceback text, without the flag (a harness quirk only an error
  pattern can catch).
"""

from __future__ import annotations

import argparse
import fcntl
import os
from pathlib import Path
from typing import Any

from oneloop.agents.environment import EnvironmentStartError, NoContainerEnvironment

TRACEBACK_TEXT = (
    "Traceback (most recent call last):\n"
    '  File "/srv/calculator/backend.py", line 12, in compute\n'
    "RuntimeError: injected backend failure (the tool still reports success)\n"
)


def next_start(counter_path: Path) -> int:
    """Increment the shared start counter; returns this start's number (1-based)."""
    with counter_path.open("a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        number = int(handle.read().strip() or 0) + 1
        handle.seek(0)
        handle.truncate()
        handle.write(str(number))
        handle.flush()
        os.fsync(handle.fileno())
        return number


class FlakyStartEnvironment(NoContainerEnvironment):
    """NoContainerEnvironment whose odd-numbered starts fail (kwarg `counter_path`)."""

    def __init__(self, *args: Any, counter_path: str, **kwargs: Any) -> None:
        self._counter_path = Path(counter_path)
        super().__init__(*args, **kwargs)

    async def start(self, force_build: bool) -> None:
        number = next_start(self._counter_path)
        if number % 2 == 1:
            raise EnvironmentStartError(f"injected flaky start #{number}")
        await super().start(force_build)


def faulty_server(answer_path: Path, error_tool: str | None, traceback_tool: str | None) -> Any:
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.types import CallToolResult, TextContent

    from oneloop.agents.demo_tasks.server import build_server

    server = build_server(answer_path)
    original = server.call_tool

    async def call_tool(name: str, arguments: dict, context: Any = None) -> Any:
        if name == error_tool:
            raise ToolError(f"injected failure of {name}")
        result = await original(name, arguments, context)
        if name == traceback_tool:
            text = TRACEBACK_TEXT + "".join(getattr(c, "text", "") for c in result.content)
            # Keep the structured twin consistent: clients check it against the output schema.
            structured = dict(result.structured_content or {})
            if "result" in structured:
                structured["result"] = text
            return CallToolResult(
                content=[TextContent(type="text", text=text)],
                structured_content=structured or None,
            )
        return result

    server.call_tool = call_tool  # the request handler looks it up on the instance
    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer-path", required=True)
    parser.add_argument("--error-tool")
    parser.add_argument("--traceback-tool")
    args = parser.parse_args()
    faulty_server(Path(args.answer_path), args.error_tool, args.traceback_tool).run("stdio")


if __name__ == "__main__":
    main()
