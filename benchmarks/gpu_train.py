"""Trainer engines on one GPU: `megatron` vs `torch`, forward_backward + optim_step through the
engine contract (cross_entropy, Tinker's loss), on a random Qwen3 of the 1.7 B shape at seq 4096.

Prints tokens/s and MFU for both, and their ratio, measured side by side in this run; writes
$OUT/gpu_train.json when OUT is set. MFU = (6·N + 6·L·s·(heads·head_dim)) · tokens/s / peak, with
N = every parameter (a tied embedding counted once: it is also the LM head's matmul) and the
attention term halved for causal masking; peak = 989 TFLOP/s (H200 dense bf16).

    python3 benchmarks/gpu_train.py [--shape 1.7b] [--seq 4096] [--batch 4] [--steps 5]
"""

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "device" / "runbook"))
sys.path.insert(0, str(ROOT))

from build_random_qwen3 import build  # noqa: E402

from oneloop.backends.megatron_local.engines.base import DatumArrays, LoraSpec  # noqa: E402

PEAK_FLOPS = 989e12
ADAM = dict(
    learning_rate=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0
)


def make_batch(batch: int, seq: int) -> list[DatumArrays]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(batch):
        tokens = rng.integers(0, 151936, seq + 1)
        out.append(DatumArrays(tokens[:-1], tokens[1:], {"weights": np.ones(seq, np.float32)}))
    return out


def measure(name: str, engine, data, steps: int, warmup: int, flops_per_token: float) -> dict:
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.forward_backward(data, "cross_entropy", None, forward_only=False)
        engine.optim_step(ADAM)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    tokens = sum(len(d.tokens) for d in data)
    tps = tokens / (sum(times) / len(times))
    result = {
        "engine": name,
        "tokens_per_step": tokens,
        "step_s_mean": round(sum(times) / len(times), 4),
        "tokens_per_s": round(tps),
        "mfu": round(flops_per_token * tps / PEAK_FLOPS, 4),
        "max_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="1.7b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/qwen3-bench"))
    args = parser.parse_args()
    from transformers import AutoConfig

    path = build(args.shape, args.model_dir / args.shape)
    cfg = AutoConfig.from_pretrained(path)
    n_params = cfg.vocab_size * cfg.hidden_size + cfg.num_hidden_layers * (
        cfg.hidden_size * cfg.head_dim * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    attn = 6 * cfg.num_hidden_layers * args.seq * cfg.num_attention_heads * cfg.head_dim
    flops_per_token = 6 * n_params + attn
    data = make_batch(args.batch, args.seq)
    budget = args.seq * 2  # two sequences per micro-batch: fp32 logits of 4 × 4096 × 152k OOM
    results = {"shape": args.shape, "params": n_params, "seq": args.seq}

    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronTrainerEngine

    engine = MegatronTrainerEngine(
        path, LoraSpec(0), dtype="bfloat16", device="cuda", max_tokens_per_microbatch=budget
    )
    results["megatron"] = measure(
        "megatron", engine, data, args.steps, args.warmup, flops_per_token
    )
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

    from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine

    engine = TorchTrainerEngine(
        path, LoraSpec(0), dtype="bfloat16", device="cuda", max_tokens_per_microbatch=budget
    )
    results["torch"] = measure("torch", engine, data, args.steps, args.warmup, flops_per_token)
    results["megatron_over_torch"] = round(
        results["megatron"]["tokens_per_s"] / results["torch"]["tokens_per_s"], 3
    )
    print("RESULT " + json.dumps(results), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_train.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
