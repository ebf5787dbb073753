"""One rank of a pipeline-parallel `megatron` trainer group (pp > 1, optionally × tp, × dp, and
× ep for MoE models; the ranks are started and driven by `megatron.group`).

Every rank runs the same calls in the same order; what differs from the one-process engine:
- model: GPTModel of this rank's stage only (`pre_process` on the first stage: embeddings;
  `post_process` on the last: final norm + output layer; Megatron builds the stage's
  L/pp layers; a hybrid its slice of the layer pattern, `hybrid.block_spec`). Import gives the
  stage its layers by the layer-number offset (`parallel.pp_plan.stage_parts`), each TP rank its
  shard (`parallel.shard`; a hybrid's Gated DeltaNet by section), each EP rank its experts
  (`moe.to_megatron_rank`). Tied embeddings:
  the last stage holds a copy of the embedding as its output layer, kept equal the way
  megatron-core does: both gradients summed over the embedding group (`finalize_model_grads`).
- forward_backward: the token-budget micro-batches of `run_microbatches`' packing go through
  megatron-core's 1F1B schedule (`get_forward_backward_func`), with `variable_seq_lengths`
  (each micro-batch's [seq, rows, hidden] activation shape is sent ahead of it). The loss is
  Tinker's SUM: the last stage returns it with `calculate_per_token_loss` on, so the schedule
  does not divide by the token count or the number of micro-batches, and no
  `finalize_model_grads_func` runs per call (gradients accumulate until optim_step; the grads are
  finalised once there, never scaled). The last stage's per-datum logprobs, losses and metrics
  (input order, `run_microbatches` assembling the schedule's results) are broadcast over the
  pipeline group, so rank 0 (first stage) returns them. DP > 1: each replica (a whole pipeline)
  runs its share of the datums (`dp_shares`), every replica as many micro-batches as the busiest
  (idle ones: one token, no loss; EP dispatches pair up across the replicas of a stage), and the
  replicas' results are all-gathered (`gather_shares`); DDP sums the gradients.
- optim_step: `finalize_model_grads` (tied-embedding sum over the embedding group, QK-norm sum
  over the TP group), non-finite gradients on any rank are an error on every rank (grads
  zeroed, no step), then Megatron's optimizer: its grad norm is over every stage and TP shard
  (model-parallel group; the tied copy and TP duplicates counted once).
- export: each stage's (tp 0, dp 0) rank gathers its stage's full tensors (experts all-gathered
  over EP) and sends them to global rank 0, which returns the full HF weights (the others an empty
  dict; every rank must call it).
- checkpoint: rank 0 writes the full HF weights (loadable at any tp/pp/dp/ep); every rank writes
  its own optimizer shard (`trainer.optimizer_file`): resumable at the same layout only.
LoRA is refused (its adapters are not pipeline-parallel).
"""

import contextlib
from pathlib import Path

import torch

from oneloop.backends.megatron_local import losses
from oneloop.backends.megatron_local.engines.base import DatumArrays, ForwardResult, LoraSpec
from oneloop.backends.megatron_local.engines.megatron import moe as megatron_moe
from oneloop.backends.megatron_local.engines.megatron import routing as megatron_routing
from oneloop.backends.megatron_local.engines.megatron import speed as megatron_speed
from oneloop.backends.megatron_local.engines.megatron.data_parallel import (
    dp_shares,
    gather_shares,
    microbatch_counts,
    validate_everywhere,
)
from oneloop.backends.megatron_local.engines.megatron.layout import DenseShape
from oneloop.backends.megatron_local.engines.megatron.parallel.pp_plan import (
    check_pp,
    global_parts,
    rank_coords,
    stage_layers,
    stage_parts,
)
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
from oneloop.backends.megatron_local.engines.microbatch import (
    pack_microbatches,
    run_microbatches,
)
from oneloop.backends.megatron_local.engines.torch.routing import routing_counts, sampler_gaps
from oneloop.errors import CapabilityError

