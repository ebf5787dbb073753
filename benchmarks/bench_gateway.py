"""The OpenAI gateway's cost, measured side by side in one run on the tiny model (CPU).

(a) Overhead per turn: `--sessions` (default 16) concurrent conversations of `--turns` turns
    each, every turn one sample of `--max-tokens` tokens plus a user note, run (1) directly on
    the local backend's sampling client with token ids (the MCP agent's path: `Trajectory`,
    `observation_delta`) and (2) through the gateway with the official `openai` async client
    (messages in, text out; the gateway renders, samples the same client, parses, accounts),
    with the agents' clients in this process and, as in a trial, in a process of their own.
    Ratio = gateway wall time / direct wall time (goal <= 1.10). One more run of each measures
    CPU ms per turn: the agents' process (their openai clients), the gateway's process and, for
    the direct side, the client's process. Seeds are equal on both
    sides. Timed runs alternate which side goes first; medians of `--repeats`.
(b) Render + accounting tokens/s per core: the gateway's per-turn CPU work (message keys,
    observation delta, `append_sampled`, reply decode + tool-call parse) on replies recorded
    from the real sampler, process CPU time, no HTTP and no sampling (goal >= 1 M tokens/s
    counting every token a turn's prompt holds, as the agent's path is counted).

    .venv/bin/python benchmarks/bench_gateway.py
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tinker import types

GOAL_RATIO = 1.10
GOAL_TOKENS_PER_S = 1_000_000
TIMEOUT_S = 300.0
NOTE = "Thanks. Please continue with the next step of the calculation, briefly."


async def direct_conversation(client: Any, renderer: Any, seed: int, args: Any) -> int:
    from oneloop.agents.tito import Trajectory

    messages = [{"role": "user", "content": "What is 12 + 30? Use the tools."}]
    trajectory = Trajectory.start(renderer.initial_prompt(messages))
    for turn in range(args.turns):
        prompt = trajectory.model_input()
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0,
                                      seed=seed + turn, stop=list(renderer.stop_token_ids))
        response = await asyncio.wait_for(client.sample(prompt, 1, params), TIMEOUT_S)
        trajectory = trajectory.append_sampled(response.sequences[0], prompt=prompt)
        tokens = trajectory.segments[-1].tokens
        renderer.parse_reply(tokens)
        delta = renderer.observation_delta(
            [{"role": "user", "content": NOTE}], after_stop_token=renderer.ends_with_stop(tokens)
        )
        trajectory = trajectory.append_observation(delta)
    return trajectory.length


async def gateway_conversation(oa: Any, seed: int, args: Any) -> int:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is 12 + 30? Use the tools."}
    ]
    for turn in range(args.turns):
        reply = await oa.chat.completions.create(
            model="oneloop", messages=messages, max_tokens=args.max_tokens, temperature=1.0,
            seed=seed + turn, timeout=TIMEOUT_S,
        )  # fmt: skip
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": NOTE})
    return len(messages)


async def run_side(side: str, client: Any, renderer: Any, gateway: Any, args: Any,
                   repeat: int) -> float:  # fmt: skip
    import openai

    if side == "direct":
        jobs = [direct_conversation(client, renderer, 1000 * i, args) for i in range(args.sessions)]
    else:
        # One client per agent, made before timing (an agent keeps its client for its trial).
        names = [f"bench-{repeat}-{i}" for i in range(args.sessions)]
        clients = [openai.AsyncOpenAI(base_url=gateway.session_url(n), api_key="x", max_retries=0)
                   for n in names]  # fmt: skip
        jobs = [gateway_conversation(c, 1000 * i, args) for i, c in enumerate(clients)]
    started = time.perf_counter()
    await asyncio.gather(*jobs)
    elapsed = time.perf_counter() - started
    if side == "gateway":
        await asyncio.gather(*(c.close() for c in clients))
    if side == "gateway":
        for name in names:
            session = gateway.close_session(name)
            assert session is not None and session.counters()["history_rewrites"] == 0
            assert session.counters()["continued"] == args.turns - 1
    return elapsed


def _agents_process(urls: list[str], turns: int, max_tokens: int, out: Any) -> None:
    """Child process: one openai client per session, all conversations at once; sends the
    wall and CPU seconds of the conversations (client setup excluded)."""
    import openai

    args = argparse.Namespace(turns=turns, max_tokens=max_tokens)

    async def go() -> tuple[float, float]:
        clients = [openai.AsyncOpenAI(base_url=u, api_key="x", max_retries=0) for u in urls]
        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(gateway_conversation(c, 1000 * i, args)
                               for i, c in enumerate(clients)))  # fmt: skip
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        await asyncio.gather(*(c.close() for c in clients))
        return elapsed, cpu

    out.send(asyncio.run(go()))


def run_gateway_apart(gateway: Any, args: Any, repeat: int, cpu: dict | None = None) -> float:
    """The gateway side with the agents in a process of their own (as in a trial, where the
    agent and the gateway do not share an interpreter lock); `cpu` gets the CPU seconds of the
    agents' process (their openai clients) and of this one (the gateway)."""
    import multiprocessing

    names = [f"apart-{repeat}-{i}" for i in range(args.sessions)]
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_agents_process, args=(
        [gateway.session_url(n) for n in names], args.turns, args.max_tokens, send))  # fmt: skip
    mine = time.process_time()  # this process's CPU from here on is the gateway's (and idle)
    child.start()
    try:
        if not receive.poll(TIMEOUT_S):
            raise TimeoutError(f"the agents' process gave no result within {TIMEOUT_S} s")
        elapsed, agents = receive.recv()
        if cpu is not None:
            cpu.update(agents=agents, gateway=time.process_time() - mine)
    finally:
        child.join(TIMEOUT_S)
    for name in names:
        gateway.close_session(name)
    return elapsed


