"""One tensor-parallel rank of the `megatron` trainer engine (`megatron_group` drives the ranks).

Every rank runs the same calls in the same order (rank 0 in the trainer actor, ranks 1.. in worker
processes); Megatron's column/row-parallel layers do the activation all-reduces. What differs from
the one-process engine:
- import: each rank copies its part of the full HF weights (`megatron_shard`);
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

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from oneloop.backends.megatron_local.engines.base import LoraSpec
from oneloop.backends.megatron_local.engines.megatron_layout import DenseShape, megatron_to_hf
from oneloop.backends.megatron_local.engines.megatron_shard import (
    REPLICATED,
    check_tp,
    gather,
    shard_all,
    tp_kind,
)
from oneloop.backends.megatron_local.engines.megatron_trainer import (
    ENGINE_STATE_FILE,
    WEIGHTS_FILE,
    MegatronParallel,
    MegatronTrainerEngine,
)


def optimizer_file(tp: int, rank: int) -> str:
    return f"optimizer.tp{tp}.rank{rank}.pt"


class MegatronTpRank(MegatronTrainerEngine):
    """Rank `rank` of a TP group whose torch.distributed world (size tp) is already initialised."""

    def __init__(
        self, model_path: Path, lora: LoraSpec, *, parallel: MegatronParallel, rank: int, **kwargs
    ) -> None:
        from transformers import AutoConfig

        check_tp(DenseShape.from_hf(AutoConfig.from_pretrained(str(model_path))), parallel.tp)
        self.tp, self.rank = parallel.tp, rank
        super().__init__(model_path, lora, parallel=parallel, **kwargs)
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_rank() != rank:
            raise RuntimeError(
                f"rank {rank} got TP rank {parallel_state.get_tensor_model_parallel_rank()}"
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

    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        weights = self.hf_weights()
        directory.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            weights = {k: v.contiguous().cpu() for k, v in weights.items()}
            if self.shape.tied:
                weights.pop("lm_head.weight")
            save_file(weights, str(directory / WEIGHTS_FILE))
        if with_optimizer and self.steps > 0:  # before the first step there is no state to save
            torch.save(self._optimizer_state(), directory / optimizer_file(self.tp, self.rank))
        if self.rank == 0:
            state = {"steps": self.steps, "tp": self.tp}
            (directory / ENGINE_STATE_FILE).write_text(json.dumps(state))

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        state = json.loads((directory / ENGINE_STATE_FILE).read_text())
        self._import_hf(load_file(str(directory / WEIGHTS_FILE)))  # full file, this rank's part
        for optimizer in self._optimizers():
            if hasattr(optimizer, "reload_model_params"):
                optimizer.reload_model_params()
        self.steps = int(state["steps"])
        if not with_optimizer:
            return
        inners = [o.optimizer for o in self._optimizers()]
        if self.steps == 0:
            for inner in inners:
                inner.state.clear()  # saved before any step: fresh moments
            return
        saved_tp = int(state.get("tp", 1))
        if saved_tp != self.tp:
            raise ValueError(
                f"{directory}: optimizer state was saved at local.megatron.tp={saved_tp}, this "
                f"trainer runs tp={self.tp}; resume at tp={saved_tp} or load the weights only"
            )
        saved = torch.load(directory / optimizer_file(self.tp, self.rank), weights_only=False)
        for inner, part in zip(inners, saved, strict=True):
            inner.load_state_dict(part["optimizer"])
            mains = [p for group in inner.param_groups for p in group["params"]]
            with torch.no_grad():
                for main, value in zip(mains, part["main_params"], strict=True):
                    main.copy_(value.to(main.device))
