"""Benchmark `oneloop serve`: the unmodified SDK through the server vs the local backend in process.

Measures, in one run on the same machine and backend:
- training step time (forward_backward + optim_step, submitted back to back) on `--tokens`
  tokens (default 262,144 = 256 datums x 1,024), SDK -> serve vs in process, and their ratio;
- one `sample` of `--num-samples` (default 64) sequences, SDK -> serve vs in process;
- protobuf codec throughput in tokens/s: the SDK's request encoder + our decoder, and our
  ForwardBackwardOutput encoder + the SDK's decoder.

Both paths drive twin models (same base model, LoRA rank and seed); runs alternate, and which
path goes first alternates too. Medians are reported.
Usage: `python benchmarks/bench_serve.py [--tokens N] [--repeats R] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from oneloop.backends import BackendConfig, connect
from oneloop.backends.megatron_local.serve import ServeConfig, ServerThread
from oneloop.backends.megatron_local.serve.proto import (
    decode_forward_backward,
    encode_forward_backward_output,
)
from oneloop.tiny_model import TINY_MODEL_NAME

TIMEOUT_S = 1800


def batch(tokens: int, seq_len: int, seed: int = 0) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(max(1, tokens // seq_len)):
        ids = rng.integers(300, 1000, seq_len + 1)
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
            loss_fn_inputs={"target_tokens": ids[1:].astype(np.int64),
                            "weights": np.ones(seq_len, np.float32)},
        ))
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


def codec_throughput(data: list[types.Datum], output: types.ForwardBackwardOutput,
                     repeats: int) -> dict[str, float]:
    tokens = sum(d.model_input.length for d in data)
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id="bench:train:0", seq_id=1,
    )
    req_s = min(timed(lambda: decode_forward_backward(
        forward_backward_request_to_proto(request).SerializeToString()))[0]
        for _ in range(repeats))
    out_s = min(timed(lambda: deserialize_forward_backward_output(
        encode_forward_backward_output(output)))[0] for _ in range(repeats))
    return {"request_encode_decode_tokens_per_s": tokens / req_s,
            "output_encode_decode_tokens_per_s": tokens / out_s,
            "request_bytes": len(forward_backward_request_to_proto(request).SerializeToString())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=262_144)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default=TINY_MODEL_NAME)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    backend = connect(BackendConfig(backend="local", run_dir=tempfile.mkdtemp(prefix="bench_")))
    results: dict[str, Any] = {"tokens_per_step": 0}
    with ServerThread(ServeConfig(port=0), backend) as server:
        sdk = tinker.ServiceClient(base_url=server.base_url, api_key="tml-bench-loopback")
        via_serve = sdk.create_lora_training_client(args.model, rank=8, seed=0).result(
            timeout=TIMEOUT_S)
        in_process = backend.create_lora_training_client(args.model, rank=8, seed=0).result(
            timeout=TIMEOUT_S)
        data = batch(args.tokens, args.seq_len)
        results["tokens_per_step"] = sum(d.model_input.length for d in data)
        warm = batch(2 * args.seq_len, args.seq_len, seed=1)
        train_step(via_serve, warm)
        train_step(in_process, warm)

        step_serve: list[float] = []
        step_local: list[float] = []
        output = None
        for repeat in range(args.repeats):  # alternate which path goes first
            for path in (("serve", "local") if repeat % 2 == 0 else ("local", "serve")):
                if path == "serve":
                    seconds, output = timed(lambda: train_step(via_serve, data))
                    step_serve.append(seconds)
                else:
                    step_local.append(timed(lambda: train_step(in_process, data))[0])

        prompt = types.ModelInput.from_ints(list(range(300, 332)))
        params = types.SamplingParams(max_tokens=args.max_tokens, seed=0, stop=[])
        sampler_serve = via_serve.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
        sampler_local = in_process.save_weights_and_get_sampling_client().result(
            timeout=TIMEOUT_S)
        for sampler in (sampler_serve, sampler_local):  # warm-up
            sampler.sample(prompt, 1, params).result(timeout=TIMEOUT_S)
        sample_serve: list[float] = []
        sample_local: list[float] = []
        for repeat in range(args.repeats):
            pairs = ((sampler_serve, sample_serve), (sampler_local, sample_local))
            for sampler, times in pairs if repeat % 2 == 0 else pairs[::-1]:
                times.append(timed(lambda s=sampler: s.sample(
                    prompt, args.num_samples, params).result(timeout=TIMEOUT_S))[0])
        sdk.close("success").result(timeout=60)

    med = statistics.median
    results.update({
        "train_step_s_serve": med(step_serve),
        "train_step_s_in_process": med(step_local),
        "train_step_ratio_serve_over_in_process": med(step_serve) / med(step_local),
        "sample_s_serve": med(sample_serve),
        "sample_s_in_process": med(sample_local),
        "sample_ratio_serve_over_in_process": med(sample_serve) / med(sample_local),
        "train_step_s_runs": {"serve": step_serve, "in_process": step_local},
        "sample_s_runs": {"serve": sample_serve, "in_process": sample_local},
        "num_samples": args.num_samples,
        "sample_max_tokens": args.max_tokens,
        "repeats": args.repeats,
    })
    assert output is not None
    results.update(codec_throughput(data, output, max(3, args.repeats)))
    backend.close()
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return results


if __name__ == "__main__":
    main()
