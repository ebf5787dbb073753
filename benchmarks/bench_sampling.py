"""Concurrent single-sample requests on the `torch` sampler (`oneloop bench sampling`).

Measures, in one run and side by side, on the tiny model:
(a) N concurrent `sample(num_samples=1)` calls vs one `sample(num_samples=N)` call (default
    N = 8, same prompt, `--max-tokens` each): through the local backend's sampling client (the
    Ray sampler actor, which hands the engine each request as it comes) and on the engine alone
    (`submit_sample` from N callers vs `sample`). The ratio time(N concurrent) / time(one call)
    is the cost of not sending one batched request (goal ≤ 2: the engine batches concurrent
    requests itself).
(c) `--staggered` (default 16) single-sample requests arriving `--gap-ms` (5) apart on the engine,
    each sampling a different number of tokens (`--max-tokens` / 4 to 2 × `--max-tokens`),
    admitted into the running batch between decode steps vs not (`admit_mid_batch=False`: each
    batch keeps the requests it started with): wall time of the burst (ratio not / joining) and
    mean arrival-to-answer time.
(b) `--concurrent` (default 64) concurrent single-sample requests from the official SDK through
    `oneloop serve` vs the same requests to the in-process local backend (goal ≤ 1.10), with the
    server (`--server`) in its own process, as users run it (its own local backend and sampler),
    and as a server thread of this process on the in-process side's backend (the same sampler
    actor, but the SDK's work and the server's share one interpreter lock). One more burst per
    side measures CPU ms per request: this process (the SDK's side, or the in-process client)
    and the server process.
Each path gets one untimed warm-up; timed runs alternate between the two sides of each
comparison (which goes first alternates too) so load drift hits both alike; medians and the
median of per-repeat ratios are printed. The machine may be shared: run it twice.

    .venv/bin/python benchmarks/bench_sampling.py            # same as ./run bench sampling
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
from tinker import types

from oneloop.backends.megatron_local.serve.spawn import serve_process

TIMEOUT_S = 600
GOAL_CONCURRENT_OVER_BATCHED = 2.0
GOAL_SERVE_OVER_IN_PROCESS = 1.10


def paired(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds per timed run of each fn; one warm-up each, then `repeats` rounds, the order
    rotating every round."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def ratios(times: dict[str, list[float]], slow: str, fast: str) -> dict[str, float]:
    """Median seconds of both sides, median over median, and the median per-repeat ratio."""
    med = statistics.median
    return {
        f"{slow}_s": med(times[slow]),
        f"{fast}_s": med(times[fast]),
        "ratio": med(times[slow]) / med(times[fast]),
        "ratio_paired_median": med([a / b for a, b in zip(times[slow], times[fast], strict=True)]),
    }


def wait_all(futures: list[Any]) -> list[Any]:
    return [f.result(timeout=TIMEOUT_S) for f in futures]


def bench_concurrent_vs_batched(args: argparse.Namespace, backend: Any) -> dict[str, Any]:
    """(a): N concurrent single-sample calls vs one N-sample call, client and engine."""
    from oneloop.backends.megatron_local.engines.torch.sampler import TorchSamplerEngine
    from oneloop.backends.megatron_local.sampling_client import sample_request
    from oneloop.tiny.model import TINY_MODEL_NAME, build_tiny_model

    n = args.n
    rng = np.random.default_rng(0)
    prompt = types.ModelInput.from_ints(rng.integers(10, 1000, size=args.prompt_len).tolist())

    def params(seed: int) -> types.SamplingParams:
        return types.SamplingParams(max_tokens=args.max_tokens, seed=seed, stop=[])

    client = backend.create_sampling_client(base_model=TINY_MODEL_NAME).result(TIMEOUT_S)
    client_times = paired(
        {
            "concurrent": lambda: wait_all([client.sample(prompt, 1, params(i)) for i in range(n)]),
            "batched": lambda: client.sample(prompt, n, params(0)).result(timeout=TIMEOUT_S),
        },
        args.repeats,
    )
    engine = TorchSamplerEngine(build_tiny_model(), threads=args.threads)
    singles = [sample_request(prompt, 1, params(i), False, (), 4096) for i in range(n)]
    one = sample_request(prompt, n, params(0), False, (), 4096)

    batches: list[int] = []  # requests per engine batch in the concurrent runs

    def engine_concurrent() -> None:
        before = len(engine.batch_history)
        futures: list[Future] = [engine.submit_sample("base", r) for r in singles]
        wait_all(futures)
        batches.extend(list(engine.batch_history)[before:])

    engine_times = paired(
        {"concurrent": engine_concurrent, "batched": lambda: engine.sample("base", one)},
        args.repeats,
    )
    engine.close()
    return {
        "client": ratios(client_times, "concurrent", "batched"),
        "engine": ratios(engine_times, "concurrent", "batched"),
        "engine_requests_per_batch": statistics.mean(batches),
    }


def bench_staggered(args: argparse.Namespace) -> dict[str, Any]:
    """(c): `--staggered` single-sample requests arriving `--gap-ms` apart on the engine,
    requests joining the running batch vs each batch running with what it started with: the
    burst's wall time and the mean time from a request's arrival to its answer."""
    from oneloop.backends.megatron_local.engines.base import SampleRequest
    from oneloop.backends.megatron_local.engines.torch.sampler import TorchSamplerEngine
    from oneloop.tiny.model import build_tiny_model

    rng = np.random.default_rng(2)
    requests = [  # replies of different lengths, as an agent's turns end at different tokens
        SampleRequest(
            rng.integers(10, 1000, size=args.prompt_len),
            1,
            int(rng.integers(args.max_tokens // 4, 2 * args.max_tokens + 1)),
            seed=i,
            stop_token_ids=(),
        )
        for i in range(args.staggered)
    ]
    engines = {
        name: TorchSamplerEngine(build_tiny_model(), threads=args.threads, admit_mid_batch=join)
        for name, join in (("joining", True), ("not_joining", False))
    }
    latency: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list] = {}

    def burst(name: str) -> Callable[[], None]:
        def run() -> None:
            engine, sent, futures = engines[name], [], []
            for request in requests:
                sent.append(time.perf_counter())
                futures.append(engine.submit_sample("base", request))
                time.sleep(args.gap_ms / 1e3)
            answered = [0.0] * len(futures)
            for i, future in enumerate(futures):
                future.add_done_callback(
                    lambda _, i=i: answered.__setitem__(i, time.perf_counter())
                )
            outputs = wait_all(futures)
            time.sleep(0.01)  # the callbacks of the last futures
            latency[name].append(
                statistics.mean(a - s for a, s in zip(answered, sent, strict=True))
            )
            tokens[name] = [o.sequences[0].tokens.tolist() for o in outputs]

        return run

    try:
        times = paired({name: burst(name) for name in engines}, args.repeats)
        joined = engines["joining"].joined_requests
    finally:
        for engine in engines.values():
            engine.close()
    return {
        **ratios(times, "not_joining", "joining"),
        "latency_joining_s": statistics.median(latency["joining"]),
        "latency_not_joining_s": statistics.median(latency["not_joining"]),
        "joined_per_burst": joined / (args.repeats + 1),
        "same_tokens": tokens["joining"] == tokens["not_joining"],
    }


@contextlib.contextmanager
def serve_url(
    mode: str, backend: Any, threads: int, run_dir: Path
) -> Iterator[tuple[str, int | None]]:
    """A `oneloop serve` base URL and the server's pid (None: this process): `thread` = a
    server thread of this process on `backend` (the same sampler actor as the in-process side);
    `process` = `oneloop serve` in its own process with its own local backend, as users run it
    (the SDK's work and the server's then do not share one interpreter lock)."""
    from oneloop.backends.megatron_local.serve import ServeConfig, ServerThread

    if mode == "thread":
        with ServerThread(ServeConfig(port=0), backend) as server:
            yield server.base_url, None  # its CPU is this process's
        return
    config = run_dir / "serve-backend.json"
    config.write_text(json.dumps({"local": {"torch_threads": threads}}))
    args = ["--run-dir", str(run_dir / "serve"), "--backend-config", str(config)]
    with serve_process(args, log=run_dir / "serve.log", start_timeout_s=TIMEOUT_S) as served:
        yield served.url, served.process.pid


def bench_serve_vs_in_process(
    args: argparse.Namespace, backend: Any, mode: str, run_dir: Path
) -> dict[str, Any]:
    """(b): `--concurrent` single-sample requests, SDK → serve (`mode`) vs in process."""
    import tinker

    from oneloop.tiny.model import TINY_MODEL_NAME

    rng = np.random.default_rng(1)
    prompts = [
        types.ModelInput.from_ints(rng.integers(10, 1000, size=args.prompt_len).tolist())
        for _ in range(args.concurrent)
    ]
    params = [
        types.SamplingParams(max_tokens=args.max_tokens, seed=i, stop=[])
        for i in range(args.concurrent)
    ]
    with serve_url(mode, backend, args.threads, run_dir) as (url, server_pid):
        sdk = tinker.ServiceClient(base_url=url, api_key="tml-bench-loopback")
        via_serve = sdk.create_sampling_client(base_model=TINY_MODEL_NAME).result(TIMEOUT_S)
        in_process = backend.create_sampling_client(base_model=TINY_MODEL_NAME).result(TIMEOUT_S)

        def burst(client: Any) -> Callable[[], list[Any]]:
            return lambda: wait_all(
                [client.sample(p, 1, s) for p, s in zip(prompts, params, strict=True)]
            )

        times = paired({"serve": burst(via_serve), "in_process": burst(in_process)}, args.repeats)
        cpu = {
            name: cpu_ms_per_request(fn, args.concurrent, server_pid if name == "serve" else None)
            for name, fn in (("serve", burst(via_serve)), ("in_process", burst(in_process)))
        }
        served = burst(via_serve)()
        local = burst(in_process)()
        same = all(
            a.sequences[0].tokens == b.sequences[0].tokens
            for a, b in zip(served, local, strict=True)
        )
    return {**ratios(times, "serve", "in_process"), "same_tokens": same, "cpu_ms": cpu}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ms_per_request(fn: Callable[[], Any], requests: int, server_pid: int | None) -> dict:
    """CPU ms per request of one more run of `fn` (a burst of `requests`): this process (the
    client: the SDK, or the in-process backend's client) and, given its pid, the server
    process (its HTTP and request handling; the sampler actor is a process of its own)."""
    client, server = time.process_time(), process_cpu_s(server_pid) if server_pid else 0.0
    fn()
    out = {"client": 1e3 * (time.process_time() - client) / requests}
    if server_pid:
        out["server"] = 1e3 * (process_cpu_s(server_pid) - server) / requests
    return out


def bench_sampling(args: argparse.Namespace) -> dict[str, Any]:
    from oneloop.backends import BackendConfig, connect

    with tempfile.TemporaryDirectory() as run_dir:
        backend = connect(
            BackendConfig(
                backend="local", run_dir=Path(run_dir), local={"torch_threads": args.threads}
            )
        )
        try:
            results: dict[str, Any] = {
                "concurrent_vs_batched": bench_concurrent_vs_batched(args, backend),
                "staggered": bench_staggered(args),
            }
            for mode in args.server.split(","):
                results[f"serve_{mode}_vs_in_process"] = bench_serve_vs_in_process(
                    args, backend, mode, Path(run_dir)
                )
            return results
        finally:
            backend.close()


def report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    a = results["concurrent_vs_batched"]
    for path in ("client", "engine"):
        r = a[path]
        print(
            f"(a) {path:6s} {args.n} concurrent x1: {r['concurrent_s']:.3f} s   one x{args.n}: "
            f"{r['batched_s']:.3f} s   ratio {r['ratio']:.2f} (paired median "
            f"{r['ratio_paired_median']:.2f}; goal <= {GOAL_CONCURRENT_OVER_BATCHED})"
        )
    print(f"    requests per engine batch, concurrent runs: {a['engine_requests_per_batch']:.2f}")
    c = results["staggered"]
    print(
        f"(c) engine {args.staggered} requests {args.gap_ms} ms apart: joining the running batch "
        f"{c['joining_s']:.3f} s, not {c['not_joining_s']:.3f} s, ratio not/joining "
        f"{c['ratio']:.2f} (paired median {c['ratio_paired_median']:.2f}); mean arrival-to-answer "
        f"{c['latency_joining_s'] * 1e3:.0f} vs {c['latency_not_joining_s'] * 1e3:.0f} ms; "
        f"{c['joined_per_burst']:.1f} joined per burst; same tokens: {c['same_tokens']}"
    )
    for mode in args.server.split(","):
        b = results[f"serve_{mode}_vs_in_process"]
        print(
            f"(b) {args.concurrent} concurrent x1: SDK -> serve ({mode}) {b['serve_s']:.3f} s   "
            f"in process {b['in_process_s']:.3f} s   ratio {b['ratio']:.3f} (paired median "
            f"{b['ratio_paired_median']:.3f}; goal <= {GOAL_SERVE_OVER_IN_PROCESS}); "
            f"same tokens: {b['same_tokens']}"
        )
        cpu = b["cpu_ms"]
        server = f", server process {cpu['serve']['server']:.2f}" if mode == "process" else ""
        print(
            f"    CPU ms per request: SDK side {cpu['serve']['client']:.2f}{server}; "
            f"in-process client {cpu['in_process']['client']:.2f}"
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="oneloop bench sampling", description=__doc__)
    parser.add_argument("what", nargs="?", default="sampling", choices=["sampling"])
    parser.add_argument("--n", type=int, default=8, help="requests in comparison (a)")
    parser.add_argument("--concurrent", type=int, default=64, help="requests in comparison (b)")
    parser.add_argument("--staggered", type=int, default=16, help="requests in comparison (c)")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="(c)'s gap between arrivals")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens sampled per sequence")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the samplers")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per side (median)")
    parser.add_argument(
        "--server",
        default="process,thread",
        help="where (b)'s server runs: process (`oneloop serve` in its own process, as users run "
        "it), thread (a server thread in this process), or both, comma-separated",
    )
    args = parser.parse_args(argv)
    if not args.server or not set(args.server.split(",")) <= {"process", "thread"}:
        parser.error(f"--server: expected process, thread or process,thread, got {args.server!r}")
    report(args, bench_sampling(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
