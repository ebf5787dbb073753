"""One context-parallel rank of the `megatron` trainer engine (`megatron.group` drives the ranks).

CP without TransformerEngine: Megatron's local spec with the core attention swapped for
`cp_core_attention` (torch SDPA over K/V all-gathered across the CP group, `parallel.cp`). What
differs from a TP rank (`parallel.tp.MegatronTpRank`, which this class extends, so CP × TP ranks
shard their weights and vocabulary as TP ranks do):
- input: each micro-batch is right-padded to a multiple of 2·cp (padding masked) and each rank
  feeds its two chunks of tokens with their global position ids (`parallel.cp` layout);
- micro-batch budget: `max_tokens_per_microbatch` counts the tokens one GPU holds, and a rank
  holds 1/cp of every sequence, so the packing admits cp × the budget in sequence tokens;
- loss: each rank backpropagates the Tinker loss (a SUM) of its own tokens, so the sum of the
  ranks' gradients is the gradient of the full loss. Megatron's DDP averages over the DP×CP group
  by default (it pre-scales by 1/dp_cp_size); `calculate_per_token_loss=True` makes that factor 1
  (sums), which is Tinker's semantics;
- results: every rank all-gathers the target logprobs into global order and evaluates the loss
  on the full batch (no grad), so per-datum logprobs, losses and metrics on the driver (group
  rank 0) are the cp = 1 engine's computation on the same values;
- RoPE: Megatron's (it slices its tables with the same chunk layout) or, with `fused_rope`, ours
  at the global positions;
- MoE and the Gated DeltaNet hybrids (tp = 1): each rank routes its own positions, experts split
  by ep over the cp · dp ranks; R3 replays this rank's positions' records (`megatron.routing`),
  its replayed / differing counts summed over the CP group; a replica with fewer micro-batches
  runs idle ones of two tokens a rank (one per chunk). megatron-core's GatedDeltaNet trades the
  sequence chunks for heads over the CP group (all-to-all) and back;
- checkpoint: global rank 0 writes the HF weights; every rank writes its own optimizer shard
  (`optimizer.tp{T}.cp{C}.rank{R}.pt`, the distributed optimizer shards over DP×CP), resumable at
  the same tp and cp only.
Refused with the reason: LoRA (adapters under CP untested), pp > 1 together with cp > 1, the
`cudnn` attention backend (no lower-right causal path in torch SDPA), and the sequence-level
losses (`losses.SEQUENCE_LEVEL_LOSSES`: gspo's ratio is a mean over a whole datum).
"""

import contextlib
import dataclasses
from pathlib import Path

import numpy as np
import torch

from oneloop.backends.megatron_local import losses
from oneloop.backends.megatron_local.engines.base import DatumArrays, LoraSpec
from oneloop.backends.megatron_local.engines.megatron import routing as megatron_routing
from oneloop.backends.megatron_local.engines.megatron import speed as megatron_speed
from oneloop.backends.megatron_local.engines.megatron.parallel.cp import (
    cp_attention,
    gather_rows,
    gather_sequence,
    padded_length,
    rank_positions,
)
from oneloop.backends.megatron_local.engines.megatron.parallel.tp import MegatronTpRank
from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel
from oneloop.backends.megatron_local.engines.microbatch import padded_arrays
from oneloop.backends.megatron_local.engines.torch.routing import routing_counts, sampler_gaps
from oneloop.errors import CapabilityError


def check_cp(parallel: MegatronParallel, lora: LoraSpec, speed: megatron_speed.MegatronSpeed):
    """Raise CapabilityError naming the setting when this CP configuration is not supported."""
    cp = parallel.cp
    if lora.rank > 0:
        raise CapabilityError(
            f"LoRA rank {lora.rank} with local.megatron.cp={cp}: LoRA under context parallelism "
            "is not verified in the megatron engine; use cp=1 for LoRA"
        )
    if parallel.pp > 1:
        raise CapabilityError(
            f"local.megatron.cp={cp} with pp={parallel.pp}: context parallelism is not combined "
            "with pipeline stages in this engine; use pp=1 (tp × cp)"
        )
    if speed.attention_backend == "cudnn":
        raise CapabilityError(
            f"local.megatron.cp={cp} with speed.attention_backend='cudnn': torch SDPA has no "
            "cuDNN kernel for the lower-right causal mask CP needs; use auto, flash or efficient"
        )


def cp_core_attention(backend: megatron_speed.AttentionBackend, rope_theta: float | None):
    """Megatron core-attention class for CP ranks: K/V gathered over the CP group, each local query
    chunk causal over its global prefix; with `rope_theta`, RoPE at the global positions first."""
    from megatron.core.transformer.module import MegatronModule

    class SdpaCpCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
            super().__init__(config=config)
            self.softmax_scale = kwargs.get("softmax_scale")
            self.cp_group = kwargs["pg_collection"].cp
            self.backend, self.rope_theta = backend, rope_theta
            self._tables: tuple | None = None

        def _rotate(self, query, key):
            cp, local, dim = self.cp_group.size(), query.size(0), query.size(-1)
            seq = local * cp
            if self._tables is None or self._tables[0].size(0) < seq:
                self._tables = megatron_speed.rope_tables(
                    seq, dim, float(self.rope_theta), query.device
                )
            positions = rank_positions(seq, cp, self.cp_group.rank(), query.device)
            cos, sin = (t.index_select(0, positions) for t in self._tables)
            rope = megatron_speed.rope_fn(query.device)
            return rope(query, cos, sin), rope(key, cos, sin)

        def forward(self, query, key, value, attention_mask, **kwargs):
            if self.rope_theta is not None:
                query, key = self._rotate(query, key)
            key = gather_sequence(key, self.cp_group)  # [s, b, kv_heads, d], global order
            value = gather_sequence(value, self.cp_group)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            cp, rank = self.cp_group.size(), self.cp_group.rank()
            if self.backend == "auto":
                out = cp_attention(q, k, v, cp, rank, scale=self.softmax_scale)
            else:
                with torch.nn.attention.sdpa_kernel(megatron_speed.sdpa_backends(self.backend)):
                    out = cp_attention(q, k, v, cp, rank, scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)

    return SdpaCpCoreAttention


