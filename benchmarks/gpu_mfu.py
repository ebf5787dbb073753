"""Megatron trainer MFU, speed-up by speed-up, side by side in one run on one GPU.

`--shape 30b-a3b-4l`: the 4-layer Qwen3-30B-A3B-width MoE (MFU on active parameters), e.g.
`--variants all,all_sequential_experts,torch`: the megatron MoE engine with grouped-GEMM experts,
with megatron-core's SequentialMLP experts, and the torch engine, on the same model.

Random Qwen3 of the 1.7 B shape at seq 4096 (batch 4), `forward_backward` (cross_entropy, Tinker's
loss, through the engine contract) + `optim_step`, per variant: the engine as first built
(`MegatronSpeed.off()`, two sequences per micro-batch: its fp32 logits did not fit more), each
local-spec `MegatronSpeed` switch alone, all of them (the default without TE) at 8k and 16k tokens
per micro-batch, megatron-core's unfused RoPE against the default fused one, SDPA backends,
TransformerEngine's layer spec (`te`, `te_mb8k`: the default where TE imports; megatron-core then
runs TE's FusedAdam in every variant),
the `torch` engine, and `all_recompute` (`all` with `local.megatron.recompute: full`: its peak
memory against `all`'s is what recompute saves, its tokens/s what it costs; `all_mb64k` and
`all_recompute_mb64k`, with `--batch 16`, one micro-batch of 16 sequences). Prints tokens/s,
MFU, the ratio to the baseline, forward_backward and optim_step seconds, peak memory, the own
peak (the peak less what earlier variants left allocated: on the device, 2026-12-03, a megatron
engine of the 30B-A3B-width MoE left 29 GiB behind after `del`; for clean peaks run one variant
per process) and the target-logprob gap to the baseline's first step (same weights: bf16
tolerance expected); writes $OUT/gpu_mfu.json after every variant, so a run cut short keeps what
it measured.

MFU = (6·N + 6·L·s·heads·head_dim) · tokens/s / 989 TFLOP/s (H200 dense bf16), N = every
parameter, a tied embedding once (it is also the LM head's matmul), the attention term halved for
causal masking (the formula of benchmarks/gpu_train.py).

    python3 benchmarks/gpu_mfu.py [--variants baseline,all,torch,...] [--steps 3] [--warmup 2]
"""

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "device" / "runbook"))
sys.path.insert(0, str(ROOT))

from build_random_qwen3 import build  # noqa: E402

from oneloop.backends.megatron_local.engines.base import DatumArrays, LoraSpec  # noqa: E402
from oneloop.backends.megatron_local.engines.megatron.speed import MegatronSpeed  # noqa: E402

PEAK_FLOPS = 989e12
ADAM = dict(
    learning_rate=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0
)
OFF = MegatronSpeed.off()
ALL = MegatronSpeed(layer_spec="local")  # every local-spec switch on (the default without TE;
# fused_rope "auto": on for the plain-RoPE models benchmarked here)
TE = MegatronSpeed(layer_spec="te")  # TransformerEngine's layer spec (the default with TE)
# name -> (engine, speed, tokens per micro-batch as a multiple of seq); most telling first.
VARIANTS: dict[str, tuple[str, MegatronSpeed | None, int]] = {
    "baseline": ("megatron", OFF, 2),
    "all": ("megatron", ALL, 4),
    "torch": ("torch", None, 2),
    "te": ("megatron", TE, 4),
    "te_mb8k": ("megatron", TE, 2),
    "all_unfused_rope": ("megatron", replace(ALL, fused_rope=False), 4),  # megatron-core's RoPE
    "all_cudnn": ("megatron", replace(ALL, attention_backend="cudnn"), 4),
    "+bf16_norms": ("megatron", replace(OFF, bf16_norms=True), 2),
    "+fused_logprobs": ("megatron", replace(OFF, fused_logprobs=True, compile_logprobs=True), 2),
    "+swiglu_fusion": ("megatron", replace(OFF, swiglu_fusion=True), 2),
    "+fused_adam": ("megatron", replace(OFF, fused_adam=True), 2),
    "all_mb8k": ("megatron", ALL, 2),
    "all_flash": ("megatron", replace(ALL, attention_backend="flash"), 4),
    "all_eager_logprobs": ("megatron", replace(ALL, compile_logprobs=False), 4),
    "all_nocompile": ("megatron", replace(ALL, compile_logprobs=False, swiglu_fusion=False), 4),
    "all_sequential_experts": ("megatron", replace(ALL, grouped_experts=False), 4),  # MoE shapes
    "all_recompute": ("megatron", ALL, 4),  # local.megatron.recompute: full (RECOMPUTED)
    # 16 sequences per micro-batch (run with --batch 16): what recompute's memory buys
    "all_mb64k": ("megatron", ALL, 16),
    "all_recompute_mb64k": ("megatron", ALL, 16),
    # the same micro-batch sizes for both engines (MoE shape, --batch 16: 64k tokens a step)
    "all_mb32k": ("megatron", ALL, 8),
    "torch_mb16k": ("torch", None, 4),
    "torch_mb32k": ("torch", None, 8),
    "torch_mb64k": ("torch", None, 16),
    # MoE token movement (--batch 16): megatron-core's index_select + scatter_add_ permutations
    "all_mb64k_scatter": ("megatron", replace(ALL, gather_dispatch=False), 16),
    "all_mb64k_unfused_rope": ("megatron", replace(ALL, fused_rope=False), 16),
    "all_mb64k_triton": ("megatron", replace(ALL, triton_logprobs=True), 16),
    "all_triton": ("megatron", replace(ALL, triton_logprobs=True), 4),
}
RECOMPUTED = {"all_recompute", "all_recompute_mb64k"}


