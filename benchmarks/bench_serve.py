"""Benchmark `oneloop serve`: the unmodified SDK through the server vs the local backend in process.

Measures, in one run on the same machine and backend:
- training step time (forward_backward + optim_step, submitted back to back) on `--tokens`
  tokens (default 262,144 = 256 datums x 1,024), SDK -> serve vs in process, and their ratio;
- one `sample` of `--num-samples` (default 64) sequences, SDK -> serve vs in process;
- protobuf codec throughput in tokens/s, each half of each message timed on its own (median of
  `--codec-repeats`), on the code each side really runs:
  * request (`/forward_backward` body), a token = one position of a datum's model input (on the
    wire: an int32 id + an int64 target + a float32 weight, 16 bytes): the SDK's encoder
    (`request_conv.forward_backward_request_to_proto(...).SerializeToString()`, as
    `resources/training.py` does) and the server's reference decoder `decode_forward_backward`
    (to `tinker.types`, taken only for bodies the fast path declines); and the server's whole
    way from the body to the engine's arrays, what it does before the Ray call (`to_engine`:
    `fast_scan.decode_request`, straight to `DatumArrays`: a `fast_batch.DatumList`, whose
    per-datum views are made where first read, on the trainer actor after Ray unpickles the
    joined arrays), on the equal-length batch and on
    `request_ragged` (lengths drawn from [seq_len / 2, seq_len], same token budget);
    `codec/request_fast_path` says whether each body took the fast path;
  * output (`ForwardBackwardOutput` result), a token = one target logprob (float32): the
    server's `encode_forward_backward_output` and the SDK's `deserialize_forward_backward_output`;
  * sample result, a token = one sampled token (int32 id + float32 logprob): the server's
    `encode_sample_response` and the SDK's `deserialize_sample_response`, one message per
    `--codec-sample-shapes` entry, labelled `sample_<samples>x<tokens>` (default `64x32`, the
    benchmarked call's size, and `64x1024`, a realistic rollout size, every sequence of that
    length as when samples run to max_tokens; and `64x1024r`, lengths ragged in [512, 1024] as
    when samples stop early).
  The round trip of a message is tokens / (encode s + decode s); the goal is >= 200 M tokens/s.
  The SDK's halves are the unmodified SDK's code: this project cannot change them.

Both paths drive twin models (same base model, LoRA rank and seed); runs alternate, and which
path goes first alternates too. Medians are reported; codec figures by wall clock and, in
brackets, by the thread's CPU time (the machine may be shared: wall time then also counts the
waits for a core), each after one untimed warm-up call, with the cyclic GC on (its collections
are timed as the server would see them; `gc`: collections per timed call) and `flt`: minor page
faults per timed call. `--http httptools,h11` starts one server per uvicorn HTTP parser and times
their `sample` calls in one run (rotating order), each against the same in-process calls; a
sample ratio is given as median over median and as the median of per-repeat ratios.
Usage: `python benchmarks/bench_serve.py [--tokens N] [--repeats R] [--json out.json]`;
`--codec-only` times only the codecs (no server, no training), on a `ForwardBackwardOutput` and
`SampleResponse`s built by the local backend's own converters from arrays of the same shapes
(a sample response as `LocalSamplingClient` makes it, its sequences batched: `sample_batch`);
`--sample-only` times only the `sample` calls (no training steps, no codec), for quick iteration
on the per-call overhead (use `--repeats 20` or more: one call is ~0.2 s).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from oneloop.backends import BackendConfig, connect
from oneloop.backends.megatron_local.engines.base import DatumArrays, ForwardResult, SampledArrays
from oneloop.backends.megatron_local.sample_batch import sample_response
from oneloop.backends.megatron_local.serve import ServeConfig, ServerThread
from oneloop.backends.megatron_local.serve.codec.fast_scan import (
    ScannedForwardBackward,
    decode_request,
    scan_forward_backward,
)
from oneloop.backends.megatron_local.serve.codec.forward_backward_encoder import (
    encode_forward_backward_output,
)
from oneloop.backends.megatron_local.serve.codec.reference import decode_forward_backward
from oneloop.backends.megatron_local.serve.codec.sample_encoder import encode_sample_response
from oneloop.backends.megatron_local.training_client import datum_to_arrays, forward_output
from oneloop.tiny.model import TINY_MODEL_NAME

TIMEOUT_S = 1800
GOAL_CODEC_TOKENS_PER_S = 200e6


def batch(tokens: int, seq_len: int, seed: int = 0, ragged: bool = False) -> list[types.Datum]:
    """Datums of `seq_len` tokens, `tokens` in all (`ragged`: lengths drawn from
    [seq_len / 2, seq_len], as many datums as fit in `tokens`)."""
    rng = np.random.default_rng(seed)
    out = []
    left = tokens
    while left >= seq_len or not out:
        length = int(rng.integers(max(1, seq_len // 2), seq_len + 1)) if ragged else seq_len
        ids = rng.integers(300, 1000, length + 1)
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
            loss_fn_inputs={"target_tokens": ids[1:].astype(np.int64),
                            "weights": np.ones(length, np.float32)},
        ))
        left -= length
    return out


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def train_step(client: Any, data: list[types.Datum]) -> types.ForwardBackwardOutput:
    fb = client.forward_backward(data, "cross_entropy")
    step = client.optim_step(types.AdamParams(learning_rate=1e-4))
    out = fb.result(timeout=TIMEOUT_S)
    step.result(timeout=TIMEOUT_S)
    return out


def median_s(fn: Callable[[], Any], repeats: int) -> tuple[float, float, float, float]:
    """Median wall seconds and median thread CPU seconds of `fn`, after a warm-up call (on a
    shared machine the wall time also counts the time the call waited for a core), and the mean
    cyclic-GC collections and minor page faults per timed call: the GC stays on and its pauses
    are timed, as the server would see them."""
    fn()  # warm-up (the first call also builds per-structure tables and faults its heap in)
    wall: list[float] = []
    cpu: list[float] = []
    collections, faults = _gc_collections(), _minor_faults()
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return (
        statistics.median(wall),
        statistics.median(cpu),
        (_gc_collections() - collections) / repeats,
        (_minor_faults() - faults) / repeats,
    )


def _gc_collections() -> int:
    return sum(generation["collections"] for generation in gc.get_stats())


def _minor_faults() -> int:
    """Minor page faults of this thread so far (of the process where RUSAGE_THREAD is missing)."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def codec_throughput(data: list[types.Datum], output: types.ForwardBackwardOutput,
                     samples: dict[str, types.SampleResponse], repeats: int) -> dict[str, Any]:
    """Tokens/s of each codec half and of each message's round trip (module docstring).
    `samples` maps a label (e.g. `sample_64x32`) to a sample response timed under that label."""
    tokens = sum(d.model_input.length for d in data)
    seq_len = max(d.model_input.length for d in data)
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id="bench:train:0", seq_id=1,
    )
    body = forward_backward_request_to_proto(request).SerializeToString()

    ragged = batch(tokens, seq_len, seed=2, ragged=True)
    ragged_body = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=ragged, loss_fn="cross_entropy"),
        model_id="bench:train:0", seq_id=1,
    )).SerializeToString()  # fmt: skip
    fast = {"request": scan_forward_backward(body) is not None,
            "request_ragged": scan_forward_backward(ragged_body) is not None}  # fmt: skip

    out_tokens = sum(o["logprobs"].to_numpy().size for o in output.loss_fn_outputs)
    out_body = encode_forward_backward_output(output)
    timings = {
        "request/sdk_encode": median_s(
            lambda: forward_backward_request_to_proto(request).SerializeToString(), repeats),
        "request/serve_decode": median_s(lambda: decode_forward_backward(body), repeats),
        "request/serve_decode_to_engine_arrays": median_s(lambda: to_engine(body), repeats),
        "request_ragged/serve_decode_to_engine_arrays": median_s(
            lambda: to_engine(ragged_body), repeats),
        "output/serve_encode": median_s(lambda: encode_forward_backward_output(output), repeats),
        "output/sdk_decode": median_s(
            lambda: deserialize_forward_backward_output(out_body), repeats),
    }
    count = {"request": tokens, "output": out_tokens,
             "request_ragged": sum(d.model_input.length for d in ragged)}  # fmt: skip
    sizes = {"codec/request_bytes": len(body), "codec/output_bytes": len(out_body)}
    for label, sample in samples.items():
        sample_body = encode_sample_response(sample)
        count[label] = sum(len(s.tokens_np if s.tokens_np is not None else s.tokens)
                           for s in sample.sequences)
        sizes[f"codec/{label}_bytes"] = len(sample_body)
        timings[f"{label}/serve_encode"] = median_s(
            lambda s=sample: encode_sample_response(s), repeats)
        timings[f"{label}/sdk_decode"] = median_s(
            lambda b=sample_body: deserialize_sample_response(b), repeats)
    seconds = {k: wall for k, (wall, *_) in timings.items()}
    cpu = {k: cpu_s for k, (_, cpu_s, *_) in timings.items()}
    per_call = {f"codec/{k}_gc_and_faults_per_call": (gcs, faults)
                for k, (_, _, gcs, faults) in timings.items()}  # fmt: skip
    rates = {f"codec/{k}_tokens_per_s": count[k.split("/")[0]] / s for k, s in seconds.items()}
    rates |= {f"codec/{k}_cpu_tokens_per_s": count[k.split("/")[0]] / c for k, c in cpu.items()}
    trips = [("request", "sdk_encode", "serve_decode"), ("output", "serve_encode", "sdk_decode")]
    trips += [(label, "serve_encode", "sdk_decode") for label in samples]
    for message, enc, dec in trips:
        both = seconds[f"{message}/{enc}"] + seconds[f"{message}/{dec}"]
        rates[f"codec/{message}/round_trip_tokens_per_s"] = count[message] / both
    return {**rates, **per_call, "codec/tokens": count, **sizes, "codec/request_fast_path": fast,
            "codec/goal_tokens_per_s": GOAL_CODEC_TOKENS_PER_S}