FREE_GAP = "routing/gap_free:sum"


class MegatronPpRank(MegatronTrainerEngine):
    """Global rank `rank` of a tp × pp group whose torch.distributed world is initialised."""

    def __init__(
        self, model_path: Path, lora: LoraSpec, *, parallel: MegatronParallel, rank: int, **kwargs
    ) -> None:
        if lora.rank > 0:
            raise CapabilityError(
                f"LoRA rank {lora.rank} with local.megatron.pp={parallel.pp}: the megatron "
                "engine's LoRA adapters are not pipeline-parallel; use pp=1 for LoRA"
            )
        if parallel.cp > 1:
            raise CapabilityError(
                f"local.megatron pp={parallel.pp} with cp={parallel.cp}: pipeline and context "
                "parallelism together are not built; use one of them"
            )
        from transformers import AutoConfig

        shape = DenseShape.from_hf(AutoConfig.from_pretrained(str(model_path)))
        check_tp(shape, parallel.tp)
        check_pp(shape.layers, parallel.pp)
        self.rank = self.global_rank = rank
        self.tp, self.pp = parallel.tp, parallel.pp
        self.coords = rank_coords(rank, parallel.tp, parallel.pp, parallel.cp, parallel.dp)
        self.layers = stage_layers(shape.layers, parallel.pp, self.coords.pp_rank)
        self.first, self.last = self.coords.pp_rank == 0, self.coords.pp_rank == parallel.pp - 1
        super().__init__(model_path, lora, parallel=parallel, **kwargs)
        from megatron.core import parallel_state as ps

        got = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_data_parallel_rank(),
        )
        want = (self.coords.tp_rank, self.coords.pp_rank, self.coords.dp_rank)
        if got != want:
            raise RuntimeError(f"rank {rank}: expected (tp, pp, dp) ranks {want}, got {got}")

    # -- construction ----------------------------------------------------------------------------

    def _transformer_config(self):
        from dataclasses import replace

        return replace(
            super()._transformer_config(),
            pipeline_model_parallel_size=self.pp,
            variable_seq_lengths=True,  # micro-batches differ in rows and length
            calculate_per_token_loss=True,  # the schedule keeps our SUM loss as is
            # without experts: only to pass megatron-core's MoE check (MoE: `moe.MoeSettings`'s)
            **({} if self.moe and self.moe.experts else {"moe_token_dispatcher_type": "alltoall"}),
        )

    def _stage(self) -> dict[str, bool]:
        return {"pre_process": self.first, "post_process": self.last}

    def _local_parts(self, mapped: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        stage = stage_parts(mapped, self.layers, self.first, self.last, self.shape.tied)
        return shard_all(stage, self.tp, self.coords.tp_rank, self._tp_sections())

    def _tp_sections(self) -> dict[str, list[int]] | None:
        """The Gated DeltaNet's fused tensors' row sections (hybrids), split by section."""
        return megatron_moe.tp_sections(self.moe) if self.shape.hybrid else None

    def _padded_length(self, longest: int) -> int:
        """Sequence parallelism (MoE at tp > 1) splits each micro-batch's positions over the TP
        ranks: padded to a multiple of tp (the padding is masked out of every loss)."""
        if not self.config.sequence_parallel:
            return longest
        return -(-longest // self.tp) * self.tp

    def _sequence_shard(self) -> tuple[int, int] | None:
        """(TP rank, tp) when this rank's MoE layers see one slice of the positions (sequence
        parallelism), else None: R3's records are sliced alike."""
        return (self.coords.tp_rank, self.tp) if self.config.sequence_parallel else None

    def _target_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return -vocab_parallel_cross_entropy(logits, targets)  # fp32 inside, TP all-reduced

    @staticmethod
    def _groups():
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()

    # -- training --------------------------------------------------------------------------------

    def forward_backward(
        self,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardResult:
        config = losses.validate_loss_config(loss_fn, loss_fn_config)
        # On every rank before any p2p: an input error raised by the last stage alone (in the loss)
        # would leave the other stages waiting in the schedule.
        validate_everywhere(loss_fn, data)
        if not data:
            return ForwardResult([], 0.0, [], {})
        self.model.train()
        budget, dp = self.max_tokens_per_microbatch, self.parallel.dp
        shares = dp_shares([len(d.tokens) for d in data], dp)
        mine = [data[i] for i in shares[self.coords.dp_rank]]
        groups = [[mine[i] for i in g] for g in pack_microbatches([len(d.tokens) for d in mine],
                                                                  budget)]  # fmt: skip
        # DP: every replica runs the busiest one's micro-batch count, the extra ones idle (one
        # token, no loss): EP dispatches pair up across the replicas of a stage, and a replica
        # with no datums still takes its part in the gradient reductions.
        total = max(microbatch_counts(data, shares, budget)) if dp > 1 else len(groups)
        # R3: every micro-batch's replay of this stage's MoE layers, built (and its records
        # checked) on every rank before the schedule starts
        free = megatron_routing.free_pass(data)
        replays = [
            megatron_routing.replay(
                self.module, g, self._padded_length(max(len(d.tokens) for d in g)), self.layers,
                self._sequence_shard(),
            )
            for g in groups
        ]  # fmt: skip
        counts: dict[str, float] = {}  # this stage's routing figures, summed over micro-batches
        done = self._schedule(groups, replays, total, loss_fn, config, forward_only, counts)
        result = None
        if self.last:
            results = iter(done)
            result = run_microbatches(mine, budget, lambda _: next(results))
        if any(r is not None for r in replays) or free:
            result = self._routing_figures(result, groups, total, counts, free)
        box = [result]
        _, pp_group = self._groups()
        last = torch.distributed.get_global_rank(pp_group, self.pp - 1)
        torch.distributed.broadcast_object_list(box, src=last, group=pp_group)
        return gather_shares(box[0], shares, len(data)) if dp > 1 else box[0]

    def _schedule(self, groups, replays, total, loss_fn, config, forward_only, counts) -> list:
        """One run of megatron-core's pipeline schedule over `groups` (then idle micro-batches up
        to `total`); the last stage's (LossResult, target logprobs) per micro-batch. `loss_fn`
        None: forward only, the target logprobs alone (R3's free pass)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = iter(list(zip(groups, replays, strict=True)) + [None] * (total - len(groups)))
        done: list = []  # last stage, per micro-batch
        fused = self.last and megatron_speed.fused_logprobs_applies(
            self.speed, self.module, self.tp
        )

        def step(iterator, model):
            item = next(iterator)
            if item is None:
                one = torch.zeros((1, self._padded_length(1)), dtype=torch.long, device=self.device)
                output = model(input_ids=one, position_ids=one, attention_mask=None)
                none = torch.zeros((), dtype=torch.int, device=self.device)
                return output, lambda out: (out.float().sum() * 0.0, none, {})
            batch, replay = item
            tokens, targets, mask, inputs, positions = self._batch_tensors(batch)
            kwargs = {}
            if fused:
                processor = megatron_speed.logprobs_processor(self.speed, targets, self.device)
                kwargs["output_processor"] = processor
            with replay or contextlib.nullcontext():
                output = model(input_ids=tokens, position_ids=positions, attention_mask=None,
                               **kwargs)  # fmt: skip
            if replay is not None:
                for key, value in routing_counts(replay.forced, replay.natural).items():
                    counts[key] = counts.get(key, 0.0) + value

            def loss(output: torch.Tensor):
                target_lp = output if fused else self._target_logprobs(output, targets)
                if loss_fn is None:  # R3's free pass: |trainer − sampler| without replay
                    done.append(sampler_gaps(inputs, mask, target_lp, key=FREE_GAP))
                    return target_lp.sum() * 0.0, mask.sum().to(torch.int), {}
                result = losses.compute_loss(loss_fn, target_lp, inputs, mask, config)
                if replay is not None and "logprobs" in inputs:
                    result.metrics.update(sampler_gaps(inputs, mask, target_lp))
                done.append((result, target_lp.detach().float().cpu().numpy()))
                return result.loss, mask.sum().to(torch.int), {}  # count: unused (no finalize)

            return output, loss

        longest = max((len(d.tokens) for g in groups for d in g), default=1)
        recompute = self.config.recompute_granularity is not None  # R3 again in the backward
        with (
            torch.set_grad_enabled(not forward_only),
            megatron_routing.schedule_replay(
                self.module, recompute and any(r is not None for r in replays)
            ),
        ):
            get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=batches,
                model=[self.model],
                num_microbatches=total,
                seq_length=longest,  # the first shapes; variable_seq_lengths sends each one
                micro_batch_size=max((len(g) for g in groups), default=1),
                forward_only=forward_only,
            )
        return done

    def _routing_figures(self, result, groups, total, counts, free):
        """R3's `routing/...` figures on the last stage's result: every stage's (and sequence
        shard's) replayed and differing pairs summed over the model-parallel group, and with
        `free` the gap without replay from a second, forward-only run of the schedule without
        replay (every rank runs it)."""
        from megatron.core import parallel_state as ps

        # MoE at tp > 1 is sequence parallel: each TP rank counted its own positions
        summed = megatron_routing.summed_counts(counts, ps.get_model_parallel_group())
        gaps = []
        if free:
            with torch.no_grad():
                gaps = self._schedule(groups, [None] * len(groups), total, None, None, True, {})
        if result is not None:
            figures = dict(summed)
            if free:
                figures[FREE_GAP] = sum(g[FREE_GAP] for g in gaps)
            result.metrics.update({k: result.metrics.get(k, 0.0) + v for k, v in figures.items()})
        return result

    def _finish_grads(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])  # DP sync, QK-norm TP sum, tied-embedding sum
        bad = torch.zeros(1, device=self.device)
        for param in self.model.parameters():
            grad = getattr(param, "main_grad", None)
            if param.requires_grad and grad is not None and not torch.isfinite(grad).all():
                bad.fill_(1.0)
                break
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if bad.item() > 0:
            self.model.zero_grad_buffer()  # the group stays usable; the next step starts clean
            self.optimizer.zero_grad()
            raise RuntimeError("megatron optim_step: non-finite gradients (step skipped)")

    # -- weights ---------------------------------------------------------------------------------

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Full HF weights on rank 0 (empty dict elsewhere); every rank must call it."""
        tp_group, _ = self._groups()
        params = {n: p.detach() for n, p in self._params_by_hf_layout().items()}
        local = {}
        for name, part in self._with_all_experts(params).items():  # EP > 1: a collective
            if self.tp > 1 and tp_kind(name) != REPLICATED:
                parts = [torch.empty_like(part) for _ in range(self.tp)]
                torch.distributed.all_gather(parts, part.contiguous(), group=tp_group)
                part = gather(name, parts, self._tp_sections())
            local[name] = part
        if self.coords.tp_rank != 0 or self.coords.dp_rank != 0:
            return {}
        mine = global_parts(local, self.layers, self.first, self.shape.tied)
        dist = torch.distributed
        if self.rank != 0:  # this stage's (tp 0, dp 0) rank sends its tensors to rank 0
            dist.send_object_list([[(n, tuple(t.shape), t.dtype) for n, t in mine.items()]], 0)
            for tensor in mine.values():
                dist.send(tensor.contiguous(), 0)
            return {}
        full = dict(mine)
        p = self.parallel
        for stage in range(1, self.pp):
            src = stage * p.tp * p.cp * p.dp  # (tp 0, cp 0, dp 0, stage) in Megatron's order
            meta: list = [None]
            dist.recv_object_list(meta, src)
            for name, shape, dtype in meta[0]:
                full[name] = torch.empty(shape, dtype=dtype, device=self.device)
                dist.recv(full[name], src)
        return self._full_to_hf(full)
