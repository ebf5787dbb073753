"""Speed settings of the `megatron` trainer engine: the layer spec (TransformerEngine's or the local
one) and the local spec's speed switches.

`layer_spec` (`use_te` decides): `te` builds megatron-core's TransformerEngine layer spec (TE's
fused norm + linear, TE attention, TE's fused Adam inside megatron-core), `local` the local spec,
`auto` TE when it is importable and the run allows it (not LoRA: the adapter reads the normed input
TE's fused norm + linear never exposes; not CP: CP runs on our SDPA attention, `parallel.cp`).
`te` where TE cannot be used, and the SDPA-only switches (`attention_backend`, `fused_rope`) on the
TE spec, are refused with the reason.

Each field is one measured speed-up (benchmarks/gpu_mfu.py turns them on one at a time and all
together, side by side on the device); all default on because each is exact up to bf16 rounding:

- `fused_logprobs`: target logprobs from the final hidden states through `fused_logprobs`
  (megatron-core's `output_processor` hook) instead of `[b, s, vocab]` logits, their fp32 copy and
  autograd's log-softmax temporaries. Frees ~5 GB per 8k tokens at a 152k vocab, so
  `max_tokens_per_microbatch` can grow, and cuts the per-logit memory traffic ~10×
  (`compile_logprobs`: the per-chunk math as two Inductor kernels; off = eager torch;
  `triton_logprobs`, opt-in until measured on the device: two hand-written Triton kernels over
  all rows instead, `engines.logprob_kernels`, ~6 bytes of traffic per logit against Inductor's
  ~10 at about 1 TB/s, which took 55 ms of a 641 ms MoE step at 64k tokens).
- `bf16_norms`: RMSNorm weights in the model dtype. The local spec builds `torch.nn.RMSNorm` in
  fp32, and a bf16 input with an fp32 weight cannot take torch's fused RMSNorm kernel (a warning
  every step; ~10 unfused kernels forward and backward per norm, 4 norms a layer). The optimizer
  keeps fp32 main copies of bf16 weights, as for every other weight.
- `swiglu_fusion`: megatron-core's `bias_activation_fusion` (SiLU(x1)·x2 forward and backward as
  torch.compile kernels, `megatron.core.fusions.fused_bias_swiglu`; needs no TE or APEX).
- `fused_adam`: megatron-core falls back to `torch.optim.AdamW` without TE/APEX (foreach kernels);
  switch its param groups to torch's single-kernel fused AdamW (same update rule). Where TE
  imports, megatron-core builds TE's FusedAdam instead (either spec): already fused, nothing to do.
- `attention_backend`: torch SDPA backend for the core attention: `auto` (torch's choice; GQA
  native), `flash`, `cudnn` or `efficient` (the last two get K/V expanded to the query heads).
- `fused_rope`: RoPE applied inside the SDPA core attention as one torch.compile kernel per q
  and k (fp32 math, one rounding) instead of megatron-core's unfused bf16 path (cos/sin per
  layer, rotate-half by `cat`, then `cat` with the empty pass-through part); the GPTModel is then
  built with `position_embedding_type="none"`. Positions are 0..s-1 per row, which is what the
  engine feeds (right padding, no packing). Measured on an H200 (Qwen3 1.7B, seq 4096,
  2026-12-01): 38,086 tok/s against 35,516 with every other switch on (1.07×). `auto` (the
  default) turns it on where it applies: the local spec, RoPE over each head's whole dimension
  (not the Qwen3.5 / 3.6 hybrids' partial rotary), no RoPE scaling (`fused_rope_on`); `true`
  where it does not is refused with the reason.

- `grouped_experts` (MoE models): every local expert's MLP as two `torch._grouped_mm` calls
  (`megatron.grouped_experts`) instead of megatron-core's SequentialMLP loop over experts (its
  grouped GEMM needs TE). With `swiglu_fusion` on, their SiLU(gate)·up·probability runs as
  megatron-core's weighted SwiGLU kernels (`weighted_bias_swiglu_impl`).
- `gather_dispatch` (MoE models): the all-to-all dispatcher's two local permutations as gathers
  in both directions (`megatron.moe_dispatch`) instead of `index_select` + `scatter_add_`, whose
  restore and backward add each token's k copies into bf16 rows with atomics.

Not available without TE/APEX, so not here: RoPE fusion (TE), gradient-accumulation fusion
(APEX `fused_weight_gradient_mlp_cuda`), TE's fused norm+linear and precision-aware optimizer.
"""

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from oneloop.errors import CapabilityError

