"""Benchmark: demo-family trials per second at concurrency 16, and where the time goes.

Runs real Harbor trials (one Ray task each) of generated demo tasks in the no-container
environment, through `oneloop.agents.trials.TrialRunner`, and prints throughput plus the mean,
p50 and p90 of each phase (queue, environment start, agent, LLM sampling and tools where the
agent reports them, verifier, whole trial). It also times MCP connect alone: starting the shipped
calculator server inside an environment over stdio, initialising and listing its tools.

    python benchmarks/bench_trials.py               # Harbor's oracle agent
    python benchmarks/bench_trials.py --agent mcp   # McpToolAgent + tiny model, local backend
    python benchmarks/bench_trials.py --compare-roots [--also module:Class]

`--compare-roots` measures the container-free environment's per-trial overlay of the host root
(`host_root=overlay`) against the host's directories bound read-write (`host_root=shared`) and,
with `--also`, any other environment class (e.g. an older copy of the environment on
PYTHONPATH): oracle trials at `--concurrency`, the variants interleaved batch by batch, and
prints each one's start-to-verifier time per trial (environment start + agent setup + agent
phase; the oracle's solve.sh is trivial, so this is the environment's own overhead) and the
ratio to the shared root.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

import oneloop  # noqa: E402,F401
from oneloop.agents.demo_tasks import generate_tasks  # noqa: E402
from oneloop.agents.trials import TrialRunner, TrialRunnerConfig, TrialTimings  # noqa: E402


def _stats(values: list[float]) -> str:
    if not values:
        return "n/a"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    mean, p50 = statistics.fmean(values), statistics.median(values)
    return f"mean {mean:7.3f}  p50 {p50:7.3f}  p90 {p90:7.3f}"


async def _mcp_connect_times(work: Path, n: int, forkserver: bool) -> list[float]:
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths
    from mcp import ClientSession, StdioServerParameters, stdio_client

    from oneloop.agents.environment import NoContainerEnvironment

    times = []
    for i in range(n):
        name = f"mcp-{'fork' if forkserver else 'exec'}-{i}"
        paths = TrialPaths(work / name)
        paths.mkdir()
        env = NoContainerEnvironment(
            environment_dir=work / "none",
            environment_name="bench",
            session_id=name,
            trial_paths=paths,
            task_env_config=EnvironmentConfig(),
            root_base_dir=work / "roots",
            stdio_forkserver=forkserver,
        )
        await env.start(False)
        try:
            command, args = env.stdio_command(
                sys.executable, ["-m", "oneloop.agents.demo_tasks.server"]
            )
            started = time.perf_counter()
            params = StdioServerParameters(command=command, args=args)
            async with stdio_client(params) as (read, write):
                async with ClientSession(read, write, read_timeout_seconds=30.0) as session:
                    await asyncio.wait_for(session.initialize(), 30.0)
                    await asyncio.wait_for(session.list_tools(), 30.0)
                    times.append(time.perf_counter() - started)
        finally:
            await env.stop(delete=True)
    return times


def _mcp_agent_setup(work: Path) -> tuple[dict, object]:
    from oneloop.backends import BackendConfig, connect
    from oneloop.tiny.model import TINY_MODEL_NAME, build_tiny_model

    model_dir = build_tiny_model()
    service = connect(BackendConfig(backend="local", run_dir=work / "backend", local={}))
    client = service.create_sampling_client(base_model=TINY_MODEL_NAME).result()
    kwargs = {"tokenizer_path": str(model_dir), "max_turns": 4, "max_tokens_per_turn": 64}
    return kwargs, client


async def _run(args: argparse.Namespace, work: Path) -> None:
    n_tasks = max(1, args.trials // args.group_size)
    splits = generate_tasks(work / "tasks", n_train=n_tasks, n_eval=0, seed=0)
    sampling_client = None
    if args.agent == "oracle":
        agent = {"agent_name": "oracle", "agent_import_path": None}
    else:
        kwargs, sampling_client = _mcp_agent_setup(work)
        agent = {"agent_kwargs": kwargs}
    runner = TrialRunner(
        TrialRunnerConfig(
            trials_dir=work / "trials",
            environment_kwargs={
                "root_base_dir": str(work / "roots"),
                "stdio_forkserver": args.stdio_forkserver == "on",
            },
            max_concurrent_trials=args.concurrency,
            trials_per_second=args.rate,
            **agent,
        )
    )
    # Warm-up: start the Ray worker processes once so the measurement is steady state.
    await runner.run_group(splits.train[0].path, min(args.concurrency, 4), sampling_client)
    started = time.perf_counter()
    groups = await asyncio.wait_for(
        asyncio.gather(
            *(runner.run_group(t.path, args.group_size, sampling_client) for t in splits.train)
        ),
        timeout=args.timeout,
    )
    wall = time.perf_counter() - started
    results = [r for g in groups for r in g.results]
    print(f"agent={args.agent} trials={len(results)} concurrency={args.concurrency} "
          f"rate_limit={args.rate}/s cpus={os.cpu_count()} "
          f"loadavg_1m={os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"wall {wall:.2f} s  ->  {len(results) / wall:.2f} trials/s")
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome.value] = outcomes.get(r.outcome.value, 0) + 1
    print(f"outcomes {outcomes}  rewards mean "
          f"{statistics.fmean([r.reward for r in results if r.reward is not None] or [0.0]):.3f}")
    print("phase seconds per trial:")
    for f in fields(TrialTimings):
        values = [getattr(r.timings, f.name) for r in results]
        if any(values):
            print(f"  {f.name:16s} {_stats(values)}")
    # Side by side: the same connects with and without the stdio fork server, interleaved.
    await _mcp_connect_times(work, 1, True)  # start the fork server outside the measurement
    fork, direct = [], []
    for _ in range(args.mcp_connects):
        fork += await _mcp_connect_times(work, 1, True)
        direct += await _mcp_connect_times(work, 1, False)
    print(f"  {'mcp_connect*':16s} {_stats(direct)}   (*stdio server in env + "
          "initialize + list_tools, measured alone; started directly)")
    print(f"  {'mcp_connect_fork*':16s} {_stats(fork)}   (the same through the stdio fork server)")
    speedup = statistics.median(direct) / statistics.median(fork)
    print(f"  fork server vs direct start: {speedup:.2f}x faster (median)")
    print("counters", {k: v for k, v in runner.counters().items() if v})


def _start_to_verifier(t: TrialTimings) -> float:
    return t.env_start_sec + t.agent_setup_sec + t.agent_sec


async def _compare_roots(args: argparse.Namespace, work: Path) -> None:
    from oneloop.agents.environment import NO_CONTAINER_IMPORT_PATH

    (task,) = generate_tasks(work / "tasks", n_train=1, n_eval=0, seed=0).train
    variants: dict[str, tuple[str, dict]] = {
        "overlay": (NO_CONTAINER_IMPORT_PATH, {"host_root": "overlay"}),
        "shared": (NO_CONTAINER_IMPORT_PATH, {"host_root": "shared"}),
    }
    if args.also:
        variants["also"] = (args.also, {})
        print(f"also = {args.also}")
    runners = {
        name: TrialRunner(
            TrialRunnerConfig(
                trials_dir=work / f"trials-{index}",
                agent_name="oracle",
                agent_import_path=None,
                environment_import_path=path,
                environment_kwargs={"root_base_dir": str(work / "roots"), **kwargs},
                max_concurrent_trials=args.concurrency,
                trials_per_second=args.rate,
                max_infra_retries=0,
            )
        )
        for index, (name, (path, kwargs)) in enumerate(variants.items())
    }
    for runner in runners.values():  # warm-up: Ray workers and imports
        await runner.run_group(task.path, args.concurrency, None)
    timings: dict[str, list[TrialTimings]] = {name: [] for name in runners}
    walls: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            started = time.perf_counter()
            group = await asyncio.wait_for(
                runner.run_group(task.path, args.concurrency, None), args.timeout
            )
            walls[name].append(time.perf_counter() - started)
            bad = [r.error for r in group.results if r.reward != 1.0]
            if bad:
                raise SystemExit(f"{name}: trials failed: {bad[:2]}")
            timings[name] += [r.timings for r in group.results]
    print(f"oracle trials, concurrency={args.concurrency}, {args.rounds} interleaved rounds, "
          f"cpus={os.cpu_count()} loadavg_1m={os.getloadavg()[0]:.1f}")  # fmt: skip
    base = statistics.fmean(_start_to_verifier(t) for t in timings["shared"])
    for name, values in timings.items():
        s2v = [_start_to_verifier(t) for t in values]
        ratio = statistics.fmean(s2v) / base
        print(f"  {name:10s} start-to-verifier {_stats(s2v)}  ({ratio:.2f}x shared)")
        print(f"  {'':10s} env_start         {_stats([t.env_start_sec for t in values])}")
        print(f"  {'':10s} verifier          {_stats([t.verifier_sec for t in values])}")
        print(f"  {'':10s} batch wall        {_stats(walls[name])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", choices=("oracle", "mcp"), default="oracle")
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate", type=float, default=50.0, help="trial starts per second")
    parser.add_argument("--ray-cpus", type=int, default=4)
    parser.add_argument("--mcp-connects", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--stdio-forkserver", choices=("on", "off"), default="on",
                        help="start stdio MCP servers through the fork server in the trial phase")
    parser.add_argument("--compare-roots", action="store_true",
                        help="overlay vs shared host root (start-to-verifier), side by side")
    parser.add_argument("--also", help="--compare-roots: another environment module:Class")
    parser.add_argument("--rounds", type=int, default=4, help="--compare-roots: batches each")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-trials-") as tmp:
            run = _compare_roots if args.compare_roots else _run
            asyncio.run(run(args, Path(tmp)))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
