"""Speed settings of the `megatron` trainer engine when TransformerEngine is absent (local spec).

Each field is one measured speed-up (benchmarks/gpu_mfu.py turns them on one at a time and all
together, side by side on the device); all default on because each is exact up to bf16 rounding:

- `fused_logprobs`: target logprobs from the final hidden states through `fused_logprobs`
  (megatron-core's `output_processor` hook) instead of `[b, s, vocab]` logits, their fp32 copy and
  autograd's log-softmax temporaries. Frees ~5 GB per 8k tokens at a 152k vocab, so
  `max_tokens_per_microbatch` can grow, and cuts the per-logit memory traffic ~10×
  (`compile_logprobs`: the per-chunk math as two Inductor kernels; off = eager torch).
- `bf16_norms`: RMSNorm weights in the model dtype. The local spec builds `torch.nn.RMSNorm` in
  fp32, and a bf16 input with an fp32 weight cannot take torch's fused RMSNorm kernel (a warning
  every step; ~10 unfused kernels forward and backward per norm, 4 norms a layer). The optimizer
  keeps fp32 main copies of bf16 weights, as for every other weight.
- `swiglu_fusion`: megatron-core's `bias_activation_fusion` (SiLU(x1)·x2 forward and backward as
  torch.compile kernels, `megatron.core.fusions.fused_bias_swiglu`; needs no TE or APEX).
- `fused_adam`: megatron-core falls back to `torch.optim.AdamW` without TE/APEX (foreach kernels);
  switch its param groups to torch's single-kernel fused AdamW (same update rule).
- `attention_backend`: torch SDPA backend for the core attention: `auto` (torch's choice; GQA
  native), `flash`, `cudnn` or `efficient` (the last two get K/V expanded to the query heads).

Not available without TE/APEX, so not here: RoPE fusion (TE), gradient-accumulation fusion
(APEX `fused_weight_gradient_mlp_cuda`), TE's fused norm+linear and precision-aware optimizer.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

AttentionBackend = Literal["auto", "flash", "cudnn", "efficient"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "flash", "cudnn", "efficient")


@dataclass(frozen=True)
class MegatronSpeed:
    """Speed switches of the megatron engine (module docstring has the reason for each)."""

    fused_logprobs: bool = True
    compile_logprobs: bool = True
    logprob_chunk_rows: int = 2048  # rows of [rows, vocab] fp32 work per chunk
    bf16_norms: bool = True
    swiglu_fusion: bool = True
    fused_adam: bool = True
    attention_backend: AttentionBackend = "auto"

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend {self.attention_backend!r}: expected one of "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )
        if self.logprob_chunk_rows < 1:
            raise ValueError(f"logprob_chunk_rows must be >= 1, got {self.logprob_chunk_rows}")

    @classmethod
    def off(cls) -> "MegatronSpeed":
        """The engine as first built: every switch off (the benchmark's baseline)."""
        return cls(
            fused_logprobs=False,
            compile_logprobs=False,
            bf16_norms=False,
            swiglu_fusion=False,
            fused_adam=False,
            attention_backend="auto",
        )


def _sdpa_backends(name: str) -> list:
    from torch.nn.attention import SDPBackend

    return {
        "flash": [SDPBackend.FLASH_ATTENTION],
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    }[name]


def sdpa_core_attention(backend: AttentionBackend = "auto"):
    """A drop-in for megatron-core's local DotProductAttention backed by torch SDPA (causal).

    Megatron passes q/k/v as [s, b, heads, d]; SDPA takes [b, heads, s, d] views of them."""
    from megatron.core.transformer.module import MegatronModule

    class SdpaCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
            super().__init__(config=config)
            self.softmax_scale = kwargs.get("softmax_scale")
            self.backend = backend

        def forward(self, query, key, value, attention_mask, **kwargs):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            grouped = k.size(1) != q.size(1)
            if self.backend == "auto":
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=grouped
                )
            else:
                if grouped and self.backend != "flash":  # cuDNN / efficient: no native GQA
                    repeat = q.size(1) // k.size(1)
                    k = k.repeat_interleave(repeat, dim=1)
                    v = v.repeat_interleave(repeat, dim=1)
                    grouped = False
                with torch.nn.attention.sdpa_kernel(_sdpa_backends(self.backend)):
                    out = F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=grouped
                    )
            return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)

    return SdpaCoreAttention


def cast_norms(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Cast every torch norm (RMSNorm / LayerNorm) in `module` to `dtype`; returns how many."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, torch.nn.RMSNorm | torch.nn.LayerNorm):
            sub.to(dtype)
            count += 1
    return count


def use_fused_adam(optimizer) -> int:
    """Switch the torch AdamW/Adam inside a megatron-core optimizer (chained or not) to torch's
    fused implementation; returns how many param groups were switched (0: not torch's Adam, e.g.
    TE/APEX FusedAdam, already fused)."""
    switched = 0
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            params = group["params"]
            if params and all(p.is_cuda and p.dtype.is_floating_point for p in params):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


def fused_logprobs_applies(speed: MegatronSpeed, module: torch.nn.Module, tp: int) -> bool:
    """Whether target logprobs may bypass the output layer's forward: TP size 1 (full vocabulary
    on this rank) and no forward hook on `output_layer` (a LoRA adapter on the unembedding adds
    its delta through one; megatron_lora)."""
    output_layer = getattr(module, "output_layer", None)
    return (
        speed.fused_logprobs
        and tp == 1
        and output_layer is not None
        and not output_layer._forward_hooks
    )


def logprobs_processor(speed: MegatronSpeed, targets: torch.Tensor, device: torch.device):
    """The GPTModel `output_processor` returning target logprobs [b, s] (fused_logprobs); the
    per-chunk kernels are compiled on CUDA only (CPU runs are tests: eager, no compile wait)."""
    from oneloop.backends.megatron_local.engines.fused_logprobs import megatron_logprobs_processor

    return megatron_logprobs_processor(
        targets,
        chunk_rows=speed.logprob_chunk_rows,
        compiled=speed.compile_logprobs and device.type == "cuda",
    )
