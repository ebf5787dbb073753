"""`oneloop size --nodes N`: how N nodes split between the trainer and the samplers.

The recipe's rule: fix the trainer's GPUs first (what its states need, `--trainer-gpus`, on whole
nodes as the placement plan puts them), then give the rollouts enough GPUs that the trainer never
waits for a step's worth of trajectories.

Throughput model (stated, and every rate can be replaced by a measured one):

* one training step consumes `B * n` trajectories of `mean trajectory tokens` each; in the
  asynchronous loop the samplers must produce that many tokens in the time the trainer takes to
  train on them, or the trainer waits (`time/wait_for_rollouts` > 0);
* trainer tokens/s per GPU = `GPU FLOP/s * train MFU / (6 * active params)` (forward + backward,
  `--train-tokens-per-gpu-s` replaces it with a measured rate);
* sampler tokens/s per GPU = `GPU FLOP/s * sample MFU / (2 * active params)` (forward only; the
  default MFU is low because decoding is bound by memory bandwidth, not FLOPs;
  `--sample-tokens-per-gpu-s` replaces it with vLLM's measured rate at your concurrency);
* active params: every parameter a token's matmuls touch (MoE: the routed `experts_per_token`
  experts of each MoE layer, not all; the input embedding lookup is free, the LM head is not).
Every sampled token is counted as decode work (prefill of prompts and tool results is cheaper:
the split errs toward more sampler GPUs). Not modelled: groups dropped for zero variance (they
cost sampling, not training: multiply by 1 / kept fraction), environment time (covered by
concurrency, not GPUs), and weight-sync pauses.
"""

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from oneloop.diagnostics.model_shape import ModelShape, SizeInputError


@dataclass(frozen=True)
class SplitInputs:
    nodes: int
    gpus_per_node: int
    trainer_gpus: int
    tp: int  # GPUs per sampler engine
    tokens_per_step: int  # B * n * mean trajectory tokens
    gpu_tflops: Fraction
    train_mfu: Fraction
    sample_mfu: Fraction
    train_rate: Fraction | None  # measured trainer tokens/s per GPU (replaces the FLOP model)
    sample_rate: Fraction | None  # measured sampler tokens/s per GPU


def active_params(s: ModelShape, total: int) -> tuple[int, str]:
    """Parameters one token's matmuls use, and the line of arithmetic."""
    inactive = 0
    if s.moe is not None:
        m = s.moe
        per_layer = (m.num_experts - m.experts_per_token) * 3 * s.hidden * m.expert_intermediate
        inactive = per_layer * sum(s.moe_layer)
    lookup = 0 if s.tie_embeddings else s.vocab * s.hidden  # the input embedding: a lookup
    active = total - inactive - lookup
    return active, (
        f"active params/token = {total:,} - unrouted experts {inactive:,} - input embedding "
        f"lookup {lookup:,} = {active:,}"
    )


def engines_on(x: SplitInputs) -> tuple[int, int]:
    """(sampler GPUs, engines) left after the trainer takes its GPUs first fit, whole nodes
    first: engines fill the remaining nodes and the trainer's last node's free GPUs, `tp` GPUs
    on one node each."""
    full, rest = divmod(x.trainer_gpus, x.gpus_per_node)
    trainer_nodes = full + (rest > 0)
    free_on_last = (x.gpus_per_node - rest) if rest else 0
    idle_nodes = x.nodes - trainer_nodes
    engines = idle_nodes * (x.gpus_per_node // x.tp) + free_on_last // x.tp
    return engines * x.tp, engines


def compute_split(s: ModelShape, total: int, x: SplitInputs, lines: list[str]) -> dict[str, Any]:
    """The split's figures; appends its arithmetic to `lines`."""
    if x.trainer_gpus >= x.nodes * x.gpus_per_node:
        raise SizeInputError(
            f"--trainer-gpus {x.trainer_gpus}: {x.nodes} nodes x {x.gpus_per_node} GPUs leave no "
            "GPU for sampling; raise --nodes or lower --trainer-gpus"
        )
    if x.tp > x.gpus_per_node:
        raise SizeInputError(f"--tp {x.tp}: a sampler engine's GPUs sit on one node, and a node "
                             f"has {x.gpus_per_node} (--gpus-per-node)")  # fmt: skip
    active, line = active_params(s, total)
    lines.append(line)
    flops = x.gpu_tflops * 10**12
    if x.train_rate is None:
        train_rate = flops * x.train_mfu / (6 * active)
        lines.append(
            f"trainer tokens/s per GPU = {float(x.gpu_tflops):g} TFLOP/s * MFU "
            f"{float(x.train_mfu):g} / (6 * {active:,}) = {float(train_rate):,.0f}"
        )
    else:
        train_rate = x.train_rate
        lines.append(f"trainer tokens/s per GPU = {float(train_rate):,.0f} (measured, given)")
    if x.sample_rate is None:
        sample_rate = flops * x.sample_mfu / (2 * active)
        lines.append(
            f"sampler tokens/s per GPU = {float(x.gpu_tflops):g} TFLOP/s * MFU "
            f"{float(x.sample_mfu):g} / (2 * {active:,}) = {float(sample_rate):,.0f}"
        )
    else:
        sample_rate = x.sample_rate
        lines.append(f"sampler tokens/s per GPU = {float(sample_rate):,.0f} (measured, given)")
    need = math.ceil(x.trainer_gpus * train_rate / sample_rate)
    lines.append(
        f"sampler GPUs so the trainer never waits = ceil({x.trainer_gpus} trainer GPUs * "
        f"{float(train_rate):,.0f} / {float(sample_rate):,.0f}) = {need}"
    )
    sampler_gpus, engines = engines_on(x)
    trainer_nodes = math.ceil(x.trainer_gpus / x.gpus_per_node)
    lines.append(
        f"split of {x.nodes} nodes x {x.gpus_per_node} GPUs: trainer {x.trainer_gpus} GPUs on "
        f"{trainer_nodes} node(s); samplers {sampler_gpus} GPUs = {engines} engines of TP {x.tp}"
    )
    train_s = Fraction(x.tokens_per_step) / (x.trainer_gpus * train_rate)
    sample_s = Fraction(x.tokens_per_step) / (sampler_gpus * sample_rate) if sampler_gpus else None
    waits = sample_s is None or sample_s > train_s
    per_node = x.gpus_per_node // x.tp * x.tp
    nodes_needed = trainer_nodes + math.ceil(need / per_node)
    lines.append(
        f"one step = {x.tokens_per_step:,} tokens: trains in {float(train_s):,.1f} s, samples in "
        + (f"{float(sample_s):,.1f} s" if sample_s is not None else "never (no sampler GPU)")
        + (" -> the trainer waits" if waits else " -> the trainer never waits")
    )
    lines.append(f"nodes for a trainer that never waits = {trainer_nodes} + ceil({need} / "
                 f"{per_node}) = {nodes_needed}")  # fmt: skip
    return {
        "active_params": active,
        "trainer_nodes": trainer_nodes,
        "trainer_gpus": x.trainer_gpus,
        "sampler_gpus": sampler_gpus,
        "engines": engines,
        "trainer_tokens_per_gpu_s": float(train_rate),
        "sampler_tokens_per_gpu_s": float(sample_rate),
        "sampler_gpus_needed": need,
        "nodes_needed": nodes_needed,
        "step_train_s": float(train_s),
        "step_sample_s": None if sample_s is None else float(sample_s),
        "trainer_waits": waits,
    }