def make_batch(batch: int, seq: int) -> list[DatumArrays]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(batch):
        tokens = rng.integers(0, 151936, seq + 1)
        out.append(DatumArrays(tokens[:-1], tokens[1:], {"weights": np.ones(seq, np.float32)}))
    return out


def flops_per_token(cfg, seq: int) -> tuple[int, float]:
    """(N, training FLOPs per token). MoE (`num_experts`): N counts the active parameters, the
    top-k experts' MLPs and the router; an untied LM head is a matmul of its own."""
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    if getattr(cfg, "num_experts", 0):
        mlp = cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        mlp += cfg.num_experts * cfg.hidden_size
    heads = cfg.hidden_size * cfg.head_dim * 2 * (cfg.num_attention_heads + cfg.num_key_value_heads)
    unembed = cfg.vocab_size * cfg.hidden_size  # the LM head's matmul (the lookup costs none)
    n_params = unembed + cfg.num_hidden_layers * (heads + mlp)
    attn = 6 * cfg.num_hidden_layers * seq * cfg.num_attention_heads * cfg.head_dim
    return n_params, 6 * n_params + attn


def build_engine(
    kind: str, speed: MegatronSpeed | None, path: Path, budget: int, recompute: bool = False
):
    if kind == "torch":
        from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine

        return TorchTrainerEngine(
            path, LoraSpec(0), dtype="bfloat16", device="cuda", max_tokens_per_microbatch=budget
        )
    from oneloop.backends.megatron_local.engines.megatron.trainer import (
        MegatronParallel,
        MegatronTrainerEngine,
    )

    return MegatronTrainerEngine(
        path,
        LoraSpec(0),
        dtype="bfloat16",
        device="cuda",
        max_tokens_per_microbatch=budget,
        speed=speed,
        parallel=MegatronParallel(recompute="full" if recompute else "none"),
    )


