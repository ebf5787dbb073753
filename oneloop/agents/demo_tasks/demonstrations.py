"""Demonstrations of the demo task family: chat conversations with tool calls, written as JSONL.

`write_demonstrations(path, tasks, wrong_tool_fraction)` writes one conversation per task given
(the training tasks, or with `generate_tasks`'s `n_demonstrations` tasks drawn apart from the RL
and held-out ones), in the chat-conversation JSONL format the generic SFT warm start reads
(`oneloop.loop.sft`; `{"messages": [...], "tools": [...]}` per line, OpenAI-shaped: roles
system/user/assistant/tool, assistant `tool_calls`). The conversation is the calculator path:
the MCP server's real tool list, one tool call per operation innermost first, each tool result
from the real calculator server called in process, then `submit_answer` and a closing sentence.
Rendered by `ChatRenderer.conversation_tokens` it is exactly the token layout the agent samples in
(`demonstration` does that for one task).

With `wrong_tool_fraction` set (the CPU demo's preset sets `tasks.demo.wrong_tool_fraction`) the
demonstrations are deliberately imperfect, a departure from "SFT on expert data" made on purpose:
that share of the tasks, by the question's last operator, is demonstrated with a plausible
mistake, the inverse tool for the last operation (`add` for `-`, `multiply` for `/`, and back),
whose result is then submitted (wrong; for the easy questions always). Every demonstration still
copies the numbers, calls a tool and submits its result, so SFT teaches the whole format; what it
leaves uncertain is the choice of tool. The share is exact per operator (`mistaken_questions`):
just above one half, it makes the mistake what greedy decoding does after SFT, while sampling at
temperature 1 still finds the right tool almost half the time. RL, whose reward only the right
tool earns, has to shift that choice: the usual division of labour, SFT for format and RL for
correctness, made visible on a model small enough for 2 CPU cores.
Which tasks get the mistake depends only on the question texts (a hash), so it is reproducible.
"""

import ast
import asyncio
import hashlib
import json
import tempfile
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from oneloop.agents.demo_tasks.generator import DemoTask, instruction_text
from oneloop.agents.demo_tasks.server import build_server
from oneloop.agents.renderer import ChatRenderer

DEMONSTRATIONS_FILE = "demonstrations.jsonl"
"""The file name `write_demonstrations` is given beside the generated tasks (`sft.data: demo`)."""
_TOOLS = {ast.Add: "add", ast.Sub: "subtract", ast.Mult: "multiply", ast.Div: "divide"}
# The plausible wrong tool of each operation: its inverse.
INVERSE_TOOL = {"add": "subtract", "subtract": "add", "multiply": "divide", "divide": "multiply"}


def demo_tool_specs() -> list[dict[str, Any]]:
    """The calculator server's tools in the shape the agent gives the renderer."""
    server = build_server(Path(tempfile.gettempdir()) / "oneloop-sft-answer.txt")
    tools = asyncio.run(server.list_tools())
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.input_schema,
            },
        }
        for t in tools
    ]


def _steps(expression: str, wrong_last: bool = False) -> tuple[list[tuple[str, Any]], Fraction]:
    """Tool calls that evaluate `expression` innermost first, [(tool, {"a": .., "b": ..})], and
    the value they give; with `wrong_last` the last call uses `INVERSE_TOOL` of the right one."""
    calls: list[tuple[str, dict[str, Any]]] = []
    root = ast.parse(expression, mode="eval").body

    def visit(node: ast.expr) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -visit(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _TOOLS:
            a, b = visit(node.left), visit(node.right)
            tool = _TOOLS[type(node.op)]
            if wrong_last and node is root:
                tool = INVERSE_TOOL[tool]
            calls.append((tool, {"a": _num(a), "b": _num(b)}))
            ops = {
                "add": a + b,
                "subtract": a - b,
                "multiply": a * b,
                "divide": a / b if b else Fraction(0),
            }
            return ops[tool]
        raise ValueError(f"not a demo expression: {ast.dump(node)}")

    value = visit(root)
    return calls, value


def _num(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


def _question_hash(task: DemoTask) -> bytes:
    return hashlib.sha256(task.question.text.encode()).digest()


def mistaken_questions(tasks: Sequence[DemoTask], fractions: Mapping[str, float]) -> frozenset[str]:
    """The questions whose demonstration makes the wrong-tool mistake: for each last operator,
    exactly round(share × its tasks) of them (`fractions`: operator → share, absent = 0), the ones
    whose question text hashes lowest. Exact shares matter: the demo relies on the mistake being
    the majority for greedy decoding yet close enough to half for RL to overturn."""
    by_operator: dict[str, list[DemoTask]] = {}
    for task in tasks:
        by_operator.setdefault(task.question.text.split()[-2], []).append(task)
    chosen: set[str] = set()
    for operator, group in by_operator.items():
        count = round(fractions.get(operator, 0.0) * len(group))
        chosen.update(t.question.text for t in sorted(group, key=_question_hash)[:count])
    return frozenset(chosen)


def demo_conversation(
    task: DemoTask,
    tools: list[dict[str, Any]],
    system_prompt: str | None,
    wrong_tool: bool = False,
) -> dict[str, Any]:
    """One task's demonstration as a chat conversation `{"messages": [...], "tools": tools}`: the
    calculator path, with the wrong last tool when `wrong_tool` (see `mistaken_questions`)."""
    messages: list[dict[str, Any]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": instruction_text(task.question)})
    steps, value = _steps(task.question.text, wrong_tool)
    submitted = _num(value)
    calls = [*steps, ("submit_answer", {"answer": submitted})]
    with tempfile.TemporaryDirectory(prefix="oneloop-sft-") as scratch:
        server = build_server(Path(scratch) / "answer.txt")
        for name, arguments in calls:
            call = {"id": "call_0", "type": "function",
                    "function": {"name": name, "arguments": arguments}}  # fmt: skip
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            result = asyncio.run(server.call_tool(name, arguments))
            text = "".join(getattr(c, "text", "") for c in result.content)
            messages.append(
                {"role": "tool", "tool_call_id": "call_0", "name": name, "content": text}
            )
    messages.append({"role": "assistant", "content": f"The answer is {submitted}."})
    return {"messages": messages, "tools": tools}


def demonstration(
    task: DemoTask,
    renderer: ChatRenderer,
    tools: list[dict[str, Any]],
    system_prompt: str | None,
    wrong_tool: bool = False,
) -> tuple[list[int], list[float]]:
    """Token ids of one task's demonstration and weights (1 on the assistant's tokens), rendered
    as the warm start renders every conversation (`ChatRenderer.conversation_tokens`)."""
    conversation = demo_conversation(task, tools, system_prompt, wrong_tool)
    return renderer.conversation_tokens(conversation["messages"], conversation["tools"])


def write_demonstrations(
    path: Path,
    tasks: Sequence[DemoTask],
    wrong_tool_fraction: Mapping[str, float],
    system_prompt: str | None = None,
) -> Path:
    """Write one demonstration per task of `tasks`, in order, to the JSONL file `path`: the
    `mistaken_questions` of `wrong_tool_fraction` call the inverse tool. Returns `path`."""
    tools = demo_tool_specs()
    mistaken = mistaken_questions(tasks, wrong_tool_fraction)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(demo_conversation(t, tools, system_prompt, t.question.text in mistaken))
        for t in tasks
    ]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def dump_demo(tokens: list[int], weights: list[float], renderer: ChatRenderer) -> str:
    """A readable rendering (for debugging): the text with trained spans in brackets."""
    return json.dumps({"text": renderer.decode(tokens), "trained": int(sum(weights))})
