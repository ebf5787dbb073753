"""Rank and layer arithmetic of a `megatron` trainer group (pure Python/torch; tested in CI).

A group runs tp · pp · cp · dp ranks (one per GPU) placed the way Megatron's
`parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp)` places them in a world
of that size (its default order "tp-cp-ep-dp-pp": TP varies fastest, then CP, then the
data-parallel replica, then the pipeline stage; ep = 1):
global rank = tp_rank + tp · (cp_rank + cp · (dp_rank + dp · pp_rank)).

Pipeline stages split the decoder layers evenly (Megatron's default split; no uneven first/last
stage): stage s holds global layers [s · L/pp, (s+1) · L/pp), named `decoder.layers.0..` inside
its GPTModel. The first stage holds the word embeddings, the last the final norm and the output
layer; with tied embeddings the last stage's `output_layer.weight` is a copy of the embedding
(Megatron keeps the two equal by summing their gradients over the embedding group).
"""

import re
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def group_size(tp: int, pp: int, cp: int, dp: int = 1) -> int:
    """GPUs (= ranks) of one trainer group."""
    return tp * pp * cp * dp


@dataclass(frozen=True)
class RankCoords:
    """Where a global rank sits in Megatron's parallel state."""

    tp_rank: int
    cp_rank: int
    pp_rank: int
    dp_rank: int = 0


def rank_coords(rank: int, tp: int, pp: int, cp: int, dp: int = 1) -> RankCoords:
    """Megatron's placement of `rank` (order tp-cp-ep-dp-pp, ep = 1)."""
    if not 0 <= rank < group_size(tp, pp, cp, dp):
        raise ValueError(f"rank {rank} outside a group of dp={dp} × tp={tp} × pp={pp} × cp={cp}")
    return RankCoords(
        tp_rank=rank % tp,
        cp_rank=(rank // tp) % cp,
        pp_rank=rank // (tp * cp * dp),
        dp_rank=(rank // (tp * cp)) % dp,
    )


def resolve_dp(dp: int | None, gpus_per_trainer: float, tp: int, pp: int, cp: int) -> int:
    """`local.megatron.dp`, or (None) derived from the trainer's GPUs: gpus_per_trainer / (tp · pp
    · cp) whole replicas, at least 1 (a CPU run, or one model-parallel group)."""
    if dp is not None:
        return dp
    model_parallel = group_size(tp, pp, cp)
    replicas = int(gpus_per_trainer // model_parallel)
    if gpus_per_trainer > model_parallel and replicas * model_parallel != gpus_per_trainer:
        raise ValueError(
            f"local.gpus_per_trainer={gpus_per_trainer:g} is not a whole number of tp={tp} × "
            f"pp={pp} × cp={cp} replicas ({model_parallel} GPUs each): set local.megatron.dp or "
            "local.gpus_per_trainer to a multiple"
        )
    return max(1, replicas)


def check_pp(layers: int, pp: int) -> None:
    """Raise ValueError unless `pp` stages can split `layers` evenly."""
    if pp < 1:
        raise ValueError(f"local.megatron.pp={pp}: must be >= 1")
    if layers % pp:
        raise ValueError(
            f"local.megatron.pp={pp} must divide the model's num_hidden_layers={layers} "
            "(Megatron splits the decoder layers evenly over pipeline stages)"
        )
    if layers // pp < 1:
        raise ValueError(f"local.megatron.pp={pp} exceeds num_hidden_layers={layers}")


def stage_layers(layers: int, pp: int, pp_rank: int) -> range:
    """Global decoder layer indices held by pipeline stage `pp_rank`."""
    check_pp(layers, pp)
    per = layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def check_gpus_per_trainer(
    gpus_per_trainer: float,
    tp: int,
    pp: int,
    cp: int,
    trainer_engine: str = "megatron",
    dp: int = 1,
) -> None:
    """A megatron group needs one whole GPU per rank: `local.gpus_per_trainer` = dp · tp · pp · cp
    (the group's placement group holds them, one per rank actor)."""
    size = group_size(tp, pp, cp, dp)
    if trainer_engine != "megatron" or size == 1:
        return
    if gpus_per_trainer != size:
        raise ValueError(
            f"local.gpus_per_trainer={gpus_per_trainer:g}: local.megatron dp={dp} × tp={tp} × "
            f"pp={pp} × cp={cp} runs {size} ranks, one GPU each, so the trainer needs "
            f"local.gpus_per_trainer={size}"
        )


def _rename_layer(name: str, shift: int) -> str:
    match = _LAYER.match(name)
    if match is None:
        return name
    return f"decoder.layers.{int(match.group(1)) + shift}." + name[match.end() :]


def stage_parts(
    mega: dict[str, torch.Tensor], layers: range, first: bool, last: bool, tied: bool
) -> dict[str, torch.Tensor]:
    """Stage-local part of full Megatron-layout weights: its layers renamed from 0, embeddings on
    the first stage, final norm and output layer on the last (the embedding, when tied)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in mega.items():
        match = _LAYER.match(name)
        if match is not None:
            if int(match.group(1)) in layers:
                out[_rename_layer(name, -layers.start)] = tensor
        elif name.startswith("embedding."):
            if first:
                out[name] = tensor
        elif last:  # decoder.final_layernorm, output_layer
            out[name] = tensor
    if last and tied and not first:  # one stage (pp = 1) holds the embedding itself only
        out["output_layer.weight"] = mega["embedding.word_embeddings.weight"]
    return out


def global_parts(
    local: dict[str, torch.Tensor], layers: range, first: bool, tied: bool
) -> dict[str, torch.Tensor]:
    """Inverse of `stage_parts` for export: global layer names; a tied last stage's output layer
    is left out (the first stage's embedding is the one weight)."""
    out = {}
    for name, tensor in local.items():
        if tied and name == "output_layer.weight" and not first:
            continue
        out[_rename_layer(name, layers.start)] = tensor
    return out
