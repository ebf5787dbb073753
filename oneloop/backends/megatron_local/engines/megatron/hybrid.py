"""Qwen3.5 / Qwen3.6 hybrids on the megatron engine: Gated DeltaNet (`linear_attention`) and gated
full-attention layers, each followed by a MoE MLP (router, experts, sigmoid-gated shared expert)
or a dense SwiGLU MLP. Weights are mapped by `megatron.moe`.

Why the layers are specified here. megatron-core 0.19 builds these layers only through
TransformerEngine: its hybrid block builder asserts `transformer_impl == "transformer_engine"` and
fuses each GDN input norm into `in_proj`, and `HybridModel` imports TE classes. Its local norm
(`WrappedTorchNorm`) refuses `layernorm_zero_centered_gamma`, which Qwen3.5's norms need. So the
local layer spec is written out per layer:
- `linear_attention`: megatron-core's `GatedDeltaNet` with a column-parallel `in_proj`, a
  row-parallel `out_proj` and `ZeroCenteredRMSNorm` as its output norm;
- `full_attention`: the local GPT spec's self-attention with our SDPA core attention and
  zero-centred q / k norms; the sigmoid output gate comes from `attention_output_gate`;
- the MLP: megatron-core's `MoELayer` (experts as `grouped_experts` or SequentialMLP) or its MLP;
- every norm `ZeroCenteredRMSNorm`: x · rsqrt(mean x² + eps) · (1 + w) in fp32, as transformers'
  `Qwen3_5RMSNorm` computes it.

RoPE is megatron-core's, on the first `partial_rotary_factor` of each head's dimensions
(Qwen3.5's text positions are one row, so its multimodal RoPE reduces to this);
`speed.fused_rope` (full-dimension RoPE inside the SDPA attention) is refused for these models.

Kernels: on GPU the Gated DeltaNet runs flash-linear-attention's Triton kernels (the `gpu` extra),
except on Hopper GPUs with a Triton fla refuses for the backward (`training_kernel`, `gdn_kernels`:
the torch chunked delta rule there). On CPU the engine sets `deterministic_mode`, which selects
megatron-core's torch chunked delta rule and `F.conv1d`; megatron-core still asks fla for its
`l2norm` there, which the CPU checks supply (`tests/.../cpu_megatron.gdn_without_fla`).
`perform_initialization` is off: every weight comes from the checkpoint (GDN's initialiser needs the
CUDA RNG tracker).

Checkpoints: a multimodal Qwen3.5 / 3.6 checkpoint stores its decoder under
`model.language_model.`; `text_weights` reads that (the vision tower and the MTP head stay out of
training; experts stored fused are split per expert) and `checkpoint_weights` writes the trained
weights back under the same names (experts per expert, as transformers saves them).

Pipeline stages (`parallel.pp`): each stage builds its slice of the layer pattern (`block_spec`).
Tensor parallelism (`parallel.tp`, with sequence parallelism): megatron-core's GatedDeltaNet splits
its key / value heads over the TP ranks (in_proj and conv1d by section, `moe.tp_sections`; A_log,
dt_bias by head; out_proj by row), the gated attention its query groups, the shared expert and the
dense MLP their width; the routed experts stay whole (expert TP 1). Limits, refused naming the
field (`moe.check_engine_layout`): cp = 1, no LoRA, no TE spec.
"""

from typing import Any

import torch

from oneloop.backends.megatron_local.engines.hf import split_experts
from oneloop.backends.megatron_local.engines.megatron.moe import (
    HYBRID_MODEL_TYPES,
    HybridShape,
    MoeSettings,
)
from oneloop.errors import CapabilityError

COMPOSITE_PREFIX = "model.language_model."
"""Where a multimodal Qwen3.5 / 3.6 checkpoint keeps its decoder (`model.` in a text-only one)."""
_OUTSIDE_TEXT = ("model.visual.", "mtp.")


def check_speed(fused_rope: bool | str) -> None:
    """CapabilityError unless the speed switches fit the hybrid families (`fused_rope: auto`
    stays off for them)."""
    if fused_rope is True:
        raise CapabilityError(
            "local.megatron.speed.fused_rope=true rotates every dimension of each head; the "
            "Qwen3.5 / 3.6 hybrids rotate a partial_rotary_factor share (megatron-core's RoPE "
            "does that): set fused_rope=false"
        )


def transformer_fields(
    shape: HybridShape | None, moe: MoeSettings, parallel: Any, *, cpu: bool
) -> dict[str, Any]:
    """The `TransformerConfig` fields of a MoE and / or hybrid model's layers besides the
    attention's (none for a dense model, `shape` None); `parallel`: the engine's
    `MegatronParallel`. At tp > 1: sequence parallelism (megatron-core trains MoE layers under TP
    only with it; on a hybrid it also sums the replicated norms' gradients over TP, the Gated
    DeltaNet's output norm included, whose heads are split) and each expert whole on its rank
    (expert TP 1: the experts map as at tp = 1)."""
    out: dict[str, Any] = {}
    if shape is None:
        return out
    if shape.experts:
        out.update(moe.transformer_config_kwargs(shape), expert_model_parallel_size=parallel.ep)
        if parallel.tp > 1:
            out.update(expert_tensor_parallel_size=1)
    if parallel.tp > 1:
        # what megatron-core's SP check reads
        out.update(sequence_parallel=True, tensor_model_parallel_size=parallel.tp)
    if shape.model_type in HYBRID_MODEL_TYPES:
        out.update(_hybrid_fields(shape, cpu))
    return out


