"""Trainer engine `torch`: a Hugging Face causal LM trained with LoRA (peft) or fully, CPU/GPU.

- LoRA when the client's rank > 0 (peft; alpha = 32 like Tinker's service, dropout 0, B = 0 at
  init so a new model equals its base), full fine-tuning when rank == 0.
- Micro-batches are packed greedily in datum order under a padded-token budget; losses are sums,
  so gradients accumulate exactly across micro-batches and across `forward_backward` calls.
- AdamW is torch's (Tinker documents its Adam as identical to `torch.optim.AdamW`); every
  AdamParams field is applied at every step, including `weight_decay` and `grad_clip_norm`.
- Mixture-of-experts models: a datum with `routing` (R3) is computed with the sampler's experts
  at its recorded positions (`routing.RouterReplay`). Such a micro-batch also reports, summed,
  `routing/positions` and `routing/differ` (position × MoE layer pairs replayed, and those whose
  own expert set differed: routing agreement) and, over positions with a sampler logprob,
  `routing/gap_replay` and `routing/gap_free` (|trainer − sampler| logprob with replay, and from
  one extra no-grad forward without) with their count `routing/gap_tokens`. LoRA on a MoE model
  is refused (its experts are fused parameters peft's module LoRA does not reach).
"""

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from oneloop.backends.megatron_local import losses
from oneloop.backends.megatron_local.engines import gdn_kernels
from oneloop.backends.megatron_local.engines.base import (
    DatumArrays,
    ForwardResult,
    LoraAdapter,
    LoraSpec,
    TrainerEngine,
)
from oneloop.backends.megatron_local.engines.hf import load_causal_lm, set_threads, token_logprobs
from oneloop.backends.megatron_local.engines.microbatch import (
    LORA_ALPHA,
    padded_arrays,
    run_microbatches,
)
from oneloop.backends.megatron_local.engines.torch.routing import (
    RouterReplay,
    check_routing,
    forced_routing,
    moe_routers,
    replay_metrics,
)

_ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Gated DeltaNet (linear attention) projections of the hybrid Qwen3.5 families.
_GDN_MODULES = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
_MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]
WEIGHTS_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
ENGINE_STATE_FILE = "engine.json"


