"""`oneloop size --trainer-layout`: the full fine-tuning state of the busiest trainer GPU under a
Megatron layout, with the arithmetic shown.

Megatron splits a model's parameters two ways, and its distributed optimizer shards their fp32
state (master copy, Adam m and v: 12 B a parameter) over different groups:
- dense parameters (attention, Gated DeltaNet, norms, routers, shared experts, embeddings): split
  over pipeline stages (`pp`, L/pp decoder layers each; the first stage holds the input embedding,
  the last the output layer, a copy of it when tied) and tensor-parallel ranks (`tp`); their
  optimizer state sharded over the data-parallel ranks of a stage (`dp · cp`);
- routed experts: split over stages and expert-parallel ranks (`ep`), each expert whole on its
  rank (the megatron engine keeps expert tensor parallelism at 1 and carves EP out of a stage's
  tp · dp ranks); their optimizer state sharded over the expert-data-parallel ranks only
  (`tp · dp · cp / ep`), so at ep = tp · dp it is not sharded at all.
Weights and gradients are never sharded by the optimizer. Activations are not counted. dp is
`--trainer-gpus / (tp · pp · cp)`; a layout that does not divide is refused naming the field.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from oneloop.diagnostics.model_shape import (
    DTYPE_BYTES,
    OPTIMIZER_BYTES_PER_PARAM,
    ModelShape,
    ParamCount,
    SizeInputError,
)
from oneloop.diagnostics.model_shape import gib_text as _gib

LAYOUT_KEYS = ("tp", "pp", "cp", "ep")


def parse_layout(text: str) -> dict[str, int]:
    """`pp=10,ep=8` → {tp: 1, pp: 10, cp: 1, ep: 8}; SizeInputError naming the bad entry."""
    layout = dict.fromkeys(LAYOUT_KEYS, 1)
    for entry in text.split(","):
        key, sep, value = entry.strip().partition("=")
        if not sep or key not in LAYOUT_KEYS or not value.isdigit() or int(value) < 1:
            raise SizeInputError(
                f"--trainer-layout: {entry.strip()!r} is not one of "
                f"{', '.join(k + '=N' for k in LAYOUT_KEYS)} (N >= 1), comma-separated"
            )
        layout[key] = int(value)
    return layout


def routed_expert_params(s: ModelShape) -> int:
    """Parameters of the routed experts (SwiGLU: 3 · hidden · width each) over every MoE layer."""
    if s.moe is None:
        return 0
    per_layer = s.moe.num_experts * 3 * s.hidden * s.moe.expert_intermediate
    return per_layer * sum(s.moe_layer)


def layout_memory(
    s: ModelShape,
    params: ParamCount,
    layout: dict[str, int],
    *,
    trainer_gpus: int,
    dtype: str,
    grad_dtype: str,
    lines: list[str],
) -> dict[str, Any]:
    """Bytes of full fine-tuning state on the busiest GPU of `layout` (module docstring)."""
    tp, pp, cp, ep = (layout[k] for k in LAYOUT_KEYS)
    model_parallel = tp * pp * cp
    if trainer_gpus % model_parallel:
        raise SizeInputError(
            f"--trainer-layout: tp·pp·cp = {model_parallel} does not divide "
            f"--trainer-gpus={trainer_gpus} (dp = trainer GPUs / (tp·pp·cp))"
        )
    dp = trainer_gpus // model_parallel
    if s.layers % pp:
        raise SizeInputError(f"--trainer-layout: pp={pp} does not divide the {s.layers} layers")
    if ep > 1 and (s.moe is None or s.moe.num_experts % ep or (tp * dp * cp) % ep):
        experts = s.moe.num_experts if s.moe else 0
        raise SizeInputError(
            f"--trainer-layout: ep={ep} must divide the {experts} experts and tp·dp·cp = "
            f"{tp * dp * cp} (expert-parallel ranks are carved out of a stage's ranks)"
        )
    wg = DTYPE_BYTES[dtype] + DTYPE_BYTES[grad_dtype]
    routed = routed_expert_params(s)
    body = params.total - params.embeddings - routed
    matrix = s.vocab * s.hidden
    embeddings = params.embeddings if pp == 1 else matrix  # pp > 1: one matrix per end stage
    dense = Fraction(Fraction(body, pp) + embeddings, tp)
    experts = Fraction(routed, pp * ep)
    edp = tp * dp * cp // ep
    opt = OPTIMIZER_BYTES_PER_PARAM
    dense_bytes = dense * wg + dense * opt / (dp * cp)
    expert_bytes = experts * wg + experts * opt / edp
    total = dense_bytes + expert_bytes
    lines.append(
        f"trainer layout tp={tp} pp={pp} cp={cp} ep={ep} on {trainer_gpus} GPUs: dp = "
        f"{trainer_gpus} / (tp·pp·cp) = {dp}, expert dp = tp·dp·cp/ep = {edp}"
    )
    lines.append(
        f"dense params per GPU (end stage) = ({body:,} / pp {pp} + embeddings {embeddings:,}) / "
        f"tp {tp} = {float(dense):,.0f}; * ({wg} B weights+grads + {opt} B / {dp * cp}) = "
        f"{_gib(dense_bytes)}"
    )
    lines.append(
        f"routed experts per GPU (each whole) = {routed:,} / (pp·ep = {pp * ep}) = "
        f"{float(experts):,.0f}; * ({wg} B + {opt} B / {edp}) = {_gib(expert_bytes)}"
    )
    lines.append(f"trainer state on the busiest GPU = {_gib(total)}")
    return {"layout": {**layout, "dp": dp, "expert_dp": edp}, "bytes_per_gpu": int(total)}