def measure(engine, data, steps: int, warmup: int) -> tuple[dict, list[np.ndarray]]:
    fb_times, opt_times, first_lp = [], [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = engine.forward_backward(data, "cross_entropy", None, forward_only=False)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        engine.optim_step(ADAM)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i == 0:
            first_lp = result.logprobs
        if i >= warmup:
            fb_times.append(t1 - t0)
            opt_times.append(t2 - t1)
    step = (sum(fb_times) + sum(opt_times)) / steps
    return {
        "step_s": round(step, 4),
        "step_s_raw": step,
        "forward_backward_s": round(sum(fb_times) / steps, 4),
        "optim_step_s": round(sum(opt_times) / steps, 4),
        "max_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }, first_lp


def profile_step(engine, data, top: int, origins_of: Sequence[str] = ()) -> dict:
    """One more warm step under the profiler: total device time, the `top` kernels by self device
    time (what to fuse next), the `top` torch ops by the device time of the kernels they
    launched themselves (which op a kernel belongs to: index_select, scatter_add_, mm, ...), and
    for the ops named in `origins_of` where their time comes from (`op_origins`)."""
    from torch.profiler import ProfilerActivity

    with profiler([ProfilerActivity.CPU, ProfilerActivity.CUDA], bool(origins_of)) as prof:
        engine.forward_backward(data, "cross_entropy", None, forward_only=False)
        engine.optim_step(ADAM)
        torch.cuda.synchronize()
    averages = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = [e for e in averages if e.device_type != torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in kernels)

    def rows(events):
        events = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
        return [
            {
                "name": e.key[:120],
                "ms": round(e.self_device_time_total / 1e3, 2),
                "share": round(e.self_device_time_total / total_us, 4),
                "calls": e.count,
            }
            for e in events
        ]

    out = {"device_ms": round(total_us / 1e3, 1), "top": rows(kernels), "ops": rows(ops)}
    if origins_of:
        out["origins"] = op_origins(prof, origins_of, top, "self_device_time_total")
    return out


def profiler(activities: list, origins: bool):
    """torch's profiler over `activities`; with `origins`, each op also keeps its input shapes and
    its Python stack (the stack reaches ops only under the profiler's verbose config)."""
    from torch.profiler import profile

    if not origins:
        return profile(activities=activities)
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)
    return profile(
        activities=activities, record_shapes=True, with_stack=True, experimental_config=verbose
    )


# frames of these code bases name where an op was called; torch's own frames do not
ORIGIN_FRAMES = ("oneloop/", "megatron/", "benchmarks/", "transformers/")


def op_origins(prof, names: Sequence[str], top: int, time_attr: str) -> list[dict]:
    """Where the named ops' time comes from, two ways, `top` rows each: by input shapes (which
    tensors: an op run by autograd's backward has no Python stack) and by the innermost frames of
    our code bases that called it (forward ops; the op's row lists up to 3 such frames)."""
    wanted = set(names)

    def grouped(events, describe) -> list[dict]:
        events = [e for e in events if e.key in wanted and getattr(e, time_attr) > 0]
        events.sort(key=lambda e: getattr(e, time_attr), reverse=True)
        return [
            {"op": e.key, "ms": round(getattr(e, time_attr) / 1e3, 2), "calls": e.count,
             "where": describe(e)}
            for e in events[:top]
        ]  # fmt: skip

    def frames(event) -> str:
        ours = [f for f in event.stack if any(part in f for part in ORIGIN_FRAMES)]
        return " <- ".join(ours[:3]) or "(no frame of ours: autograd's backward or torch)"

    by_shape = grouped(
        prof.key_averages(group_by_input_shape=True), lambda e: f"shapes {e.input_shapes}"
    )
    by_stack = grouped(prof.key_averages(group_by_stack_n=12), frames)
    rows = [{"by": "input shapes", **r} for r in by_shape]
    return rows + [{"by": "caller", **r} for r in by_stack]


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="1.7b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/models"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--profile", default="baseline,all", help="variants to profile one extra step of"
    )
    parser.add_argument("--profile-top", type=int, default=25, help="kernels and ops listed")
    parser.add_argument(
        "--profile-origins",
        default="aten::copy_,aten::cat,aten::add_,aten::mul,aten::add,aten::mul_",
        help="ops whose device time a profile traces to input shapes and callers ('' for none)",
    )
    parser.add_argument(
        "--time-budget-s", type=float, default=200.0, help="start no variant after this many s"
    )
    args = parser.parse_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    from transformers import AutoConfig

    started = time.perf_counter()
    path = build(args.shape, args.model_dir / f"qwen3-{args.shape}")
    n_params, fpt = flops_per_token(AutoConfig.from_pretrained(path), args.seq)
    data = make_batch(args.batch, args.seq)
    tokens = args.batch * args.seq
    results: dict = {
        "shape": args.shape,
        "params": n_params,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "flops_per_token": fpt,
        "device": torch.cuda.get_device_name(),
        "variants": {},
    }
    baseline_lp: list[np.ndarray] | None = None
    for name in names:
        if time.perf_counter() - started > args.time_budget_s:
            results["variants"][name] = {"skipped": f"time budget {args.time_budget_s:.0f} s spent"}
            continue
        kind, speed, seqs_per_mb = VARIANTS[name]
        entry: dict = {"engine": kind, "tokens_per_microbatch": seqs_per_mb * args.seq}
        if speed is not None:
            entry["speed"] = asdict(speed)
        t0 = time.perf_counter()
        engine = None
        # what earlier variants left allocated counts in this one's peak: its own peak is the rest
        held_gib = round(torch.cuda.memory_allocated() / 2**30, 2)
        try:
            engine = build_engine(kind, speed, path, seqs_per_mb * args.seq, name in RECOMPUTED)
            entry["build_s"] = round(time.perf_counter() - t0, 1)
            timing, first_lp = measure(engine, data, args.steps, args.warmup)
            tps = tokens / timing.pop("step_s_raw")
            entry.update(timing)
            entry["held_before_gib"] = held_gib
            entry["own_peak_gib"] = round(timing["max_mem_gib"] - held_gib, 2)
            entry["tokens_per_s"] = round(tps)
            entry["mfu"] = round(fpt * tps / PEAK_FLOPS, 4)
            if name in args.profile.split(","):
                try:
                    origins = [o for o in args.profile_origins.split(",") if o]
                    entry["profile"] = profile_step(engine, data, args.profile_top, origins)
                except Exception as exc:  # the profiler (CUPTI) missing is no reason to stop
                    entry["profile"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    if origins:  # the stack tracing may be what failed: the plain profile again
                        with contextlib.suppress(Exception):
                            plain = profile_step(engine, data, args.profile_top)
                            entry["profile"] = {**plain, "origins_error": entry["profile"]["error"]}
            if name == "baseline":
                baseline_lp = first_lp
            elif baseline_lp is not None:
                gap = np.concatenate(
                    [np.abs(a - b) for a, b in zip(first_lp, baseline_lp, strict=True)]
                )
                entry["logprob_abs_diff_vs_baseline"] = {
                    "max": float(gap.max()),
                    "mean": float(gap.mean()),
                }
        except Exception as exc:  # a variant that fails (OOM, backend refused) is a result too
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            traceback.print_exc()
        entry["wall_s"] = round(time.perf_counter() - t0, 1)
        del engine
        release()
        # what the variant left allocated (0 unless something still holds its engine)
        entry["left_allocated_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        results["variants"][name] = entry
        print("RESULT " + json.dumps({name: entry}), flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu_mfu.json").write_text(json.dumps(results, indent=1))
    base = results["variants"].get("baseline", {}).get("tokens_per_s")
    print(f"{'variant':<22}{'tok/s':>9}{'MFU':>8}{'x base':>8}{'fb s':>8}{'opt s':>8}"
          f"{'GiB':>7}{'own GiB':>9}{'|dlp| max':>11}")  # fmt: skip
    for name, e in results["variants"].items():
        if "tokens_per_s" not in e:
            print(f"{name:<22} {e.get('error') or e.get('skipped')}")
            continue
        ratio = e["tokens_per_s"] / base if base else float("nan")
        e["over_baseline"] = round(ratio, 3)
        gap = e.get("logprob_abs_diff_vs_baseline", {}).get("max", 0.0)
        print(f"{name:<22}{e['tokens_per_s']:>9}{e['mfu']:>8.3f}{ratio:>8.3f}"
              f"{e['forward_backward_s']:>8.3f}{e['optim_step_s']:>8.3f}{e['max_mem_gib']:>7.1f}"
              f"{e['own_peak_gib']:>9.1f}{gap:>11.4f}")  # fmt: skip
    for name, e in results["variants"].items():
        prof = e.get("profile", {})
        if "top" in prof:
            print(
                f"profile {name}: {prof['device_ms']} ms of device time in one step; top kernels:"
            )
            for title, key in (("kernels", "top"), ("torch ops (self device time)", "ops")):
                print(f"  {title}:")
                for k in prof.get(key, []):
                    share, calls = f"{k['share']:>6.1%}", f"x{k['calls']:<5}"
                    print(f"  {k['ms']:>8.2f} ms {share} {calls} {k['name'][:90]}")
            if prof.get("origins"):
                print("  where the listed ops' time comes from:")
            for o in prof.get("origins", []):
                print(f"  {o['ms']:>8.2f} ms x{o['calls']:<5} {o['op']:<14} {o['by']}: "
                      f"{o['where'][:300]}")  # fmt: skip
    results["total_s"] = round(time.perf_counter() - started, 1)
    print("RESULT " + json.dumps({"summary": results}), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_mfu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