def bench_overhead(client: Any, renderer: Any, gateway: Any, args: Any) -> dict[str, float]:
    asyncio.run(run_side("direct", client, renderer, gateway, args, -1))  # warm-up
    asyncio.run(run_side("gateway", client, renderer, gateway, args, -1))
    run_gateway_apart(gateway, args, -1)
    times: dict[str, list[float]] = {"direct": [], "gateway": [], "apart": []}
    for repeat in range(args.repeats):
        order = ["direct", "gateway", "apart"]
        for side in order[repeat % 3 :] + order[: repeat % 3]:
            if side == "apart":
                times[side].append(run_gateway_apart(gateway, args, repeat))
            else:
                times[side].append(asyncio.run(run_side(side, client, renderer, gateway, args,
                                                        repeat)))  # fmt: skip
    direct = statistics.median(times["direct"])
    turns = args.sessions * args.turns
    cpu: dict[str, float] = {}
    run_gateway_apart(gateway, args, args.repeats, cpu)
    started = time.process_time()
    asyncio.run(run_side("direct", client, renderer, gateway, args, args.repeats))
    cpu["direct"] = time.process_time() - started
    out = {"direct_s": direct} | {f"cpu_ms_{k}": 1000 * v / turns for k, v in cpu.items()}
    for side in ("gateway", "apart"):
        via = statistics.median(times[side])
        out |= {f"{side}_s": via, f"{side}_ratio": via / direct,
                f"{side}_overhead_ms": 1000 * (via - direct) / turns}  # fmt: skip
    return out