AttentionBackend = Literal["auto", "flash", "cudnn", "efficient"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "flash", "cudnn", "efficient")
LayerSpec = Literal["auto", "te", "local"]
LAYER_SPECS: tuple[str, ...] = ("auto", "te", "local")
FusedRope = bool | Literal["auto"]


@dataclass(frozen=True)
class MegatronSpeed:
    """Speed switches of the megatron engine (module docstring has the reason for each)."""

    fused_logprobs: bool = True
    compile_logprobs: bool = True
    triton_logprobs: bool = False
    logprob_chunk_rows: int = 2048  # rows of [rows, vocab] fp32 work per chunk
    bf16_norms: bool = True
    swiglu_fusion: bool = True
    fused_adam: bool = True
    attention_backend: AttentionBackend = "auto"
    fused_rope: FusedRope = "auto"
    layer_spec: LayerSpec = "auto"
    grouped_experts: bool = True
    gather_dispatch: bool = True

    def __post_init__(self) -> None:
        if self.layer_spec not in LAYER_SPECS:
            raise ValueError(
                f"layer_spec {self.layer_spec!r}: expected one of {', '.join(LAYER_SPECS)}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend {self.attention_backend!r}: expected one of "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )
        if self.triton_logprobs and not (self.fused_logprobs and self.compile_logprobs):
            raise ValueError(
                "triton_logprobs replaces compile_logprobs' kernels: it needs fused_logprobs and "
                "compile_logprobs on"
            )
        if self.fused_rope not in (True, False, "auto"):
            raise ValueError(f"fused_rope {self.fused_rope!r}: expected true, false or 'auto'")
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
            fused_rope=False,
            layer_spec="local",
            grouped_experts=False,
            gather_dispatch=False,
        )


def use_te(
    speed: MegatronSpeed, *, te_importable: bool, lora_rank: int, cp: int, moe: bool = False
) -> bool:
    """Whether the engine builds TransformerEngine's layer spec (`layer_spec`, module docstring);
    raises `CapabilityError` for what cannot be honoured."""
    if speed.layer_spec == "local":
        return False
    why_not = [
        why
        for why, applies in (
            ("TransformerEngine is not importable here (`import transformer_engine.pytorch`)",
             not te_importable),
            ("LoRA runs on the local spec (the adapter reads the normed input that TE's fused "
             "norm + linear never exposes)", lora_rank > 0),
            ("context parallelism runs on our SDPA attention (parallel.cp)", cp > 1),
            ("MoE and hybrid models run on the local spec (our `megatron.moe` mapping; TE's "
             "grouped-GEMM expert and fused-norm names are not mapped)", moe),
        )
        if applies
    ]  # fmt: skip
    if why_not:
        if speed.layer_spec == "te":
            raise CapabilityError(
                f"local.megatron.speed.layer_spec='te': {why_not[0]}; use 'auto' or 'local'"
            )
        return False
    asked = (("attention_backend", speed.attention_backend != "auto"),
             ("fused_rope", speed.fused_rope is True))  # fmt: skip
    sdpa_only = [name for name, on in asked if on]
    if sdpa_only:
        raise CapabilityError(
            f"local.megatron.speed.{sdpa_only[0]} applies to the local spec's SDPA attention, but "
            f"layer_spec={speed.layer_spec!r} builds the TransformerEngine spec here: set "
            "layer_spec: local to use it, or leave it at its default"
        )
    return True


