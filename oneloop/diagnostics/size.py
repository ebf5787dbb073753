"""`oneloop size`: cluster sizing from a model config, with the arithmetic shown line by line.

Rollout concurrency is the smaller of two caps (DESIGN.md, loop: admission control):

* system cap: the KV cache. Per GPU of a sampler engine the KV budget is
  `GPU memory * utilisation - reserve - weights / TP`; a token costs
  `2 (K and V) * full-attention layers * KV heads per GPU * head_dim * KV dtype bytes` on each GPU
  (vLLM splits KV heads over TP, and replicates them when TP > KV heads). KV tokens per engine =
  budget / that; the cap = engines * floor(KV tokens per engine / mean trajectory tokens).
* staleness cap: `(S + 1) * B * n`; more trajectories in flight could only be consumed staler
  than S.

Only full-attention layers keep a per-token KV cache; sliding-window layers (a cache bounded by
the window) and linear-attention layers (a fixed per-sequence state) are left out and the report
says so. Not counted either: activations, CUDA graphs and the sampler's workspace (use
`--reserve-gib` or a lower `--gpu-utilization`).

Trainer memory: full fine-tuning costs `weights + grads + 12` bytes per parameter (fp32 master
copy and Adam m and v, 4 B each; bf16 weights and grads give the usual 16 B/param); LoRA keeps the
frozen base in the weight dtype and pays those bytes per parameter for the adapters only.
Activations are not included. Per-GPU figures assume the states are sharded evenly over
`--trainer-gpus`; `--trainer-layout pp=..,ep=..` gives the busiest GPU's state as Megatron
splits it (routed experts' optimizer state sharded over expert-data-parallel ranks only:
`oneloop.diagnostics.trainer_memory`).

Trainer/sampler split (`--nodes N`): the trainer keeps `--trainer-gpus` on whole nodes, the
rest sample; the throughput model and its stated assumptions are in `oneloop.diagnostics.split`.
`--engines` then defaults to the engines the split leaves (`--tp` GPUs each).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from oneloop.diagnostics.model_shape import (
    DTYPE_BYTES,
    GIB,
    OPTIMIZER_BYTES_PER_PARAM,
    Attention,
    ModelShape,
    SizeInputError,
    load_shape,
    lora_param_lines,
    param_count,
)
from oneloop.diagnostics.model_shape import gib_text as _gib
from oneloop.diagnostics.split import SplitInputs, compute_split, engines_on
from oneloop.diagnostics.trainer_memory import layout_memory, parse_layout

DEFAULT_GPU_UTILIZATION = "0.9"  # vLLM's default gpu_memory_utilization
EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class SizeInputs:
    config: Path
    gpu_memory_gib: Fraction  # per GPU
    engines: int  # sampler engines
    tp: int  # GPUs per sampler engine (tensor parallel)
    mean_trajectory_tokens: int  # prompt + all turns, mean over trajectories
    max_staleness: int  # S, in steps
    groups_per_step: int  # B
    samples_per_group: int  # n
    dtype: str  # weights
    kv_dtype: str
    gpu_utilization: Fraction  # fraction of GPU memory the sampler may use
    reserve_gib: Fraction  # per GPU, for activations / CUDA graphs
    lora_rank: int
    trainer_gpus: int
    grad_dtype: str
    trainer_layout: dict[str, int] | None = None  # `--trainer-layout` (tp, pp, cp, ep)


def _frac(value: Fraction) -> str:
    return f"{float(value):g}"


def _kv_section(s: ModelShape, x: SizeInputs, lines: list[str], notes: list[str]) -> dict[str, int]:
    kv_b = DTYPE_BYTES[x.kv_dtype]
    full = s.full_attention_layers
    kv_token = 2 * full * s.kv_heads * s.head_dim * kv_b
    skipped = {k: sum(a is k for a in s.attention) for k in (Attention.SLIDING, Attention.LINEAR)}
    lines.append(
        f"KV bytes/token = 2 (K,V) * {full} full-attention layers * {s.kv_heads} KV heads * "
        f"{s.head_dim} head_dim * {kv_b} B ({x.kv_dtype}) = {kv_token:,} B"
    )
    if skipped[Attention.SLIDING]:
        notes.append(
            f"{skipped[Attention.SLIDING]} sliding-window layers are not counted in KV/token "
            f"(their cache is bounded by the window, {s.sliding_window} tokens per sequence)"
        )
    if skipped[Attention.LINEAR]:
        notes.append(
            f"{skipped[Attention.LINEAR]} linear-attention layers are not counted in KV/token "
            "(they keep a fixed-size state per sequence, not per token)"
        )
    kv_heads_gpu = max(1, s.kv_heads // x.tp)
    how = (
        f"{s.kv_heads} / TP {x.tp}"
        if x.tp <= s.kv_heads
        else f"max(1, {s.kv_heads} // TP {x.tp}): KV heads replicated when TP > KV heads"
    )
    lines.append(f"KV heads per GPU = {how} = {kv_heads_gpu}")
    kv_token_gpu = 2 * full * kv_heads_gpu * s.head_dim * kv_b
    lines.append(
        f"KV bytes/token per GPU = 2 * {full} * {kv_heads_gpu} * {s.head_dim} * {kv_b} "
        f"= {kv_token_gpu:,} B"
    )
    return {"kv_bytes_per_token": kv_token, "kv_bytes_per_token_per_gpu": kv_token_gpu}


def compute(s: ModelShape, x: SizeInputs, split: SplitInputs | None = None) -> dict[str, Any]:
    """Every figure of the report plus the arithmetic lines (`arithmetic`) and `notes`; with
    `split`, the trainer/sampler split of its nodes (`split`)."""
    lines: list[str] = []
    notes: list[str] = list(s.notes)
    params = param_count(s)
    w_b = DTYPE_BYTES[x.dtype]
    weight_bytes = params.total * w_b
    lines.append(
        f"params = embeddings {params.embeddings:,} + attention {params.attention:,} + "
        f"linear attention {params.linear_attention:,} + MLP/experts {params.mlp:,} + norms "
        f"{params.norms:,} = {params.total:,}"
    )
    lines.append(
        f"weights = {params.total:,} params * {w_b} B ({x.dtype}) = {weight_bytes:,} B "
        f"({_gib(weight_bytes)})"
    )
    kv = _kv_section(s, x, lines, notes)
    usable = x.gpu_memory_gib * GIB * x.gpu_utilization
    reserve = x.reserve_gib * GIB
    weights_gpu = Fraction(weight_bytes, x.tp)
    budget = math.floor(usable - reserve - weights_gpu)
    lines.append(
        f"KV budget per GPU = {_frac(x.gpu_memory_gib)} GiB * {_frac(x.gpu_utilization)} - "
        f"reserve {_frac(x.reserve_gib)} GiB - weights/TP ({weight_bytes:,} / {x.tp}) = "
        f"{math.floor(usable):,} - {math.floor(reserve):,} - {math.floor(weights_gpu):,} = "
        f"{budget:,} B ({_gib(budget)})"
    )
    fits = budget > 0
    kv_tokens = budget // kv["kv_bytes_per_token_per_gpu"] if fits else 0
    lines.append(
        f"KV tokens per engine = floor({max(budget, 0):,} / {kv['kv_bytes_per_token_per_gpu']:,})"
        f" = {kv_tokens:,}"
    )
    if not fits:
        notes.append(
            f"the weights do not fit: each GPU has {_gib(usable - reserve)} usable for "
            f"{_gib(weights_gpu)} of weights; raise --tp or --gpu-memory-gib"
        )
    per_engine = kv_tokens // x.mean_trajectory_tokens
    state = linear_state_bytes_per_gpu(s, x, lines)
    if state and fits:  # a sequence also holds its linear-attention layers' fixed-size state
        per_sequence = x.mean_trajectory_tokens * kv["kv_bytes_per_token_per_gpu"] + state
        per_engine = budget // per_sequence
        lines.append(
            f"sequences per engine = floor({budget:,} / ({x.mean_trajectory_tokens:,} tokens * "
            f"{kv['kv_bytes_per_token_per_gpu']:,} B + {state:,} B linear-attention state)) = "
            f"{per_engine:,}"
        )
    system_cap = x.engines * per_engine
    per_engine_how = (
        "sequences per engine"
        if state and fits
        else f"floor({kv_tokens:,} / {x.mean_trajectory_tokens:,} mean trajectory tokens)"
    )
    lines.append(
        f"system cap = {x.engines} engines * {per_engine_how} = {x.engines} * {per_engine:,} = "
        f"{system_cap:,}"
    )
    s_, b, n = x.max_staleness, x.groups_per_step, x.samples_per_group
    staleness_cap = (s_ + 1) * b * n
    lines.append(f"staleness cap = (S+1)*B*n = ({s_}+1)*{b}*{n} = {staleness_cap:,}")
    recommended = min(system_cap, staleness_cap)
    bound = "KV cache" if system_cap < staleness_cap else "staleness"
    lines.append(
        f"recommended max_concurrency = min({system_cap:,}, {staleness_cap:,}) = "
        f"{recommended:,} ({bound}-bound)"
    )
    trainer = _trainer_section(s, x, params.total, lines)
    if x.trainer_layout is not None:
        trainer["trainer_layout"] = layout_memory(
            s, params, x.trainer_layout, trainer_gpus=x.trainer_gpus, dtype=x.dtype,
            grad_dtype=x.grad_dtype, lines=lines,
        )  # fmt: skip
    split_figures = compute_split(s, params.total, split, lines) if split is not None else None
    return {
        "model": {
            "config": str(s.source),
            "model_type": s.model_type,
            "layers": s.layers,
            "full_attention_layers": s.full_attention_layers,
            "kv_heads": s.kv_heads,
            "head_dim": s.head_dim,
            "moe": asdict(s.moe) if s.moe else None,
        },
        "inputs": {
            k: (float(v) if isinstance(v, Fraction) else str(v) if isinstance(v, Path) else v)
            for k, v in asdict(x).items()
        },
        "params": asdict(params),
        "weight_bytes": weight_bytes,
        **kv,
        "kv_budget_bytes_per_gpu": budget,
        "fits": fits,
        "kv_tokens_per_engine": kv_tokens,
        "system_cap": system_cap,
        "staleness_cap": staleness_cap,
        "recommended_max_concurrency": recommended,
        "bound": bound,
        **trainer,
        "split": split_figures,
        "arithmetic": lines,
        "notes": notes,
    }


def linear_state_bytes_per_gpu(s: ModelShape, x: SizeInputs, lines: list[str]) -> int:
    """Bytes one sequence's Gated DeltaNet layers keep per sampler GPU, whatever its length: the
    recurrent state (value heads * key dim * value dim) and the causal conv's last kernel-1
    inputs (q, k, v channels), heads split over TP, in the KV dtype; 0 without such layers."""
    linear = sum(a is Attention.LINEAR for a in s.attention)
    if not linear or s.linear is None:
        return 0
    la, b = s.linear, DTYPE_BYTES[x.kv_dtype]
    heads = max(1, la.value_heads // x.tp)
    recurrent = heads * la.key_head_dim * la.value_head_dim
    channels = (2 * la.key_heads * la.key_head_dim + la.value_heads * la.value_head_dim) // x.tp
    conv = (la.conv_kernel - 1) * max(1, channels)
    state = linear * (recurrent + conv) * b
    lines.append(
        f"linear-attention state/sequence per GPU = {linear} layers * ({heads} value heads * "
        f"{la.key_head_dim} * {la.value_head_dim} + conv {la.conv_kernel - 1} * {channels}) * "
        f"{b} B = {state:,} B"
    )
    return state


def _trainer_section(s: ModelShape, x: SizeInputs, total: int, lines: list[str]) -> dict[str, Any]:
    w_b, g_b = DTYPE_BYTES[x.dtype], DTYPE_BYTES[x.grad_dtype]
    per_param = w_b + g_b + OPTIMIZER_BYTES_PER_PARAM
    full = total * per_param
    lines.append(
        f"full fine-tuning B/param = {w_b} (weights {x.dtype}) + {g_b} (grads {x.grad_dtype}) + "
        f"4 (fp32 master) + 4 (Adam m) + 4 (Adam v) = {per_param}"
    )
    lines.append(
        f"full fine-tuning = {total:,} * {per_param} = {full:,} B ({_gib(full)}); "
        f"/ {x.trainer_gpus} trainer GPUs = {_gib(Fraction(full, x.trainer_gpus))} per GPU"
    )
    lora, lora_lines = lora_param_lines(s, x.lora_rank)
    lines.extend(f"LoRA rank {x.lora_rank} {line}" for line in lora_lines)
    lora_bytes = total * w_b + lora * per_param
    lines.append(
        f"LoRA = frozen base {total:,} * {w_b} B + adapters {lora:,} * {per_param} B = "
        f"{lora_bytes:,} B ({_gib(lora_bytes)}); / {x.trainer_gpus} trainer GPUs = "
        f"{_gib(Fraction(lora_bytes, x.trainer_gpus))} per GPU"
    )
    return {
        "trainer_bytes_per_param_full": per_param,
        "trainer_full_bytes": full,
        "lora_params": lora,
        "trainer_lora_bytes": lora_bytes,
    }


def format_text(report: dict[str, Any]) -> str:
    m = report["model"]
    kind = f"MoE {m['moe']['num_experts']} experts" if m["moe"] else "dense"
    out = [
        f"model: {m['config']} ({m['model_type'] or 'unknown type'}, {kind}, {m['layers']} layers)",
        "",
        *(f"  {line}" for line in report["arithmetic"]),
        "",
        f"KV bytes per token:          {report['kv_bytes_per_token']:,} B",
        f"weights:                     {report['weight_bytes']:,} B",
        f"KV tokens per engine:        {report['kv_tokens_per_engine']:,}",
        f"system cap (KV):             {report['system_cap']:,}",
        f"staleness cap:               {report['staleness_cap']:,}",
        f"recommended max_concurrency: {report['recommended_max_concurrency']:,}",
        f"trainer, full fine-tuning:   {_gib(report['trainer_full_bytes'])}",
        f"trainer, LoRA:               {_gib(report['trainer_lora_bytes'])}",
    ]
    if report.get("trainer_layout"):
        layout = report["trainer_layout"]
        sizes = " ".join(f"{k}={v}" for k, v in layout["layout"].items())
        out.append(f"trainer per GPU ({sizes}): {_gib(layout['bytes_per_gpu'])}")
    split = report.get("split")
    if split:
        waits = "waits" if split["trainer_waits"] else "never waits"
        out += [
            f"split:                       trainer {split['trainer_gpus']} GPUs on "
            f"{split['trainer_nodes']} node(s), samplers {split['sampler_gpus']} GPUs "
            f"({split['engines']} engines); the trainer {waits}",
            f"nodes so it never waits:     {split['nodes_needed']}",
        ]
    out += [f"note: {note}" for note in report["notes"]]
    return "\n".join(out)


def _number(name: str, text: str, *, integer: bool, minimum: Fraction, strict: bool) -> Any:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise SizeInputError(f"--{name}: expected a number, got {text!r}") from None
    if integer and value.denominator != 1:
        raise SizeInputError(f"--{name}: expected an integer, got {text!r}")
    if value < minimum or (strict and value == minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise SizeInputError(f"--{name}: must be {bound}, got {text!r}")
    return int(value) if integer else value


def _dtype(name: str, text: str) -> str:
    key = text.lower()
    if key not in DTYPE_BYTES:
        raise SizeInputError(
            f"--{name}: unknown dtype {text!r}; expected one of " + ", ".join(sorted(DTYPE_BYTES))
        )
    return key


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="oneloop size",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="config.json of a Hugging Face model, or its directory")
    req = [
        ("--gpu-memory-gib", "memory of one GPU, GiB"),
        ("--mean-trajectory-tokens", "mean tokens of one trajectory (prompt + all turns)"),
        ("--max-staleness", "S: max staleness in steps"),
        ("--groups-per-step", "B: groups (prompts) per training step"),
        ("--samples-per-group", "n: samples per group"),
    ]
    for flag, help_ in req:
        p.add_argument(flag, required=True, help=help_)
    p.add_argument("--engines", help="number of sampler engines (required unless --nodes)")
    p.add_argument("--tp", default="1", help="GPUs per sampler engine (tensor parallel)")
    p.add_argument("--dtype", default=None, help="weight dtype (default: the config's, else bf16)")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype)")
    p.add_argument("--grad-dtype", default="bf16", help="gradient dtype of the trainer")
    p.add_argument(
        "--gpu-utilization",
        default=DEFAULT_GPU_UTILIZATION,
        help="fraction of GPU memory the sampler may use",
    )
    p.add_argument("--reserve-gib", default="0", help="per-GPU memory held back (activations)")
    p.add_argument("--lora-rank", default="32", help="LoRA rank for the LoRA trainer figure")
    p.add_argument("--trainer-gpus", default="1", help="GPUs the trainer states are sharded over")
    p.add_argument(
        "--trainer-layout",
        help="Megatron layout, e.g. pp=10,ep=8 (tp, pp, cp, ep; dp from --trainer-gpus): the "
        "busiest GPU's state with experts and their optimizer split as Megatron splits them",
    )
    p.add_argument("--nodes", help="split this many nodes between trainer and samplers")
    p.add_argument("--gpus-per-node", default="8", help="with --nodes: GPUs of one node")
    p.add_argument("--gpu-tflops", default="989", help="with --nodes: dense bf16 TFLOP/s of a GPU")
    p.add_argument("--train-mfu", default="0.35", help="with --nodes: trainer FLOP utilisation")
    p.add_argument("--sample-mfu", default="0.04", help="with --nodes: sampler FLOP utilisation")
    p.add_argument("--train-tokens-per-gpu-s", help="measured trainer rate (replaces the model)")
    p.add_argument("--sample-tokens-per-gpu-s", help="measured sampler rate (replaces the model)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def parse_inputs(args: argparse.Namespace, shape: ModelShape) -> SizeInputs:
    def num(name: str, *, integer: bool = True, minimum: int = 1, strict: bool = False) -> Any:
        text = getattr(args, name.replace("-", "_"))
        return _number(name, text, integer=integer, minimum=Fraction(minimum), strict=strict)

    dtype = _dtype("dtype", args.dtype or shape.config_dtype or "bf16")
    x = SizeInputs(
        config=Path(args.config),
        gpu_memory_gib=num("gpu-memory-gib", integer=False, minimum=0, strict=True),
        engines=num("engines") if args.engines is not None else 1,
        tp=num("tp"),
        mean_trajectory_tokens=num("mean-trajectory-tokens"),
        max_staleness=num("max-staleness", minimum=0),
        groups_per_step=num("groups-per-step"),
        samples_per_group=num("samples-per-group"),
        dtype=dtype,
        kv_dtype=_dtype("kv-dtype", args.kv_dtype or dtype),
        gpu_utilization=num("gpu-utilization", integer=False, minimum=0, strict=True),
        reserve_gib=num("reserve-gib", integer=False, minimum=0),
        lora_rank=num("lora-rank"),
        trainer_gpus=num("trainer-gpus"),
        grad_dtype=_dtype("grad-dtype", args.grad_dtype),
        trainer_layout=parse_layout(args.trainer_layout) if args.trainer_layout else None,
    )
    if x.gpu_utilization > 1:
        raise SizeInputError(f"--gpu-utilization: must be <= 1, got {args.gpu_utilization!r}")
    if shape.heads % x.tp:
        raise SizeInputError(
            f"--tp: {x.tp} does not divide num_attention_heads={shape.heads} of {shape.source}"
        )
    if shape.kv_heads % x.tp and x.tp % shape.kv_heads:
        raise SizeInputError(
            f"--tp: {x.tp} and num_key_value_heads={shape.kv_heads} must divide one another"
        )
    return x


def parse_split(
    args: argparse.Namespace, shape: ModelShape
) -> tuple[SizeInputs, SplitInputs | None]:
    """The size inputs and, with `--nodes`, the split's (the engines it leaves become
    `--engines` unless that is given)."""
    if args.nodes is None:
        if args.engines is None:
            raise SizeInputError("--engines: required (the sampler engines), or give --nodes")
        return parse_inputs(args, shape), None
    x = parse_inputs(args, shape)

    def num(name: str, *, integer: bool = True, strict: bool = False) -> Any:
        text = getattr(args, name.replace("-", "_"))
        minimum = Fraction(0 if strict else 1)
        return _number(name, text, integer=integer, minimum=minimum, strict=strict)

    def rate(name: str) -> Fraction | None:
        return None if getattr(args, name.replace("-", "_")) is None else num(
            name, integer=False, strict=True)  # fmt: skip

    split = SplitInputs(
        nodes=num("nodes"),
        gpus_per_node=num("gpus-per-node"),
        trainer_gpus=x.trainer_gpus,
        tp=x.tp,
        tokens_per_step=x.groups_per_step * x.samples_per_group * x.mean_trajectory_tokens,
        gpu_tflops=num("gpu-tflops", integer=False, strict=True),
        train_mfu=num("train-mfu", integer=False, strict=True),
        sample_mfu=num("sample-mfu", integer=False, strict=True),
        train_rate=rate("train-tokens-per-gpu-s"),
        sample_rate=rate("sample-tokens-per-gpu-s"),
    )
    if args.engines is None:
        x = replace(x, engines=max(1, engines_on(split)[1]))
    return x, split


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        shape = load_shape(args.config)
        x, split = parse_split(args, shape)
        report = compute(shape, x, split)
    except SizeInputError as exc:
        print(f"oneloop size: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
