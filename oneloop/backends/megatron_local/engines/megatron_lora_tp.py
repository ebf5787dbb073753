"""One tensor-parallel rank of a LoRA run of the `megatron` engine (`megatron_group` drives it).

`megatron_tp.MegatronTpRank` with the base frozen and the adapters split like their base linears
(`megatron_lora`, `megatron_lora_shard`). What differs from a full fine-tuning rank:
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
by construction (`megatron_lora` module docstring).
"""

import json
from pathlib import Path

import torch

from oneloop.backends.megatron_local.engines import megatron_offload
from oneloop.backends.megatron_local.engines.megatron_tp import MegatronTpRank, optimizer_file
from oneloop.backends.megatron_local.engines.megatron_trainer import ENGINE_STATE_FILE


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

    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        assert self.lora is not None
        directory.mkdir(parents=True, exist_ok=True)
        self.lora.save(directory)  # collective; rank 0 writes the PEFT directory
        if with_optimizer and self.steps > 0:  # before the first step there is no state to save
            torch.save(self._optimizer_state(), directory / optimizer_file(self.tp, self.rank))
        if self.rank == 0:
            state = {"steps": self.steps, "tp": self.tp}
            (directory / ENGINE_STATE_FILE).write_text(json.dumps(state))

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        assert self.lora is not None
        state = json.loads((directory / ENGINE_STATE_FILE).read_text())
        saved_tp, steps = int(state.get("tp", 1)), int(state["steps"])
        if with_optimizer and steps > 0 and saved_tp != self.tp:  # checked before changing anything
            raise ValueError(
                f"{directory}: optimizer state was saved at local.megatron.tp={saved_tp}, this "
                f"trainer runs tp={self.tp}; resume at tp={saved_tp} or load the adapter only"
            )
        self.lora.load(directory)  # the full adapter; each rank copies its part
        megatron_offload.reload_main_params(self.optimizer)  # fp32 main params follow it
        self.steps = steps
        if not with_optimizer:
            return
        if steps == 0:  # saved before any step: fresh moments
            megatron_offload.load_state(self.optimizer, None)
            return
        file = directory / optimizer_file(self.tp, self.rank)
        if not file.is_file():
            raise FileNotFoundError(f"{file}: this rank's optimizer state is missing")
        # checkpoint_state's layout (`_optimizer_state`), as every megatron engine writes it
        megatron_offload.load_state(self.optimizer, torch.load(file, weights_only=False))