def fused_rope_on(speed: MegatronSpeed, *, te: bool, hybrid: bool, rotary_percent: float,
                  rope_scaling: float | None) -> bool:  # fmt: skip
    """Whether the SDPA core attention applies RoPE itself: `fused_rope` true or false as set;
    `auto` where it applies (the local spec, not a Gated DeltaNet hybrid, every dimension of
    each head rotated, no scaling). An explicit true where it does not apply is refused
    elsewhere (`use_te`, `check_rope`, `hybrid.check_speed`)."""
    if speed.fused_rope != "auto":
        return bool(speed.fused_rope)
    return not te and not hybrid and rotary_percent == 1.0 and rope_scaling is None


def check_rope(speed: MegatronSpeed, rope_scaling: float | None) -> None:
    """`fused_rope: true` rotates with plain RoPE frequencies: refused (CapabilityError) for a
    model whose config scales them (`layout.rope_scaling_factor`)."""
    if speed.fused_rope is True and rope_scaling is not None:
        raise CapabilityError(
            "local.megatron.speed.fused_rope=true rotates with unscaled RoPE frequencies; this "
            f"model scales them (llama3, factor {rope_scaling}): set fused_rope=false"
        )


def sdpa_backends(name: str) -> list:
    from torch.nn.attention import SDPBackend

    return {
        "flash": [SDPBackend.FLASH_ATTENTION],
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    }[name]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF / megatron-core non-interleaved) of x [s, b, heads, d] in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


_COMPILED_ROPE: list = []


def rope_fn(device: torch.device):
    if device.type != "cuda":
        return _rope
    if not _COMPILED_ROPE:
        _COMPILED_ROPE.append(torch.compile(_rope, dynamic=True))
    return _COMPILED_ROPE[0]


def rope_tables(seq: int, dim: int, theta: float, device: torch.device):
    """cos, sin [seq, 1, 1, dim] (fp32) for positions 0..seq-1, as megatron-core's RotaryEmbedding
    builds them (inv_freq = theta^(-2i/dim), angles duplicated over the two halves)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    return emb.cos(), emb.sin()


def sdpa_core_attention(backend: AttentionBackend = "auto", rope_theta: float | None = None):
    """A drop-in for megatron-core's local DotProductAttention backed by torch SDPA (causal);
    with `rope_theta` it also applies RoPE to q and k first (`fused_rope`).

    Megatron passes q/k/v as [s, b, heads, d]; SDPA takes [b, heads, s, d] views of them."""
    from megatron.core.transformer.module import MegatronModule

    class SdpaCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
            super().__init__(config=config)
            self.softmax_scale = kwargs.get("softmax_scale")
            self.backend = backend
            self.rope_theta = rope_theta
            self._tables: tuple | None = None

        def _rotate(self, query, key):
            seq, dim = query.size(0), query.size(-1)
            if self._tables is None or self._tables[0].size(0) < seq:
                self._tables = rope_tables(seq, dim, float(self.rope_theta), query.device)
            cos, sin = (t[:seq] for t in self._tables)
            rope = rope_fn(query.device)
            return rope(query, cos, sin), rope(key, cos, sin)

        def forward(self, query, key, value, attention_mask, **kwargs):
            if self.rope_theta is not None:
                query, key = self._rotate(query, key)
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
                with torch.nn.attention.sdpa_kernel(sdpa_backends(self.backend)):
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

    kernels = "eager"
    if speed.compile_logprobs and device.type == "cuda":
        kernels = "triton" if speed.triton_logprobs else "inductor"
    return megatron_logprobs_processor(
        targets, chunk_rows=speed.logprob_chunk_rows, kernels=kernels
    )


def recompute_fields(recompute: str) -> dict[str, Any]:
    """`TransformerConfig` fields of `local.megatron.recompute` (memory for compute, not a speed
    switch: `full` recomputes every decoder layer in the backward from its saved input)."""
    if recompute == "none":
        return {}
    if recompute == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    raise ValueError(f"local.megatron.recompute={recompute!r}: expected 'none' or 'full'")
