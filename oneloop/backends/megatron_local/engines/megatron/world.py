"""Joining megatron-core's parallel state: one process (a one-rank trainer starts its own gloo or
NCCL world of one), or a rank of a `megatron.group` whose world the group started."""

from typing import TYPE_CHECKING

import torch

from oneloop.backends.megatron_local.ports import free_port
from oneloop.errors import CapabilityError

if TYPE_CHECKING:
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel


def init_distributed(
    parallel: "MegatronParallel", device: torch.device, expert_tp: int | None = None
) -> None:
    """Megatron's parallel state for `parallel`'s sizes. `expert_tp`: the experts' tensor-parallel
    size (None: tp, megatron-core's default; MoE models keep each expert whole: 1). Expert-parallel
    groups are carved out of each stage's dp · cp · tp / expert_tp ranks, so ep must divide that;
    CapabilityError otherwise, and for a multi-rank layout whose world is not started."""
    expert_ranks = parallel.dp * parallel.cp * parallel.tp // (expert_tp or parallel.tp)
    if parallel.ep > 1 and expert_ranks % parallel.ep:
        raise CapabilityError(
            f"local.megatron.ep={parallel.ep}: expert parallelism (MoE models) splits the experts "
            f"over the {expert_ranks} ranks of each stage's dp × cp (× tp: MoE experts are kept "
            "whole) block, which is not a multiple of it"
        )
    dist = torch.distributed
    world = parallel.tp * parallel.pp * parallel.cp * parallel.dp
    if world > 1 and not (dist.is_initialized() and dist.get_world_size() == world):
        raise CapabilityError(  # megatron.group.MegatronRayGroup starts the ranks first
            f"local.megatron dp={parallel.dp} tp={parallel.tp} pp={parallel.pp} cp={parallel.cp}: "
            "the ranks are started by megatron.group.MegatronRayGroup"
        )
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            parallel.tp,
            parallel.pp,
            context_parallel_size=parallel.cp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=expert_tp,
        )
