"""Trainer engine `megatron`: megatron-core `GPTModel` with the distributed optimizer, on GPU.

Same contract as `torch.trainer.TorchTrainerEngine` (Tinker losses from `losses`, sums over
tokens, gradients accumulating until `optim_step`, AdamW with every AdamParams field applied each
step), so the loop, the clients and `oneloop serve` cannot tell the engines apart.

- Model: Qwen3 / Qwen2 / Llama dense, Qwen3-MoE (megatron-core's MoE layers, `moe.MoeSettings`,
  experts as grouped GEMMs: `grouped_experts`) and the Qwen3.5 / 3.6 Gated DeltaNet hybrids
  (`megatron.hybrid`) from a local HF directory; weights mapped by `layout` / `moe` (round-trip
  tested). TE's layer spec when TE imports, else the local spec with torch SDPA as the core
  attention (the stock one materialises the s×s scores: 2.8× slower at seq 4096 on an H200).
- Speed without TE (`megatron.speed.MegatronSpeed`, measured by benchmarks/gpu_mfu.py): target
  logprobs from the hidden states (`fused_logprobs`, no fp32 full-vocab logits), bf16 norms,
  SwiGLU fusion, fused AdamW, SDPA backend choice, opt-in RoPE fusion.
- Parallelism: one object is one rank. More than one rank: `megatron.group.MegatronRayGroup`
  starts every rank as a Ray actor and drives them; TP > 1 or DP > 1: `parallel.tp.MegatronTpRank`
  (this class plus the shard maps) is each rank. DP > 1: each `forward_backward` splits its datums
  over the replicas by token count (`dp_shares`), each runs its own token-budget micro-batches and
  the results are gathered (`merge_shares`); Megatron's DDP sums the replicas' gradients and the
  distributed optimizer shards its state over them; PP > 1: `parallel.pp.MegatronPpRank` is
  each rank (one pipeline stage, Megatron's schedule); CP > 1: `parallel.cp_rank.MegatronCpRank`
  is each rank (tp × cp; K/V all-gathered over the CP group into our SDPA attention, no TE).
  EP > 1 (MoE, cp = 1, no LoRA: `moe.check_engine_layout`): each layer's experts split over the
  tp · dp ranks of each stage, tokens dispatched all-to-all (MoE and hybrids at tp > 1: sequence
  parallel, experts whole, the PP rank class as one stage); replicas with fewer
  micro-batches run idle ones (one token, no loss): each dispatch is an EP-group collective. R3:
  `megatron.routing` replays a datum's recorded experts.
- Optimizer: Megatron DDP + `get_megatron_optimizer` (fp32 main params, distributed optimizer,
  optional CPU offload). Megatron's default exempts norms and biases from weight decay; Tinker's
  AdamW (torch semantics) decays every parameter, so the exemption is switched off.
- LoRA (rank > 0): `megatron.lora` (the `torch` engine's peft semantics on the fused linears; base
  frozen, DDP and optimizer over the adapters only; the local spec; TP > 1: `parallel.lora_tp`,
  adapters split like their base linears). LoRA checkpoints hold the adapter (PEFT directory).
"""

import contextlib
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from oneloop.backends.megatron_local import losses
from oneloop.backends.megatron_local.engines.base import (
    DatumArrays,
    ForwardResult,
    LoraAdapter,
    LoraSpec,
    TrainerEngine,
)
from oneloop.backends.megatron_local.engines.hf import DTYPES, set_threads, token_logprobs
from oneloop.backends.megatron_local.engines.megatron import grouped_experts, hybrid, moe_dispatch
from oneloop.backends.megatron_local.engines.megatron import lora as megatron_lora
from oneloop.backends.megatron_local.engines.megatron import moe as megatron_moe
from oneloop.backends.megatron_local.engines.megatron import offload as megatron_offload
from oneloop.backends.megatron_local.engines.megatron import routing as megatron_routing
from oneloop.backends.megatron_local.engines.megatron import speed as megatron_speed
from oneloop.backends.megatron_local.engines.megatron.checkpoint import check_resumable
from oneloop.backends.megatron_local.engines.megatron.data_parallel import (
    dp_shares,
    gather_shares,
    microbatch_counts,
    validate_everywhere,
)
from oneloop.backends.megatron_local.engines.megatron.layout import (
    MOE_ATTENTION_TYPES,
    DenseShape,
    hf_to_megatron,
    megatron_param_names,
    megatron_to_hf,
)
from oneloop.backends.megatron_local.engines.megatron.world import init_distributed
from oneloop.backends.megatron_local.engines.microbatch import padded_arrays, run_microbatches
from oneloop.backends.megatron_local.engines.torch.routing import replay_metrics