class TorchTrainerEngine(TrainerEngine):
    """See the module docstring."""

    def __init__(
        self,
        model_path: Path,
        lora: LoraSpec,
        *,
        dtype: str = "float32",
        max_tokens_per_microbatch: int = 16384,
        threads: int | None = None,
        device: str = "cpu",
    ) -> None:
        set_threads(threads)
        self.lora = lora
        self.device = torch.device(device)
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        if lora.seed is not None:
            torch.manual_seed(lora.seed)
        model = load_causal_lm(model_path, dtype)
        self.routers = moe_routers(model)
        if lora.rank > 0 and self.routers:
            raise ValueError(
                "lora_rank: LoRA on a mixture-of-experts model is not supported by the torch "
                "engine (its experts are fused parameters); train it fully (lora_rank 0)"
            )
        if lora.rank > 0:
            from peft import LoraConfig, get_peft_model

            names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
            attn = _ATTN_MODULES + [m for m in _GDN_MODULES if m in names]  # hybrids only
            targets = (attn if lora.train_attn else []) + (_MLP_MODULES if lora.train_mlp else [])
            if lora.train_unembed:
                targets.append("lm_head")
            if not targets:
                raise ValueError("LoRA needs at least one of train_mlp, train_attn, train_unembed")
            config = LoraConfig(
                r=lora.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets
            )
            model = get_peft_model(model, config)
        self.model = model.to(self.device)
        text = self.model.config.get_text_config()
        if self.device.type == "cuda" and "linear_attention" in (
            getattr(text, "layer_types", None) or ()
        ):
            gdn_kernels.torch_rule_where_refused(
                gdn_kernels.use_torch_delta_rule_in_transformers, "torch"
            )
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.AdamW | None = None
        self.steps = 0

    # -- training --------------------------------------------------------------------------------

    def forward_backward(
        self,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardResult:
        config = losses.validate_loss_config(loss_fn, loss_fn_config)
        return run_microbatches(
            data,
            self.max_tokens_per_microbatch,
            lambda batch: self._microbatch(batch, loss_fn, config, forward_only),
        )

    def _microbatch(
        self, data: list[DatumArrays], loss_fn: str, config: dict[str, float], forward_only: bool
    ) -> tuple["losses.LossResult", np.ndarray]:
        arrays = padded_arrays(data, max(len(d.tokens) for d in data))
        tokens, targets, mask = (torch.from_numpy(a).to(self.device) for a in arrays[:3])
        inputs = {k: torch.from_numpy(v).to(self.device) for k, v in arrays[3].items()}
        routed = [d.routing for d in data]
        replay = None
        if any(r is not None for r in routed):
            replay = self._replay(data, tokens.shape[1])
        with torch.set_grad_enabled(not forward_only):
            if replay is None:
                logits = self.model(input_ids=tokens, attention_mask=mask.long()).logits
            else:
                with replay:
                    logits = self.model(input_ids=tokens, attention_mask=mask.long()).logits
            target_lp = token_logprobs(logits, targets)
            result = losses.compute_loss(loss_fn, target_lp, inputs, mask, config)
            if not forward_only:
                result.loss.backward()
        if replay is not None:
            metrics = self._replay_metrics(replay, tokens, targets, mask, inputs, target_lp)
            result.metrics.update(metrics)
        return result, target_lp.detach().float().cpu().numpy()

    def _replay(self, data: list[DatumArrays], seq: int) -> RouterReplay:
        """The replay hooks of one micro-batch (checks every datum's routing first)."""
        if not self.routers:
            raise ValueError(
                "routed_experts: routing replay needs a mixture-of-experts model; this model "
                "has no MoE router (set algo.routing_replay: false)"
            )
        layers, k = len(self.routers), int(self.routers[0].top_k)
        experts = int(self.routers[0].num_experts)
        for datum in data:
            if datum.routing is not None:
                check_routing(datum.routing, len(datum.tokens), layers, k, experts)
        return RouterReplay(self.routers, forced_routing([d.routing for d in data], seq, layers, k))

    def _replay_metrics(
        self,
        replay: RouterReplay,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        mask: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        target_lp: torch.Tensor,
    ) -> dict[str, float]:
        """Routing agreement and the gap with / without replay (see the module docstring)."""

        def free() -> torch.Tensor:
            logits = self.model(input_ids=tokens, attention_mask=mask.long()).logits
            return token_logprobs(logits, targets)

        return replay_metrics(replay.forced, replay.natural, inputs, mask, target_lp, free)

    def optim_step(self, adam_params: dict[str, float]) -> dict[str, float]:
        lr = float(adam_params["learning_rate"])
        betas = (float(adam_params["beta1"]), float(adam_params["beta2"]))
        eps = float(adam_params["eps"])
        weight_decay = float(adam_params["weight_decay"])
        clip = float(adam_params.get("grad_clip_norm", 0.0))
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(
                self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
            )
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        grads = [p.grad for p in self.params if p.grad is not None]
        grad_norm = (
            float(
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            )
            if grads
            else 0.0
        )
        if clip > 0.0 and grads:
            torch.nn.utils.clip_grad_norm_(self.params, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": lr}

    # -- weights ---------------------------------------------------------------------------------

    def sampler_weights(self) -> dict[str, np.ndarray]:
        if self.lora.rank == 0:
            return {k: _to_numpy(v) for k, v in self.model.state_dict().items()}
        from peft.tuners.lora import LoraLayer

        base = self.model.get_base_model()
        merged: dict[str, np.ndarray] = {}
        with torch.no_grad():
            for name, module in base.named_modules():
                if isinstance(module, LoraLayer):
                    weight = module.get_base_layer().weight
                    delta = module.get_delta_weight("default")
                    merged[f"{name}.weight"] = _to_numpy(weight + delta)
            for name, tensor in base.state_dict().items():
                if "lora_" in name:
                    continue
                clean = name.replace(".base_layer", "")
                if clean not in merged:
                    merged[clean] = _to_numpy(tensor)
        return merged

    def adapter(self) -> LoraAdapter:
        if self.lora.rank == 0:
            raise ValueError("adapter(): this model trains the full weights (LoRA rank 0)")
        from peft import get_peft_model_state_dict

        # PEFT's saved names (adapter name dropped); the base embedding / lm_head stay out.
        state = get_peft_model_state_dict(self.model, save_embedding_layers=False)
        targets = self.model.peft_config["default"].target_modules
        return LoraAdapter(
            rank=self.lora.rank,
            alpha=LORA_ALPHA,
            target_modules=tuple(sorted(targets)),
            tensors={k: v.detach().float().cpu().numpy().copy() for k, v in state.items()},
        )

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: p.detach().cpu().contiguous() for p in self.params}

    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self._trainable_state(), str(directory / WEIGHTS_FILE))
        if with_optimizer and self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        (directory / ENGINE_STATE_FILE).write_text(json.dumps({"steps": self.steps}))

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        saved = load_file(str(directory / WEIGHTS_FILE))
        by_name = dict(self.model.named_parameters())
        missing = [n for n in saved if n not in by_name]
        if missing:
            raise ValueError(f"checkpoint {directory} has weights this model lacks: {missing[:3]}")
        with torch.no_grad():
            for name, tensor in saved.items():
                by_name[name].copy_(tensor.to(by_name[name].device))
        self.steps = json.loads((directory / ENGINE_STATE_FILE).read_text())["steps"]
        optimizer_file = directory / OPTIMIZER_FILE
        if with_optimizer and optimizer_file.is_file():
            self.optimizer = torch.optim.AdamW(self.params)
            self.optimizer.load_state_dict(torch.load(optimizer_file, weights_only=True))


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU numpy copy; bfloat16 (which numpy lacks) as float32, which holds it exactly."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return tensor.cpu().numpy().copy()
