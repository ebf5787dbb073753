"""Throughput of the renderer + TITO accounting, in tokens per CPU-second of one core.

One trajectory = initial prompt (system + tools + user) and `--turns` turns of: a sampled reply
with a tool call (tokens as a sampler would return them) → `parse_reply` → `observation_delta`
for a tool result of `--tool-chars` characters → `append_sampled` / `append_observation` (prompt
check and digest included); then `to_datum` (digest re-check) and `to_json`. Every token of the
final trajectory is counted once. The sampler itself is not part of the measurement.

    python benchmarks/bench_renderer.py [--template tiny|qwen3] [--max-steps N]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
from tinker import types
from transformers import AutoTokenizer

from oneloop.agents.renderer import ChatRenderer
from oneloop.agents.tito import Trajectory
from oneloop.tiny_model import build_tiny_model

QWEN3_TEMPLATE = Path(__file__).parents[1] / "tests" / "fixtures" / "qwen3_chat_template.jinja"
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
     "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                     "b": {"type": "number"}}}}},
]  # fmt: skip
WORDS = "the result of adding these numbers is shown below with some context".split()


def tool_result(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS) if rng.random() < 0.7 else str(rng.randint(0, 10**6))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def make_inputs(renderer: ChatRenderer, rng: random.Random, turns: int, chars: int) -> dict:
    """The synthetic sampler outputs and tool results of one trajectory (not timed)."""
    stop = renderer.stop_token_ids[0]
    replies = []
    for turn in range(turns):
        text = (f"Adding step {turn}.\n<tool_call>\n"
                f'{{"name": "add", "arguments": {{"a": {rng.randint(0, 999)}, "b": 2}}}}'
                "\n</tool_call>")  # fmt: skip
        tokens = np.asarray([*renderer.encode(text), stop], dtype=np.int32)
        replies.append(
            types.SampledSequence(
                stop_reason="stop",
                sequence_id=f"bench/v{turn}/0",
                tokens_np=tokens,
                logprobs_np=np.full(len(tokens), -0.25, dtype=np.float32),
            )
        )
    question = f"Add {rng.randint(0, 999)} and {rng.randint(0, 999)}."
    return {"question": question, "replies": replies,
            "results": [tool_result(rng, chars) for _ in range(turns)]}  # fmt: skip


def one_trajectory(renderer: ChatRenderer, inputs: dict) -> int:
    """Everything the agent does per trajectory except sampling and calling tools."""
    messages = [{"role": "system", "content": "You are a calculator agent."},
                {"role": "user", "content": inputs["question"]}]  # fmt: skip
    trajectory = Trajectory.start(renderer.initial_prompt(messages, TOOLS))
    for turn, (sequence, text) in enumerate(zip(inputs["replies"], inputs["results"], strict=True)):
        trajectory = trajectory.append_sampled(sequence, prompt=trajectory.model_input())
        parsed = renderer.parse_reply(trajectory.segments[-1].tokens)
        assert parsed.tool_calls and not parsed.errors
        result = {"role": "tool", "tool_call_id": f"call_{turn}", "name": "add", "content": text}
        trajectory = trajectory.append_observation(renderer.observation_delta([result]))
    trajectory.to_datum(advantage=1.0)
    json.dumps(trajectory.to_json())
    return trajectory.length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", choices=("tiny", "qwen3"), default="tiny")
    parser.add_argument("--max-steps", type=int, default=20, help="trajectories to build")
    parser.add_argument("--turns", type=int, default=8, help="tool-call turns per trajectory")
    parser.add_argument("--tool-chars", type=int, default=4000, help="characters per tool result")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    if args.template == "qwen3":
        tokenizer.chat_template = QWEN3_TEMPLATE.read_text()
    renderer = ChatRenderer(tokenizer)
    rng = random.Random(0)
    one_trajectory(renderer, make_inputs(renderer, rng, 1, 100))  # warm up: template compile
    inputs = [
        make_inputs(renderer, rng, args.turns, args.tool_chars) for _ in range(args.max_steps)
    ]
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = sum(one_trajectory(renderer, one) for one in inputs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(
        f"renderer+TITO [{args.template}]: {tokens} tokens in {args.max_steps} trajectories, "
        f"{tokens / cpu / 1e6:.2f} M tokens per CPU-second ({cpu:.2f} s CPU, {wall:.2f} s wall)"
    )
    # The floor under that number: tokenising the tool results alone, same tokenizer, same text.
    texts = [text for one in inputs for text in one["results"]]
    cpu = time.process_time()
    encoded = sum(len(renderer.encode(text)) for text in texts)
    cpu = time.process_time() - cpu
    print(f"tokenizer alone on the tool results: {encoded / cpu / 1e6:.2f} M tokens per CPU-second")


if __name__ == "__main__":
    main()
