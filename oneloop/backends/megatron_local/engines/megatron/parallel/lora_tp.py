"""One tensor-parallel rank of a LoRA run of the `megatron` engine (`megatron.group` drives it).

`parallel.tp.MegatronTpRank` with the base frozen and the adapters split like their base linears
(`megatron.lora`, `parallel.lora_shard`). What differs from a full fine-tuning rank:
- `hf_weights` (sampler weights) are merged with the adapter: every rank gathers the split adapter
  parts, rank 0 merges them into the full HF weights it gathered;
- `adapter()` (vLLM LoRA modules) is the full PEFT adapter, identical in layout to TP = 1's and
  the `torch` engine's; a collective, so the group calls it on every rank;
- checkpoint: rank 0 writes the full adapter as a PEFT directory (loadable at any TP size, by peft
  and vLLM) and `engine.json` (steps, tp); each rank writes its own optimizer shard
  (`optimizer.tp{T}.rank{r}.pt`: Adam moments of its adapter parts), so the optimizer state
  resumes at the same TP size only — a mismatch is refused with the reason.
Gradients need nothing beyond Megatron's DDP: the base is frozen (QK-norm included, so the
`MegatronTpRank` QK-norm sum finds nothing) and the adapters' gradients are complete on each rank
by construction (`megatron.lora` module docstring).
"""

import torch

from oneloop.backends.megatron_local.engines.megatron.parallel.tp import MegatronTpRank


class MegatronLoraTpRank(MegatronTpRank):
    """Rank `rank` of a TP group training LoRA (rank > 0); see the module docstring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.lora is None:
            raise ValueError("MegatronLoraTpRank trains LoRA: the LoraSpec rank must be > 0")

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """LoRA-merged full HF weights on rank 0 (empty dict elsewhere); every rank calls it."""
        assert self.lora is not None
        return self.lora.merge(super().hf_weights())
