"""Throughput of the renderer + TITO accounting, in tokens per CPU-second of one core.

One trajectory follows the MCP agent's per-turn path (`mcp_agent.run_episode`) minus the sampler
and the tool calls: initial prompt (system + tools + user); then `--turns` turns of
`Trajectory.model_input()` → a sampled reply with a tool call (tokens as a sampler returns them)
→ `append_sampled` (prompt check, digest) → `parse_reply` → the tool result of `--tool-chars`
characters through `neutralize` + `truncate_middle` → `observation_delta` → `append_observation`;
then `to_datum` (digest re-check) and `json.dumps(to_json())`. With `--agent-context` each turn
also runs the agent's Harbor accounting (`mcp_agent.ContextFiller`: token counts, per-turn
`rollout_details`, `to_json()` into the metadata), as `run_episode`'s `on_turn` does.

A "token" is one token id of a finished trajectory (initial prompt + sampled replies +
observation deltas), each counted once; throughput = tokens / CPU seconds of this process
(`time.process_time`, one core: the renderer is single-threaded). The floor beside it is the
tokenizer alone on the same (neutralised, truncated) tool results, measured in the same repeat:
tokenising the observations is work the path cannot skip. Each repeat times both; medians are
printed with the goal (>= 1 M tokens per CPU-second).

    python benchmarks/bench_renderer.py [--template tiny|qwen3] [--max-steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
from harbor.models.agent.context import AgentContext
from tinker import types
from transformers import AutoTokenizer

from oneloop.agents.mcp_agent import ContextFiller, McpAgentConfig, McpToolbox, TurnRecord
from oneloop.agents.renderer import ChatRenderer
from oneloop.agents.tito import Trajectory
from oneloop.agents.tool_parsing import truncate_middle
from oneloop.tiny.model import build_tiny_model

QWEN3_TEMPLATE = Path(__file__).parents[1] / "tests" / "fixtures" / "qwen3_chat_template.jinja"
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
     "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                     "b": {"type": "number"}}}}},
]  # fmt: skip
WORDS = "the result of adding these numbers is shown below with some context".split()
GOAL_TOKENS_PER_CPU_S = 1e6
MAX_TOOL_CHARS = McpAgentConfig.tool_result_max_chars  # the agent's default truncation


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


def one_trajectory(renderer: ChatRenderer, inputs: dict, agent_context: bool = False) -> int:
    """Everything the agent does per trajectory except sampling and calling tools."""
    context, turns = AgentContext(), []
    toolbox = McpToolbox([], config=McpAgentConfig(sampler_key="bench", tokenizer_path="bench"))
    fill = ContextFiller(context, toolbox)
    messages = [{"role": "system", "content": "You are a calculator agent."},
                {"role": "user", "content": inputs["question"]}]  # fmt: skip
    trajectory = Trajectory.start(renderer.initial_prompt(messages, TOOLS))
    for turn, (sequence, text) in enumerate(zip(inputs["replies"], inputs["results"], strict=True)):
        prompt = trajectory.model_input()
        trajectory = trajectory.append_sampled(sequence, prompt=prompt)
        tokens = trajectory.segments[-1].tokens
        if agent_context:
            turns.append(TurnRecord(prompt.length, 4096, 0.0))
            fill(trajectory, turns)
        stopped = renderer.ends_with_stop(tokens)
        parsed = renderer.parse_reply(tokens)
        assert parsed.tool_calls and not parsed.errors
        content = truncate_middle(renderer.neutralize(text), MAX_TOOL_CHARS)
        result = {"role": "tool", "tool_call_id": f"call_{turn}", "name": "add", "content": content}
        delta = renderer.observation_delta([result], after_stop_token=stopped)
        trajectory = trajectory.append_observation(delta)
    trajectory.to_datum(advantage=1.0)
    json.dumps(trajectory.to_json())
    return trajectory.length


def measure(
    renderer: ChatRenderer, inputs: list[dict], agent_context: bool
) -> tuple[float, float, int, int]:
    """One repeat: (renderer+TITO tokens per CPU-s, tokenizer-alone tokens per CPU-s, tokens,
    tool-result tokens)."""
    cpu = time.process_time()
    tokens = sum(one_trajectory(renderer, one, agent_context) for one in inputs)
    cpu = time.process_time() - cpu
    texts = [truncate_middle(renderer.neutralize(text), MAX_TOOL_CHARS)
             for one in inputs for text in one["results"]]  # fmt: skip
    floor_cpu = time.process_time()
    encoded = sum(len(renderer.encode(text)) for text in texts)
    floor_cpu = time.process_time() - floor_cpu
    return tokens / cpu, encoded / floor_cpu, tokens, encoded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", choices=("tiny", "qwen3"), default="tiny")
    parser.add_argument("--max-steps", type=int, default=20, help="trajectories to build")
    parser.add_argument("--turns", type=int, default=8, help="tool-call turns per trajectory")
    parser.add_argument("--tool-chars", type=int, default=4000, help="characters per tool result")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
    parser.add_argument("--agent-context", action="store_true",
                        help="also run the agent's per-turn Harbor accounting (ContextFiller)")
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
    runs = []
    for repeat in range(args.repeats):
        path, floor, tokens, encoded = measure(renderer, inputs, args.agent_context)
        runs.append((path, floor))
        print(f"repeat {repeat}: renderer+TITO {path / 1e6:.2f} M tokens/CPU-s, "
              f"tokenizer alone {floor / 1e6:.2f} M tokens/CPU-s")  # fmt: skip
    path = statistics.median(r[0] for r in runs)
    floor = statistics.median(r[1] for r in runs)
    ratio = statistics.median(r[0] / r[1] for r in runs)
    label = args.template + (", agent context" if args.agent_context else "")
    print(
        f"renderer+TITO [{label}]: {tokens} tokens in {args.max_steps} trajectories "
        f"({encoded} of them tool-result tokens); median of {args.repeats}: "
        f"{path / 1e6:.2f} M tokens per CPU-second (goal >= {GOAL_TOKENS_PER_CPU_S / 1e6:.2f} M: "
        f"{'met' if path >= GOAL_TOKENS_PER_CPU_S else 'missed'}); tokenizer alone on the tool "
        f"results {floor / 1e6:.2f} M tokens per CPU-second; path / tokenizer-alone {ratio:.2f}"
    )


if __name__ == "__main__":
    main()
