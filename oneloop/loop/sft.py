"""SFT warm start through the same seam: demonstrations of the demo task family, `cross_entropy`.

A demonstration is rendered exactly the way the agent builds its trajectories (initial prompt with
the MCP server's real tool list, assistant turns closed by the stop token, observation deltas from
the renderer), so the warm start teaches the token layout the agent will sample in. Tool results
come from the real calculator server, called in process.

With `wrong_tool_fraction` set (the CPU demo's preset sets `sft.wrong_tool_fraction`) the
demonstrations are deliberately imperfect, a departure from "SFT on expert data" made on purpose:
that share of the training tasks, by the question's last operator, is demonstrated with a plausible
mistake, the inverse tool for the last operation (`add` for `-`, `multiply` for `/`, and back),
whose result is then submitted (wrong; for the easy questions always). Every demonstration still
copies the numbers, calls a tool and submits its result, so SFT teaches the whole format; what it
leaves uncertain is the choice of tool. The share is exact per operator (`mistaken_questions`):
just above one half, it makes the mistake what greedy decoding does after SFT, while sampling at
temperature 1 still finds the right tool almost half the time. RL,
whose reward only the right tool earns, has to shift that choice: the usual division of labour,
SFT for format and RL for correctness, made visible on a model small enough for 2 CPU cores.
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

import numpy as np
from tinker import types

from oneloop.agents.demo_tasks.generator import DemoTask, instruction_text
from oneloop.agents.demo_tasks.server import build_server
from oneloop.agents.renderer import ChatRenderer

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


def demonstration(
    task: DemoTask,
    renderer: ChatRenderer,
    tools: list[dict[str, Any]],
    system_prompt: str | None,
    wrong_tool: bool = False,
) -> tuple[list[int], list[float]]:
    """Token ids of one episode and weights (1 on the assistant's tokens): the calculator path,
    with the wrong last tool when `wrong_tool` (see `mistaken_questions` and the module doc)."""
    messages: list[dict[str, Any]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": instruction_text(task.question)})
    tokens = renderer.initial_prompt(messages, tools)
    weights = [0.0] * len(tokens)
    steps, value = _steps(task.question.text, wrong_tool)
    submitted = _num(value)
    calls = [*steps, ("submit_answer", {"answer": submitted})]
    with tempfile.TemporaryDirectory(prefix="oneloop-sft-") as scratch:
        server = build_server(Path(scratch) / "answer.txt")
        for name, arguments in calls:
            reply = {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": name, "arguments": arguments}}
                ],
            }
            assistant = _assistant_tokens(renderer, messages, reply, tools)
            tokens += assistant
            weights += [1.0] * len(assistant)
            result = asyncio.run(server.call_tool(name, arguments))
            text = "".join(getattr(c, "text", "") for c in result.content)
            observation = [
                {"role": "tool", "tool_call_id": "call_0", "name": name, "content": text}
            ]
            delta = renderer.observation_delta(observation, after_stop_token=True)
            tokens += delta
            weights += [0.0] * len(delta)
            messages += [reply, *observation]
    final = {"role": "assistant", "content": f"The answer is {submitted}."}
    assistant = _assistant_tokens(renderer, messages, final, tools)
    return tokens + assistant, weights + [1.0] * len(assistant)


def _assistant_tokens(
    renderer: ChatRenderer,
    messages: list[dict[str, Any]],
    reply: dict[str, Any],
    tools: list[dict[str, Any]],
) -> list[int]:
    """The assistant turn's tokens up to and including its stop token, as the template renders."""
    before = renderer.render_text(messages, tools=tools, add_generation_prompt=True)
    after = renderer.render_text([*messages, reply], tools=tools)
    if not after.startswith(before):
        raise ValueError("chat_template: an assistant turn does not extend the generation prompt")
    text = after[len(before) :]
    stops = [(text.find(s), s) for s in renderer.stop_strings if s in text]
    if not stops:
        raise ValueError("chat_template: the assistant turn has no stop token")
    position, stop = min(stops)
    return renderer.encode(text[: position + len(stop)])


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
    """`steps` cross_entropy steps over shuffled demonstrations (token-mean per batch), at a
    constant rate or one decaying linearly to 0 (`lr_schedule`)."""
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


def demo_system_prompt() -> str | None:
    """The demo uses no system prompt: the instruction says what to do."""
    return None


def dump_demo(tokens: list[int], weights: list[float], renderer: ChatRenderer) -> str:
    """A readable rendering (for debugging): the text with trained spans in brackets."""
    return json.dumps({"text": renderer.decode(tokens), "trained": int(sum(weights))})