WEIGHTS_FILE = "model.safetensors"  # HF names: a checkpoint is also a loadable HF model
OPTIMIZER_FILE = "optimizer.pt"
ENGINE_STATE_FILE = "engine.json"
NO_CLIP = 1e30  # clip_grad this large never clips but makes Megatron report the grad norm


@dataclass(frozen=True)
class MegatronParallel:
    """Parallel sizes (one-line docs in `BackendConfig.local.megatron`)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    use_distributed_optimizer: bool = True
    optimizer_cpu_offload: bool = False
    recompute: str = "none"  # "full": every decoder layer recomputed in the backward


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _te_name(name: str) -> str:
    """Local-spec name → TE-spec name (TE fuses the pre-norms into the following linear)."""
    return name.replace(
        "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"
    ).replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")


def _read_hf_weights(model_path: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors weights to import")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


def optimizer_file(layout: dict[str, int], rank: int) -> str:
    """Optimizer state file of group rank `rank`: `optimizer.pt` for one process, else
    `optimizer.tp{T}[.pp{P}][.cp{C}][.dp{D}][.ep{E}].rank{r}.pt` (each rank's shard; same sizes to
    resume)."""
    if all(size == 1 for size in layout.values()):
        return OPTIMIZER_FILE
    extra = "".join(f".{k}{layout[k]}" for k in ("pp", "cp", "dp", "ep") if layout.get(k, 1) > 1)
    return f"optimizer.tp{layout['tp']}{extra}.rank{rank}.pt"


class MegatronTrainerEngine(TrainerEngine):
    """See the module docstring."""

    global_rank = 0  # rank in the trainer's group (the group rank classes set theirs)
    layers: range | None = None  # the decoder layers this rank builds (PP: its stage's), None: all

    def __init__(
        self,
        model_path: Path,
        lora: LoraSpec,
        *,
        dtype: str = "bfloat16",
        max_tokens_per_microbatch: int = 16384,
        threads: int | None = None,
        device: str = "cuda",
        parallel: MegatronParallel | None = None,
        speed: megatron_speed.MegatronSpeed | None = None,
        moe: megatron_moe.MoeSettings | None = None,
    ) -> None:
        from transformers import AutoConfig

        set_threads(threads)
        self.parallel = parallel or MegatronParallel()
        self.speed = speed or megatron_speed.MegatronSpeed()
        self.moe_settings = moe or megatron_moe.MoeSettings()
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        hf_config = AutoConfig.from_pretrained(str(model_path))
        self.shape = DenseShape.from_hf(hf_config)  # the attention's figures (MoE included)
        self.moe: megatron_moe.HybridShape | None = None  # MoE / hybrid families' layers
        if self.shape.model_type in MOE_ATTENTION_TYPES or self.shape.hybrid:
            self.moe = megatron_moe.HybridShape.from_hf(hf_config)
            p = self.parallel
            megatron_moe.check_engine_layout(
                self.moe, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, dp=p.dp, lora_rank=lora.rank
            )
        experts = self.moe is not None and self.moe.experts > 0
        init_distributed(self.parallel, self.device, expert_tp=1 if experts else None)
        if self.device.type == "cuda":
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(lora.seed or 0)
        self.te = megatron_speed.use_te(
            self.speed,
            te_importable=_te_available(),
            lora_rank=lora.rank,
            cp=self.parallel.cp,
            moe=self.moe is not None,
        )
        megatron_speed.check_rope(self.speed, self.shape.rope_scaling)
        self.fused_rope = megatron_speed.fused_rope_on(
            self.speed, te=self.te, hybrid=self.shape.hybrid,
            rotary_percent=self.shape.rotary_percent, rope_scaling=self.shape.rope_scaling,
        )  # fmt: skip
        self.module = self._build_model()
        self._import_hf(_read_hf_weights(model_path))
        self.lora = (
            megatron_lora.inject(
                self.module, self.shape, lora, tp=self.parallel.tp, base_model_path=str(model_path)
            )
            if lora.rank > 0
            else None
        )
        self.model, self.optimizer = self._build_optimizer()
        self.steps = 0

    # -- construction ----------------------------------------------------------------------------

    def _transformer_config(self):
        from megatron.core.transformer.transformer_config import TransformerConfig

        s = self.shape
        return TransformerConfig(
            num_layers=s.layers,
            hidden_size=s.hidden,
            ffn_hidden_size=s.ffn,
            num_attention_heads=s.heads,
            num_query_groups=s.kv_heads,
            kv_channels=s.head_dim,
            gated_linear_unit=True,
            activation_func=F.silu,
            normalization="RMSNorm",
            layernorm_epsilon=s.rms_eps,
            qk_layernorm=s.qk_norm,
            add_bias_linear=False,
            add_qkv_bias=s.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            pipeline_dtype=self.dtype,
            bias_activation_fusion=self.speed.swiglu_fusion,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            use_cpu_initialization=self.device.type != "cuda",
            # DP: Megatron's DDP sums the replicas' gradients instead of averaging (Tinker's sums)
            calculate_per_token_loss=self.parallel.dp > 1,
            **megatron_speed.recompute_fields(self.parallel.recompute),
            **hybrid.transformer_fields(
                self.moe, self.moe_settings, self.parallel, cpu=self.device.type == "cpu"
            ),
        )

    def _build_model(self):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt import gpt_layer_specs as specs

        self.config = self._transformer_config()
        if self.te:
            spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.shape.qk_norm)
        elif self.shape.hybrid:
            hybrid.check_speed(self.speed.fused_rope)
            attention, grouped = self._core_attention(), self.speed.grouped_experts
            spec = hybrid.block_spec(self.moe, attention, grouped, layers=self.layers)
        else:
            spec = specs.get_gpt_layer_local_spec(
                num_experts=self.moe.experts if self.moe else None,
                moe_grouped_gemm=False,
                normalization="RMSNorm",
                qk_layernorm=self.shape.qk_norm,
            )
            spec.submodules.self_attention.submodules.core_attention = self._core_attention()
            if self.moe is not None and self.speed.grouped_experts:
                grouped_experts.use_grouped_experts(spec)
            if self.config.sequence_parallel:  # MoE at tp > 1: norms that take a sequence slice
                count = len(self.layers or range(self.shape.layers))
                spec = hybrid.sequence_parallel_block(spec, count, self.shape.qk_norm)
        model = GPTModel(
            config=self.config,
            transformer_layer_spec=spec,
            vocab_size=self.shape.vocab,
            max_sequence_length=self.shape.max_positions,
            **self._stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=self.shape.tied,
            # fused_rope: the SDPA core attention applies RoPE itself (megatron_speed)
            position_embedding_type="none" if self.fused_rope else "rope",
            rotary_base=int(self.shape.rope_theta),
            rotary_percent=self.shape.rotary_percent,
            rope_scaling=self.shape.rope_scaling is not None,
            rope_scaling_factor=self.shape.rope_scaling or 8.0,  # 8.0: unused, megatron's default
        )
        if self.shape.hybrid and self.device.type == "cuda":
            hybrid.training_kernel(model)  # fla's backward refused: torch delta rule
        if self.moe is not None and self.moe.experts > 0 and self.speed.gather_dispatch:
            moe_dispatch.use_gather_dispatch(model)
        if self.speed.bf16_norms:
            megatron_speed.cast_norms(model, self.dtype)
        return model.to(self.device)

    def _core_attention(self):
        """The local spec's core attention: torch SDPA (CP ranks: megatron.parallel.cp_rank)."""
        return megatron_speed.sdpa_core_attention(
            self.speed.attention_backend,
            rope_theta=self.shape.rope_theta if self.fused_rope else None,
        )

    def _params_by_hf_layout(self) -> dict[str, torch.nn.Parameter]:
        """Module parameters keyed by their local-spec names (TE names mapped back)."""
        params = {
            n: p for n, p in self.module.named_parameters() if not megatron_lora.is_lora_name(n)
        }
        if not self.te:
            return params
        inverse = {_te_name(n): n for n in megatron_param_names(self.shape)}
        return {inverse.get(name, name): p for name, p in params.items()}

    def _to_megatron(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full HF weights → this rank's Megatron-layout weights (MoE: its experts only)."""
        if self.moe is None:
            return hf_to_megatron(self.shape, hf)
        self.composite = any(n.startswith(hybrid.COMPOSITE_PREFIX) for n in hf)
        hf = hybrid.text_weights(hf)  # a multimodal or fused-expert checkpoint's decoder
        mega = megatron_moe.to_megatron_rank(self.moe, hf, self.parallel.ep)
        return grouped_experts.stack(mega) if self.speed.grouped_experts else mega

    def _to_hf(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's Megatron-layout weights → full HF weights (MoE at EP > 1: a collective)."""
        return self._full_to_hf(self._with_all_experts(params))

    def _with_all_experts(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """MoE: per-expert names and every expert (EP > 1: all-gathered, a collective)."""
        if self.moe is None:
            return params
        unstacked = grouped_experts.unstack(params)  # per-expert names either way
        return megatron_moe.gather_experts(self.moe, unstacked, self.parallel.ep)

    def _full_to_hf(self, mega: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Megatron-layout weights of every layer and expert → the checkpoint's HF names."""
        if self.moe is None:
            return megatron_to_hf(self.shape, mega)
        hf = megatron_moe.megatron_to_hf(self.moe, mega)
        return hybrid.checkpoint_weights(hf, self.composite)

    def _import_hf(self, hf: dict[str, torch.Tensor]) -> None:
        mapped = self._local_parts(self._to_megatron(hf))
        params = self._params_by_hf_layout()
        missing = sorted(set(params) - set(mapped))
        extra = sorted(set(mapped) - set(params))
        if missing or extra:
            raise ValueError(
                f"HF → Megatron mapping mismatch: missing {missing[:4]}, extra {extra[:4]}"
            )
        with torch.no_grad():
            for name, param in params.items():
                src = mapped[name]
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{name}: HF gives {tuple(src.shape)}, Megatron has {tuple(param.shape)}"
                    )
                param.copy_(src.to(param.device, param.dtype))

    def _stage(self) -> dict[str, bool]:  # GPTModel's: one stage here (PP: parallel.pp)
        return {"pre_process": True, "post_process": True}

    def _local_parts(self, mapped: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's parts of full Megatron-layout weights (all of them here; TP: parallel.tp)."""
        return mapped

    def _target_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_logprobs(logits, targets)  # full-vocabulary logits (TP: megatron.parallel.tp)

    def _build_optimizer(self):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=self.parallel.use_distributed_optimizer,
            ),
            module=self.module,
        )
        config = OptimizerConfig(
            optimizer="adam",
            lr=0.0,
            weight_decay=0.0,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=self.parallel.use_distributed_optimizer,
            clip_grad=NO_CLIP,
            **megatron_offload.optimizer_config_fields(
                self.parallel.optimizer_cpu_offload,
                self.parallel.use_distributed_optimizer,
                self.parallel.tp * self.parallel.pp * self.parallel.cp * self.parallel.dp,
                {p.dtype for p in self.module.parameters() if p.requires_grad},
            ),
        )
        # config_overrides={} (not None): no weight-decay exemptions, as torch's AdamW.
        optimizer = get_megatron_optimizer(config, [ddp], config_overrides={})
        if self.parallel.optimizer_cpu_offload:  # fused_adam: no GPU part (megatron_offload)
            megatron_offload.check_adamw(optimizer)
        elif self.speed.fused_adam:
            megatron_speed.use_fused_adam(optimizer)
        return ddp, optimizer

    # -- training --------------------------------------------------------------------------------

    def forward_backward(
        self,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardResult:
        config = losses.validate_loss_config(loss_fn, loss_fn_config)
        self.model.train()
        if self.parallel.dp == 1:
            return run_microbatches(
                data,
                self.max_tokens_per_microbatch,
                lambda batch: self._microbatch(batch, loss_fn, config, forward_only),
            )
        validate_everywhere(loss_fn, data)  # DP: this replica's share, then the whole call's
        from megatron.core import parallel_state

        shares = dp_shares([len(d.tokens) for d in data], self.parallel.dp)
        share = shares[parallel_state.get_data_parallel_rank()]
        mine = run_microbatches(
            [data[i] for i in share],
            self.max_tokens_per_microbatch,
            lambda batch: self._microbatch(batch, loss_fn, config, forward_only),
        )
        if self.parallel.ep > 1:  # each micro-batch's token dispatch is an EP-group collective
            counts = microbatch_counts(data, shares, self.max_tokens_per_microbatch)
            passes = 1 + megatron_routing.free_pass(data)  # R3's extra forward: a dispatch too
            for _ in range(max(counts) - counts[parallel_state.get_data_parallel_rank()]):
                self._idle_microbatch(forward_only, passes)
        return gather_shares(mine, shares, len(data))

    def _batch_tensors(self, data: list[DatumArrays]) -> tuple[torch.Tensor, ...]:
        """tokens, targets, mask [rows, T] (right-padded), loss inputs {key: [rows, T]} and
        positions of one micro-batch, on the engine's device (T: `_padded_length`)."""
        batch, seq = len(data), self._padded_length(max(len(d.tokens) for d in data))
        tokens, targets, mask, inputs = padded_arrays(data, seq)
        dev = self.device
        tokens_t = torch.from_numpy(tokens).to(dev, non_blocking=True)
        targets_t = torch.from_numpy(targets).to(dev, non_blocking=True)
        mask_t = torch.from_numpy(mask).to(dev, non_blocking=True)
        inputs_t = {k: torch.from_numpy(v).to(dev, non_blocking=True) for k, v in inputs.items()}
        positions = torch.arange(seq, device=dev).unsqueeze(0).expand(batch, -1)
        return tokens_t, targets_t, mask_t, inputs_t, positions

    def _padded_length(self, longest: int) -> int:  # sequence parallelism: parallel.pp
        return longest

    def _microbatch(
        self, data: list[DatumArrays], loss_fn: str, config: dict[str, float], forward_only: bool
    ) -> tuple["losses.LossResult", np.ndarray]:
        tokens_t, targets_t, mask_t, inputs_t, positions = self._batch_tensors(data)
        replay = megatron_routing.replay(self.module, data, tokens_t.shape[1])  # R3, or None
        # Right padding under a causal mask: real tokens never attend to the padding after them.
        with torch.set_grad_enabled(not forward_only), replay or contextlib.nullcontext():
            target_lp = self._logprobs(tokens_t, targets_t, positions)
            result = losses.compute_loss(loss_fn, target_lp, inputs_t, mask_t, config)
            if not forward_only:
                result.loss.backward()
        if replay is not None:
            free = functools.partial(self._logprobs, tokens_t, targets_t, positions)
            result.metrics.update(
                replay_metrics(replay.forced, replay.natural, inputs_t, mask_t, target_lp, free)
            )
        return result, target_lp.detach().float().cpu().numpy()

    def _logprobs(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor):
        """Target logprobs [rows, T] of one padded micro-batch."""
        if megatron_speed.fused_logprobs_applies(self.speed, self.module, self.parallel.tp):
            out = megatron_speed.logprobs_processor(self.speed, targets, self.device)
            return self.model(input_ids=tokens, position_ids=positions, attention_mask=None,
                              output_processor=out)  # fmt: skip
        logits = self.model(input_ids=tokens, position_ids=positions, attention_mask=None)
        return self._target_logprobs(logits, targets)

    def _idle_microbatch(self, forward_only: bool, passes: int) -> None:
        """Forward (and backward) one token with no loss, then `passes` − 1 no-grad forwards: a
        replica with fewer micro-batches than the others of its EP group joins their dispatches."""
        tokens, positions = self._idle_tokens()
        with torch.set_grad_enabled(not forward_only):
            logits = self.model(input_ids=tokens, position_ids=positions, attention_mask=None)
            if not forward_only:
                (logits.float().sum() * 0.0).backward()
        with torch.no_grad():
            for _ in range(passes - 1):
                self.model(input_ids=tokens, position_ids=positions, attention_mask=None)

    def _idle_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """An idle micro-batch's token ids and positions (one token; CP: `parallel.cp_rank`)."""
        one = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        return one, one

    def optim_step(self, adam_params: dict[str, float]) -> dict[str, float]:
        lr = float(adam_params["learning_rate"])
        clip = float(adam_params.get("grad_clip_norm", 0.0))
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            optimizer.config.clip_grad = clip if clip > 0.0 else NO_CLIP
            for group in optimizer.param_groups:
                group.update(
                    lr=lr,
                    betas=(float(adam_params["beta1"]), float(adam_params["beta2"])),
                    eps=float(adam_params["eps"]),
                    weight_decay=float(adam_params["weight_decay"]),
                )
        self._finish_grads()
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer step skipped (non-finite gradients)")
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.steps += 1
        return {"grad_norm:mean": float(grad_norm or 0.0), "learning_rate:mean": lr}

    def _finish_grads(self) -> None:
        """Gradient reductions before the step (PP: Megatron's finalize_model_grads)."""
        self.model.finish_grad_sync()

    # -- weights ---------------------------------------------------------------------------------

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Current weights in HF names, on the engine's device (views where the layout allows);
        LoRA runs: merged with the adapter (merged entries fp32, as the `torch` engine's)."""
        params = {n: p.detach() for n, p in self._params_by_hf_layout().items()}
        hf = self._to_hf(params)
        return self.lora.merge(hf) if self.lora else hf

    def adapter(self) -> LoraAdapter:
        if self.lora is None:
            raise ValueError("adapter(): this model trains the full weights (LoRA rank 0)")
        return self.lora.adapter()

    def sampler_weights(self) -> dict[str, np.ndarray]:
        # numpy has no bfloat16: the object-store path carries float32 (exact for bf16 values).
        return {k: v.float().cpu().numpy() for k, v in self.hf_weights().items()}

    # -- checkpoint: one HF weights file (or PEFT adapter), one optimizer file per rank ------------
    # Shared by every rank class of a group (TP, PP, CP, LoRA-TP): `hf_weights` / `lora.save` are
    # collectives there and group rank 0 writes the files they return.

    def _layer_spec(self) -> str:
        return "te" if self.te else "local"

    def _layout(self) -> dict[str, int]:
        p = self.parallel
        return {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": p.dp, "ep": p.ep}

    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        if self.lora:
            self.lora.save(directory)  # the base stays the model directory's
        else:
            weights = self.hf_weights()
            if self.global_rank == 0:
                weights = {k: v.contiguous().cpu() for k, v in weights.items()}
                if self.shape.tied:
                    weights.pop("lm_head.weight")
                save_file(weights, str(directory / WEIGHTS_FILE))
        if with_optimizer and self.steps > 0:  # before the first step there is no state to save
            path = directory / optimizer_file(self._layout(), self.global_rank)
            torch.save(self._optimizer_state(), path)
        if self.global_rank == 0:
            state = {"steps": self.steps, **self._layout(), "layer_spec": self._layer_spec()}
            (directory / ENGINE_STATE_FILE).write_text(json.dumps(state))
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()  # every file written before any rank returns

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        state = json.loads((directory / ENGINE_STATE_FILE).read_text())
        steps, layout = int(state["steps"]), self._layout()
        if with_optimizer and steps > 0:  # before anything changes
            check_resumable(directory, state, layout, self._layer_spec())
        if self.lora:
            self.lora.load(directory)  # the full adapter; group ranks copy their parts
        else:
            self._import_hf(load_file(str(directory / WEIGHTS_FILE)))
        megatron_offload.reload_main_params(self.optimizer)  # fp32 main params follow the weights
        self.steps = steps
        if not with_optimizer:
            return
        path = directory / optimizer_file(layout, self.global_rank)
        if path.is_file():
            megatron_offload.load_state(self.optimizer, torch.load(path, weights_only=False))
        elif steps > 0 and any(directory.glob("optimizer*.pt")):
            raise FileNotFoundError(f"{path}: this rank's optimizer state is missing")
        else:  # saved before any step or without optimizer: fresh moments (as the torch engine)
            megatron_offload.load_state(self.optimizer, None)

    def _optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _optimizer_state(self) -> list[dict]:
        """Per (chained) optimizer: AdamW state and fp32 main params (`megatron.offload`)."""
        return megatron_offload.checkpoint_state(self.optimizer)