def to_engine(body: bytes) -> list[DatumArrays]:
    """What the server does with a `/forward_backward` body before the Ray call: the fast path
    (`decode_request`: straight to engine arrays), or for a body it declines the reference
    decoder and the local client's `datum_to_arrays`."""
    decoded = decode_request(body)
    if isinstance(decoded, ScannedForwardBackward):
        return decoded.arrays
    fb = decoded.input
    return [datum_to_arrays(d, fb.loss_fn, i) for i, d in enumerate(fb.data)]


def print_codec(results: dict[str, Any]) -> None:
    """One line per codec half and round trip: tokens/s (wall clock; thread CPU time in
    brackets, where timed) beside the goal."""
    goal = GOAL_CODEC_TOKENS_PER_S
    print(f"protobuf codec, tokens per message {results['codec/tokens']}, goal >= "
          f"{goal / 1e6:.0f} M tokens/s (wall; [thread CPU]); load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    for key, value in results.items():
        if (key.startswith("codec/") and key.endswith("_tokens_per_s") and "goal" not in key
                and not key.endswith("_cpu_tokens_per_s")):  # fmt: skip
            name = key.removeprefix("codec/").removesuffix("_tokens_per_s")
            side = "ours" if "serve" in name else "SDK " if "sdk" in name else "both"
            cpu = results.get(f"codec/{name}_cpu_tokens_per_s")
            cpu_text = f"[{cpu / 1e6:7.1f}]" if cpu is not None else " " * 9
            calls = results.get(f"codec/{name}_gc_and_faults_per_call")
            calls_text = f"  gc {calls[0]:.1f} flt {calls[1]:.0f} /call" if calls else ""
            print(f"  {name:46s} [{side}] {value / 1e6:9.1f} {cpu_text} M tokens/s  "
                  f"{'meets' if value >= goal else 'misses'} the goal ({value / goal:.2f}x)"
                  f"{calls_text}")


def synthetic_output(data: list[types.Datum], seed: int = 0) -> types.ForwardBackwardOutput:
    """A forward_backward output of the benchmark's shapes, built by the local backend's own
    converter (`forward_output`), for `--codec-only`."""
    rng = np.random.default_rng(seed)
    logprobs = [-rng.random(d.model_input.length, dtype=np.float32) for d in data]
    return forward_output(ForwardResult(logprobs=logprobs, loss=1.0,
                                        per_datum_loss=[1.0] * len(data)))  # fmt: skip


def synthetic_sample(num_samples: int, max_tokens: int, ragged: bool = False,
                     seed: int = 0) -> types.SampleResponse:
    """A sample response of `num_samples` sequences of `max_tokens` tokens (`ragged`: lengths
    drawn from [max_tokens / 2, max_tokens], as when samples stop early), made from engine
    arrays by the converter `LocalSamplingClient` uses (`sample_batch.sample_response`)."""
    rng = np.random.default_rng(seed)
    lengths = (rng.integers(max(1, max_tokens // 2), max_tokens + 1, num_samples) if ragged
               else np.full(num_samples, max_tokens))  # fmt: skip
    sequences = [
        SampledArrays(tokens=rng.integers(300, 1000, n).astype(np.int32),
                      logprobs=-rng.random(n, dtype=np.float32),
                      stop_reason="stop" if ragged else "length")
        for n in lengths
    ]  # fmt: skip
    return sample_response(sequences, None, "bench", 1, 0)


def parse_shapes(text: str) -> list[tuple[int, int, bool]]:
    """`64x32,64x1024r` -> [(64, 32, False), (64, 1024, True)] (samples x tokens per sample;
    a trailing `r`: ragged lengths, see `synthetic_sample`)."""
    shapes = []
    for part in text.split(","):
        n, _, t = part.strip().partition("x")
        ragged = t.endswith("r")
        t = t.removesuffix("r")
        if not (n.isdigit() and t.isdigit() and int(n) > 0 and int(t) > 0):
            raise SystemExit(f"--codec-sample-shapes: expected NxT[r][,NxT[r]...], got {part!r}")
        shapes.append((int(n), int(t), ragged))
    return shapes


def sample_messages(
    shapes: list[tuple[int, int, bool]],
    measured: types.SampleResponse | None = None,
    measured_shape: tuple[int, int] | None = None,
) -> dict[str, types.SampleResponse]:
    """One sample response per shape, labelled `sample_<N>x<T>` (N samples x T tokens each,
    all of length T) or `sample_<N>x<T>r` (ragged lengths); the shape the run really sampled
    uses that real response."""
    return {
        f"sample_{n}x{t}{'r' if ragged else ''}":
        measured if measured is not None and (n, t) == measured_shape and not ragged
        else synthetic_sample(n, t, ragged)
        for n, t, ragged in shapes
    }  # fmt: skip


def sample_paths(args: argparse.Namespace, via_serve: dict[str, Any], in_process: Any
                 ) -> tuple[dict[str, Any], types.SampleResponse]:
    """`--repeats` timed `sample` calls of `--num-samples` x `--max-tokens` per path, interleaved
    (the order rotates every repeat); medians, ratios, and the in-process response.
    `via_serve` maps a label (`serve`, or `serve_<parser>` with two `--http` parsers) to a
    training client through that server. Each ratio is reported two ways: median over median,
    and the median of the per-repeat ratios (each serve call over the in-process call of the
    same repeat, so load that drifts between repeats cancels out)."""
    prompt = types.ModelInput.from_ints(list(range(300, 332)))
    params = types.SamplingParams(max_tokens=args.max_tokens, seed=0, stop=[])
    kind = args.sampler_kind
    clients = {**via_serve, "in_process": in_process}
    samplers = {name: client.save_weights_and_get_sampling_client(kind=kind).result(
        timeout=TIMEOUT_S) for name, client in clients.items()}  # fmt: skip
    for sampler in samplers.values():  # warm-up
        for _ in range(2):
            sampler.sample(prompt, args.num_samples, params).result(timeout=TIMEOUT_S)
    times: dict[str, list[float]] = {name: [] for name in samplers}
    names = list(samplers)
    response = None  # the in-process result: what the server encodes
    for repeat in range(args.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, out = timed(lambda s=samplers[name]: s.sample(
                prompt, args.num_samples, params).result(timeout=TIMEOUT_S))
            times[name].append(seconds)
            if name == "in_process":
                response = out
    assert response is not None
    med = statistics.median
    local = times["in_process"]
    results: dict[str, Any] = {"sample_s_in_process": med(local)}
    for name in via_serve:
        suffix = name.removeprefix("serve")  # "" or "_<parser>"
        results.update({
            f"sample_s_serve{suffix}": med(times[name]),
            f"sample_ratio_serve_over_in_process{suffix}": med(times[name]) / med(local),
            f"sample_ratio_paired_median{suffix}": med(
                [a / b for a, b in zip(times[name], local, strict=True)]),
            f"sample_overhead_s_serve_minus_in_process{suffix}": med(times[name]) - med(local),
        })  # fmt: skip
    results.update({"sample_s_runs": times, "num_samples": args.num_samples,
                    "sample_max_tokens": args.max_tokens, "sampler_kind": kind,
                    "http": args.http})  # fmt: skip
    return results, response


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=262_144)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sampler-kind", choices=("snapshot", "inflight"), default="snapshot",
                        help="kind of the sampling clients timed (serve acks a snapshot sample at "
                             "once, an inflight one when it is done or after sample_ack_wait_s)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs per path (training steps; sample calls)")
    parser.add_argument("--model", default=TINY_MODEL_NAME)
    parser.add_argument("--codec-repeats", type=int, default=5,
                        help="timed repeats of each codec half (median)")
    parser.add_argument("--codec-sample-shapes", default="64x32,64x1024,64x1024r",
                        help="sample-response messages timed by the codec part, as "
                             "SAMPLESxTOKENS[r][,...], labelled sample_<S>x<T>[r]; r = ragged "
                             "lengths in [T/2, T] (samples that stopped early)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--codec-only", action="store_true",
                      help="time only the protobuf codecs (no server, no training steps)")
    mode.add_argument("--sample-only", action="store_true",
                      help="time only the `sample` call through serve vs in process (no training "
                           "steps, no codec); use a larger --repeats")
    parser.add_argument("--http", default="httptools",
                        help="uvicorn HTTP parser(s) of the server: httptools | h11 | "
                             "httptools,h11 (two servers, both timed in one run; training "
                             "steps use the first)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.codec_sample_shapes)
    if args.codec_only:
        data = batch(args.tokens, args.seq_len)
        results = codec_throughput(data, synthetic_output(data), sample_messages(shapes),
                                   args.codec_repeats)
        print_codec(results)
        return write(results, args.json)

    backend = connect(BackendConfig(backend="local", run_dir=tempfile.mkdtemp(prefix="bench_")))
    results: dict[str, Any] = {"repeats": args.repeats}
    parsers = args.http.split(",")
    if not set(parsers) <= {"httptools", "h11"} or len(set(parsers)) != len(parsers):
        raise SystemExit(f"--http: expected httptools, h11 or httptools,h11, got {args.http!r}")
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(ServerThread(ServeConfig(port=0, http=p), backend))
                   for p in parsers]  # type: ignore[arg-type]  # fmt: skip
        sdks = [tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench-loopback")
                for server in servers]  # fmt: skip
        serve_clients = {
            ("serve" if len(parsers) == 1 else f"serve_{p}"):
            sdk.create_lora_training_client(args.model, rank=8, seed=0).result(timeout=TIMEOUT_S)
            for p, sdk in zip(parsers, sdks, strict=True)
        }  # fmt: skip
        via_serve = next(iter(serve_clients.values()))
        in_process = backend.create_lora_training_client(args.model, rank=8, seed=0).result(
            timeout=TIMEOUT_S)
        if not args.sample_only:
            data = batch(args.tokens, args.seq_len)
            results["tokens_per_step"] = sum(d.model_input.length for d in data)
            warm = batch(2 * args.seq_len, args.seq_len, seed=1)
            train_step(via_serve, warm)
            train_step(in_process, warm)
            step_serve: list[float] = []
            step_local: list[float] = []
            output = None  # the in-process result: what the server encodes
            for repeat in range(args.repeats):  # alternate which path goes first
                for path in (("serve", "local") if repeat % 2 == 0 else ("local", "serve")):
                    if path == "serve":
                        step_serve.append(timed(lambda: train_step(via_serve, data))[0])
                    else:
                        seconds, output = timed(lambda: train_step(in_process, data))
                        step_local.append(seconds)
            med = statistics.median
            results.update({
                "train_step_s_serve": med(step_serve),
                "train_step_s_in_process": med(step_local),
                "train_step_ratio_serve_over_in_process": med(step_serve) / med(step_local),
                "train_step_s_runs": {"serve": step_serve, "in_process": step_local},
            })
        sampled, sample_response = sample_paths(args, serve_clients, in_process)
        results.update(sampled)
        for sdk in sdks:
            sdk.close("success").result(timeout=60)
    backend.close()
    print(json.dumps(results, indent=2))
    if not args.sample_only:
        assert output is not None
        messages = sample_messages(shapes, sample_response, (args.num_samples, args.max_tokens))
        results.update(codec_throughput(data, output, messages, args.codec_repeats))
        print_codec(results)
    return write(results, args.json)


def write(results: dict[str, Any], path: str | None) -> dict[str, Any]:
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
