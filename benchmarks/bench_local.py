"""Local-backend throughput on the tiny model, and the Ray overhead ratio (`oneloop bench local`).

Measures, in one run and side by side: `forward_backward` + `optim_step` tokens/s and sampler
tokens/s, each through the Ray actor path (the Tinker-shaped clients) and through the engine
called directly in this process. The ratio time(Ray) / time(direct) is the actor-path overhead
(goal ≤ 1.1 for batches ≥ 16k tokens). Repeats take the median.

    .venv/bin/python benchmarks/bench_local.py --tokens 32768     # same as ./run bench local
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tinker import types


def _median_times(fns: list, repeats: int) -> list[float]:
    """Median seconds of each fn, the fns interleaved per repeat so load drift hits all alike."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return [statistics.median(bucket) for bucket in times]


def bench_local(args: argparse.Namespace) -> dict[str, float]:
    from oneloop.backends import BackendConfig, connect
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.torch.sampler import TorchSamplerEngine
    from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine
    from oneloop.backends.megatron_local.sampling_client import sample_request
    from oneloop.backends.megatron_local.training_client import datum_to_arrays
    from oneloop.tiny.model import TINY_MODEL_NAME, build_tiny_model

    model_dir = build_tiny_model()
    rng = np.random.default_rng(0)
    n_datums = max(1, args.tokens // args.seq_len)
    data = []
    for _ in range(n_datums):
        tokens = rng.integers(10, 1000, size=args.seq_len + 1).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * args.seq_len},
            )
        )
    tokens_per_step = n_datums * args.seq_len
    adam = types.AdamParams(learning_rate=1e-4)
    adam_dict = {
        k: float(getattr(adam, k))
        for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    }
    prompt = types.ModelInput.from_ints(rng.integers(10, 1000, size=64).tolist())
    params = types.SamplingParams(max_tokens=args.sample_tokens, seed=0, stop=[])

    # Direct: the engines in this process.
    trainer = TorchTrainerEngine(
        model_dir,
        LoraSpec(args.rank, seed=0),
        threads=args.threads,
        max_tokens_per_microbatch=args.microbatch,
    )

    def direct_train() -> None:
        # Both sides start from the same tinker Datums: the conversion the client does at the
        # edge is work either way, not Ray overhead.
        arrays = [datum_to_arrays(d, "cross_entropy", i) for i, d in enumerate(data)]
        trainer.forward_backward(arrays, "cross_entropy", None, forward_only=False)
        trainer.optim_step(adam_dict)

    sampler = TorchSamplerEngine(model_dir, threads=args.threads)

    def direct_sample() -> None:
        request = sample_request(prompt, args.samples, params, False, (), 4096)
        sampler.sample("base", request)

    # Ray: the Tinker-shaped clients over actors.
    with tempfile.TemporaryDirectory() as run_dir:
        service = connect(
            BackendConfig(
                backend="local",
                run_dir=Path(run_dir),
                local={"max_tokens_per_microbatch": args.microbatch, "torch_threads": args.threads},
            )
        )
        client = service.create_lora_training_client(
            TINY_MODEL_NAME, rank=args.rank, seed=0
        ).result()
        sampling = service.create_sampling_client(base_model=TINY_MODEL_NAME).result()

        def ray_train() -> None:
            fwd = client.forward_backward(data, "cross_entropy")
            opt = client.optim_step(adam)
            fwd.result(), opt.result()

        def ray_sample() -> None:
            sampling.sample(prompt, args.samples, params).result()

        t_direct_train, t_ray_train = _median_times([direct_train, ray_train], args.repeats)
        t_direct_sample, t_ray_sample = _median_times([direct_sample, ray_sample], args.repeats)
        service.close()

    sampled = args.samples * args.sample_tokens
    return {
        "train/tokens_per_step": tokens_per_step,
        "train/direct_tokens_per_s": tokens_per_step / t_direct_train,
        "train/ray_tokens_per_s": tokens_per_step / t_ray_train,
        "train/ray_over_direct": t_ray_train / t_direct_train,
        "sample/tokens_per_request": sampled,
        "sample/direct_tokens_per_s": sampled / t_direct_sample,
        "sample/ray_tokens_per_s": sampled / t_ray_sample,
        "sample/ray_over_direct": t_ray_sample / t_direct_sample,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="oneloop bench")
    parser.add_argument("what", nargs="?", default="local", choices=["local"])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per training step")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per datum")
    parser.add_argument("--microbatch", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--samples", type=int, default=16, help="num_samples per sample call")
    parser.add_argument("--sample-tokens", type=int, default=128, help="max_tokens per sample")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both paths")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    args = parser.parse_args(argv)
    results = bench_local(args)
    for key, value in results.items():
        print(f"{key:32s} {value:14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