class MegatronCpRank(MegatronTpRank):
    """Global rank `rank` of a tp × cp group (Megatron's order: TP fastest, then CP) whose
    torch.distributed world is already initialised."""

    def __init__(
        self, model_path: Path, lora: LoraSpec, *, parallel: MegatronParallel, rank: int, **kwargs
    ) -> None:
        check_cp(parallel, lora, kwargs.get("speed") or megatron_speed.MegatronSpeed())
        self.cp, self.global_rank = parallel.cp, rank
        self.cp_rank = (rank // parallel.tp) % parallel.cp
        super().__init__(model_path, lora, parallel=parallel, rank=rank % parallel.tp, **kwargs)
        self.max_tokens_per_microbatch *= parallel.cp  # per GPU: a rank holds 1/cp of each sequence
        from megatron.core import parallel_state

        if parallel_state.get_context_parallel_rank() != self.cp_rank:
            raise RuntimeError(
                f"rank {rank} got CP rank {parallel_state.get_context_parallel_rank()}, "
                f"expected {self.cp_rank}"
            )

    def _cp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    def _transformer_config(self):
        # Sums, not averages, over DP×CP (module docstring); RoPE tables span cp × local length.
        return dataclasses.replace(
            super()._transformer_config(),
            context_parallel_size=self.cp,
            calculate_per_token_loss=True,
        )

    def _core_attention(self):
        theta = self.shape.rope_theta if self.fused_rope else None
        return cp_core_attention(self.speed.attention_backend, theta)

    def _microbatch(
        self, data: list[DatumArrays], loss_fn: str, config: dict[str, float], forward_only: bool
    ) -> tuple["losses.LossResult", np.ndarray]:
        if loss_fn in losses.SEQUENCE_LEVEL_LOSSES:  # every CP rank refuses, before any collective
            raise CapabilityError(
                f"loss_fn={loss_fn!r} with local.megatron.cp={self.cp}: its per-datum sequence "
                "ratio spans the CP ranks' parts of each datum, which a rank's loss cannot see; "
                "use cp=1 for this loss"
            )
        batch = len(data)
        seq = padded_length(max(len(d.tokens) for d in data), self.cp)
        tokens, targets, mask, inputs = padded_arrays(data, seq)
        dev = self.device
        mine = rank_positions(seq, self.cp, self.cp_rank)
        full_mask = torch.from_numpy(mask).to(dev)
        full_inputs = {k: torch.from_numpy(v).to(dev) for k, v in inputs.items()}
        # contiguous: numpy's column gather may return non-C-ordered rows (vocab-parallel CE views)
        tokens_t = torch.from_numpy(np.ascontiguousarray(tokens[:, mine.numpy()])).to(dev)
        targets_t = torch.from_numpy(np.ascontiguousarray(targets[:, mine.numpy()])).to(dev)
        mask_t = full_mask[:, mine.to(dev)]
        inputs_t = {k: v[:, mine.to(dev)] for k, v in full_inputs.items()}
        positions = mine.to(dev).unsqueeze(0).expand(batch, -1)
        # R3 (MoE): this rank's positions' recorded experts; the backward runs inside the replay
        replay = megatron_routing.replay(self.module, data, seq, positions=mine)
        with torch.set_grad_enabled(not forward_only), replay or contextlib.nullcontext():
            target_lp = self._logprobs(tokens_t, targets_t, positions)
            if not forward_only:  # this rank's part of the summed loss
                losses.compute_loss(loss_fn, target_lp, inputs_t, mask_t, config).loss.backward()
        full_lp = gather_rows(target_lp.detach().float(), self._cp_group())
        with torch.no_grad():
            result = losses.compute_loss(loss_fn, full_lp, full_inputs, full_mask, config)
        if replay is not None:
            local = (tokens_t, targets_t, positions)
            figures = self._routing_figures(replay, full_inputs, full_mask, full_lp, local)
            result.metrics.update(figures)
        return result, full_lp.cpu().numpy()

    def _routing_figures(self, replay, inputs, mask, full_lp, local) -> dict[str, float]:
        """R3's figures of one micro-batch: every CP rank's replayed and differing pairs summed
        over the CP group, and with sampler logprobs the gaps with replay and without (a no-grad
        forward of every rank's chunks, gathered)."""
        counts = routing_counts(replay.forced, replay.natural)
        figures = megatron_routing.summed_counts(counts, self._cp_group())
        if "logprobs" in inputs:
            with torch.no_grad():
                free = gather_rows(self._logprobs(*local).float(), self._cp_group())
            figures.update(sampler_gaps(inputs, mask, full_lp))
            figures.update(sampler_gaps(inputs, mask, free, key="routing/gap_free:sum"))
        return figures

    def _idle_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """An idle micro-batch (EP: a replica with fewer micro-batches joins the dispatches):
        one token in each of this rank's two chunks, at their global positions."""
        mine = rank_positions(2 * self.cp, self.cp, self.cp_rank, self.device)
        return torch.zeros((1, 2), dtype=torch.long, device=self.device), mine.unsqueeze(0)

    # -- checkpoint (one weights file, one optimizer shard per global rank) -----------------------
