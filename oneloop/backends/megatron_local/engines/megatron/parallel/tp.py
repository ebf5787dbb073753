"""One tensor-parallel rank of the `megatron` trainer engine (`megatron.group` drives the ranks).

Every rank runs the same calls in the same order (each rank a Ray actor of `megatron.group`);
Megatron's column/row-parallel layers do the activation all-reduces. Also the rank class of a
data-parallel group (tp = 1 included): the replicas split each call's datums
(`trainer.dp_shares`). What differs from the one-process engine:
- import: each rank copies its part of the full HF weights (`parallel.shard`);
- target logprobs: the logits are vocabulary-sharded, so log p(target) = −(Megatron's
  vocab-parallel cross entropy), identical on every rank;
- optim_step: QK-norm weights are replicated but each rank's gradient covers only its heads, so
  their gradients are summed over the TP group first (what Megatron's `finalize_model_grads` does);
  the grad norm is Megatron's (TP-sharded parameters counted once);
- export: `hf_weights` all-gathers the sharded parameters (a collective: every rank calls it);
  rank 0 returns the full HF tensors, the others an empty dict;
- checkpoint: rank 0 writes the full HF weights file (loadable at any TP size); each rank writes its
  own optimizer shard (`optimizer.tp{T}.rank{r}.pt`), so the optimizer state resumes at the same TP
  size only (a mismatch is refused with the reason).
"""

from pathlib import Path

import torch

from oneloop.backends.megatron_local.engines.base import LoraSpec
from oneloop.backends.megatron_local.engines.megatron.layout import DenseShape, megatron_to_hf
from oneloop.backends.megatron_local.engines.megatron.parallel.shard import (
    REPLICATED,
    check_tp,
    gather,
    shard_all,
    tp_kind,
)
from oneloop.backends.megatron_local.engines.megatron.trainer import (
    MegatronParallel,
    MegatronTrainerEngine,
)


class MegatronTpRank(MegatronTrainerEngine):
    """Rank `rank` of a TP group whose torch.distributed world (size tp) is already initialised."""

    def __init__(
        self, model_path: Path, lora: LoraSpec, *, parallel: MegatronParallel, rank: int, **kwargs
    ) -> None:
        from transformers import AutoConfig

        check_tp(DenseShape.from_hf(AutoConfig.from_pretrained(str(model_path))), parallel.tp)
        # `rank`: the global rank (TP rank = rank % tp: TP varies fastest in Megatron's order)
        self.tp, self.rank = parallel.tp, rank % parallel.tp
        self.global_rank = self.global_rank or rank  # MegatronCpRank sets its own first
        super().__init__(model_path, lora, parallel=parallel, **kwargs)
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_rank() != self.rank:
            raise RuntimeError(
                f"rank {rank} got TP rank {parallel_state.get_tensor_model_parallel_rank()}, "
                f"expected {self.rank}"
            )

    def _tp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    def _local_parts(self, mapped: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_all(mapped, self.tp, self.rank)

    def _target_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return -vocab_parallel_cross_entropy(logits, targets)  # fp32 inside, all-reduced

    def optim_step(self, adam_params: dict[str, float]) -> dict[str, float]:
        grads = [
            p.main_grad
            for name, p in self.model.named_parameters()
            if ("q_layernorm" in name or "k_layernorm" in name) and p.requires_grad
        ]
        if grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            torch.distributed.all_reduce(flat, group=self._tp_group())
            for grad, summed in zip(
                grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
            ):
                grad.copy_(summed)
        return super().optim_step(adam_params)

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Full HF weights on rank 0 (empty dict elsewhere); every rank must call it."""
        if self.moe is not None:  # tp = 1: the experts gathered over EP (`_to_hf`)
            return super().hf_weights()
        group, full = self._tp_group(), {}
        for name, param in self._params_by_hf_layout().items():
            part = param.detach()
            if tp_kind(name) == REPLICATED:
                full[name] = part
                continue
            parts = [torch.empty_like(part) for _ in range(self.tp)]
            torch.distributed.all_gather(parts, part.contiguous(), group=group)
            if self.rank == 0:
                full[name] = gather(name, parts)
        return megatron_to_hf(self.shape, full) if self.rank == 0 else {}