def _hybrid_fields(shape: HybridShape, cpu: bool) -> dict[str, Any]:
    return {
        "layernorm_zero_centered_gamma": True,
        "attention_output_gate": True,
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": [int(kind == "linear_attention") for kind in shape.layer_types],
        "linear_conv_kernel_dim": shape.conv_kernel,
        "linear_key_head_dim": shape.linear_k_dim,
        "linear_value_head_dim": shape.linear_v_dim,
        "linear_num_key_heads": shape.linear_k_heads,
        "linear_num_value_heads": shape.linear_v_heads,
        "deterministic_mode": cpu,  # torch delta rule and F.conv1d (no Triton on CPU)
        "perform_initialization": False,  # every weight is the checkpoint's
    }


def _norm_class():
    class ZeroCenteredRMSNorm(torch.nn.Module):
        """RMSNorm with weight 1 + w (w stored) when the config asks for zero-centred gamma."""

        def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_kwargs) -> None:
            super().__init__()
            self.zero_centered = bool(config.layernorm_zero_centered_gamma)
            start = torch.zeros if self.zero_centered else torch.ones
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            self.weight = torch.nn.Parameter(
                start(hidden_size, dtype=config.params_dtype, device=device)
            )
            self.weight.sequence_parallel = config.sequence_parallel
            self.eps = eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            normed = x.float()
            normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
            weight = self.weight.float()
            return (normed * (1.0 + weight if self.zero_centered else weight)).to(x.dtype)

    return ZeroCenteredRMSNorm


def training_kernel(model) -> str | None:
    """On a GPU where flash-linear-attention refuses its gated delta rule backward
    (`gdn_kernels.fla_backward_refusal`), switch every GatedDeltaNet layer to megatron-core's
    torch chunked delta rule; returns "torch" then, else None (fla's kernels)."""
    from oneloop.backends.megatron_local.engines import gdn_kernels

    return gdn_kernels.torch_rule_where_refused(
        lambda: gdn_kernels.use_torch_delta_rule_in_megatron(model), "megatron"
    )


def sequence_parallel_block(layer_spec, layers: int, qk_norm: bool):
    """megatron-core's local GPT layer spec as a block of `layers` layers (a stage's) whose every
    norm (pre-attention, pre-MLP, QK, final) is `ZeroCenteredRMSNorm` (plain RMSNorm when the
    config does not ask zero-centred gamma): megatron-core's torch norm refuses sequence
    parallelism, which MoE layers under TP need."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    norm = _norm_class()
    layer = layer_spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = norm
    if qk_norm:
        attention = layer.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = norm
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=norm)


def block_spec(shape: HybridShape, core_attention, grouped_experts: bool, layers: range | None):
    """megatron-core `TransformerBlockSubmodules`: one local layer spec per `layer_types` entry
    of `layers` (a pipeline stage's; None: every layer). megatron-core builds a block spec's
    layers as given and numbers them from the stage's offset, so the stage's slice is made here."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_mlp_module_spec_for_backend,
    )
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from oneloop.backends.megatron_local.engines.megatron import grouped_experts as grouped

    norm = _norm_class()
    delta_net = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear
        ),
    )
    local = get_gpt_layer_local_spec(num_experts=None, normalization="RMSNorm", qk_layernorm=True)
    attention = local.submodules.self_attention
    attention.submodules.core_attention = core_attention
    attention.submodules.q_layernorm = attention.submodules.k_layernorm = norm
    backend = LocalSpecProvider()
    if shape.experts:
        mlp = get_moe_module_spec_for_backend(
            backend=backend, num_experts=shape.experts, moe_grouped_gemm=False
        )
        if grouped_experts:
            mlp = grouped.with_grouped_experts(mlp)
    else:
        mlp = get_mlp_module_spec_for_backend(backend=backend, num_experts=None)
    layers = [
        ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=norm,
                self_attention=delta_net if kind == "linear_attention" else attention,
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=norm,
                mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        )
        for kind in shape.layer_types[slice(layers.start, layers.stop) if layers else slice(None)]
    ]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm)


def text_weights(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's decoder weights under text-model names (`model.layers.…`), experts per
    expert (`hf.split_experts`, for a checkpoint that stores them fused): a multimodal
    checkpoint's `model.language_model.` becomes `model.`; its vision tower and MTP head are left
    out (they are not trained here)."""
    hf = split_experts(hf)
    if not any(name.startswith(COMPOSITE_PREFIX) for name in hf):
        return hf
    out = {}
    for name, tensor in hf.items():
        if name.startswith(COMPOSITE_PREFIX):
            out["model." + name[len(COMPOSITE_PREFIX) :]] = tensor
        elif not name.startswith(_OUTSIDE_TEXT):
            out[name] = tensor  # lm_head.weight
    return out


def checkpoint_weights(text: dict[str, torch.Tensor], composite: bool) -> dict[str, torch.Tensor]:
    """Inverse of `text_weights` for the trained weights: the checkpoint's own names."""
    if not composite:
        return text
    return {
        (COMPOSITE_PREFIX + name[len("model.") :] if name.startswith("model.") else name): tensor
        for name, tensor in text.items()
    }