def bench_accounting(client: Any, renderer: Any, args: Any) -> dict[str, float]:
    """CPU rate of a session's per-turn work on replies recorded from the real sampler."""
    from oneloop.agents.gateway.sessions import SamplingDefaults, Session
    from oneloop.agents.gateway.wire import ChatRequest

    recorded: list[types.SampleResponse] = []

    class Replay:
        """Hands back recorded real sampler responses (no sampling in the timed part)."""

        async def sample(self, prompt: Any, n: int, params: Any) -> types.SampleResponse:
            return recorded[len(calls) % len(recorded)]

    calls: list[int] = []
    prompt = types.ModelInput.from_ints(renderer.initial_prompt([{"role": "user",
                                                                  "content": "hi"}]))  # fmt: skip
    for seed in range(8):
        params = types.SamplingParams(max_tokens=args.max_tokens, seed=seed,
                                      stop=list(renderer.stop_token_ids))  # fmt: skip
        recorded.append(client.sample(prompt, 1, params).result(TIMEOUT_S))

    async def conversation() -> int:
        session = Session("acct", Replay(), renderer,
                          SamplingDefaults(context_window=1 << 30, max_tokens=args.max_tokens))
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 12 + 30?"}]
        counted = 0
        for _ in range(args.accounting_turns):
            request = ChatRequest.model_validate({"model": "oneloop", "messages": messages})
            base, continued = session.plan_chat(request)
            sampled = await session.sample(request, base, continued, tools_offered=True)
            calls.append(1)
            counted += sampled.choices[0].trajectory.length
            messages.append(sampled.choices[0].reply.message)
            messages.append({"role": "user", "content": NOTE})
        return counted

    started = time.process_time()
    tokens = asyncio.run(conversation())
    cpu = time.process_time() - started
    return {"tokens": tokens, "cpu_s": cpu, "tokens_per_s": tokens / cpu}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accounting-turns", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the sampler")
    args = parser.parse_args(argv)
    from oneloop.agents.gateway import Gateway, GatewayConfig, SamplingDefaults
    from oneloop.agents.renderer import ChatRenderer
    from oneloop.backends import BackendConfig, connect
    from oneloop.tiny.model import TINY_MODEL_NAME, build_tiny_model

    tokenizer = str(build_tiny_model())
    renderer = ChatRenderer.from_pretrained(tokenizer)
    with tempfile.TemporaryDirectory() as run_dir:
        backend = connect(BackendConfig(backend="local", run_dir=Path(run_dir),
                                        local={"torch_threads": args.threads}))  # fmt: skip
        try:
            client = backend.create_sampling_client(base_model=TINY_MODEL_NAME).result(TIMEOUT_S)
            config = GatewayConfig(tokenizer_path=tokenizer, max_sessions=4 * args.sessions,
                                   defaults=SamplingDefaults(context_window=4096))  # fmt: skip
            with Gateway(config, client) as gateway:
                a = bench_overhead(client, renderer, gateway, args)
            b = bench_accounting(client, renderer, args)
        finally:
            backend.close()
    print(f"(a) {args.sessions} sessions x {args.turns} turns, {args.max_tokens} tokens/turn: "
          f"direct {a['direct_s']:.3f} s")  # fmt: skip
    for side, words in (("gateway", "agents in this process"),
                        ("apart", "agents in their own process")):  # fmt: skip
        print(f"    gateway, {words}: {a[f'{side}_s']:.3f} s   ratio {a[f'{side}_ratio']:.3f} "
              f"(goal <= {GOAL_RATIO}); overhead {a[f'{side}_overhead_ms']:.1f} ms/turn")
    print(f"    CPU ms per turn, agents apart: their openai clients {a['cpu_ms_agents']:.2f}, "
          f"the gateway's process {a['cpu_ms_gateway']:.2f}; direct: the client's process "
          f"{a['cpu_ms_direct']:.2f} (the sampler actor is a process of its own)")  # fmt: skip
    print(f"(b) render + accounting: {b['tokens']} tokens in {b['cpu_s']:.3f} CPU s = "
          f"{b['tokens_per_s'] / 1e6:.2f} M tokens/s per core (goal >= "
          f"{GOAL_TOKENS_PER_S / 1e6:.0f} M)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
