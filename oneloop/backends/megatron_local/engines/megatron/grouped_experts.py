"""MoE experts as two stacked weights run by torch's grouped GEMM: the megatron engine's MoE speed
switch `grouped_experts` (`megatron.speed`), for the local spec.

megatron-core 0.19 groups its experts' GEMMs only through TransformerEngine (`TEGroupedMLP`);
without TE its local spec runs `SequentialMLP`, one small matmul pair per expert and a host sync
on the token counts per layer. Measured on an H200 with the 4-layer Qwen3-30B-A3B width at seq 4096
(`gpu_mfu.py --shape 30b-a3b-4l`): megatron with SequentialMLP trained 16.6k tokens/s, the torch
engine (transformers' grouped experts) 55.4k. `GroupedExperts` takes SequentialMLP's place in
megatron-core's `MoELayer` (same call: the dispatcher's tokens sorted by local expert, the count per
expert, the routing probabilities) and runs every local expert's SwiGLU MLP as two
`torch._grouped_mm` calls; the probabilities scale the activation before the second GEMM, as
megatron-core's expert MLP does.

Parameters, in the engine's names: `mlp.experts.grouped_fc1` [E, 2·F, H] (expert j's gate rows
then up rows: SequentialMLP's `local_experts.{j}.linear_fc1.weight` stacked) and
`mlp.experts.grouped_fc2` [E, H, F] (`linear_fc2` stacked); `stack` / `unstack` convert between
the two naming schemes, so the HF mapping (`megatron.moe`) stays per expert. Both are expert
parameters (`allreduce = False`): Megatron's DDP reduces their gradients over the
expert-data-parallel group and the optimizer keeps them in its expert group, as SequentialMLP's.
"""

import functools
import re
from dataclasses import replace

import torch
import torch.nn.functional as F

FC1, FC2 = "grouped_fc1", "grouped_fc2"
_LOCAL = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_GROUPED = re.compile(rf"^(.*\.mlp\.experts)\.({FC1}|{FC2})$")


def experts_class():
    """The `GroupedExperts` module class (defined on call: megatron-core is imported lazily)."""
    from megatron.core.transformer.module import MegatronModule

    class GroupedExperts(MegatronModule):
        """See the module docstring."""

        def __init__(self, num_local_experts, config, submodules=None, pg_collection=None,
                     name=None):  # fmt: skip
            super().__init__(config=config)
            experts, hidden, ffn = num_local_experts, config.hidden_size, config.moe_ffn_hidden_size
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            kwargs = {"dtype": config.params_dtype, "device": device}
            self.grouped_fc1 = torch.nn.Parameter(torch.empty(experts, 2 * ffn, hidden, **kwargs))
            self.grouped_fc2 = torch.nn.Parameter(torch.empty(experts, hidden, ffn, **kwargs))
            for param in (self.grouped_fc1, self.grouped_fc2):
                torch.nn.init.normal_(param, std=config.init_method_std)  # overwritten on import
                param.allreduce = False  # an expert parameter (Megatron's DDP and optimizer)

        def forward(self, tokens, tokens_per_expert, probs):
            if tokens.shape[0] == 0:  # no token routed here: zero output, weights still in graph
                anchor = (self.grouped_fc1.sum() + self.grouped_fc2.sum()) * 0.0
                return tokens.new_zeros((0, self.grouped_fc2.shape[1])) + anchor, None
            counts = torch.as_tensor(tokens_per_expert, device=tokens.device)
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            hidden = torch._grouped_mm(tokens, self.grouped_fc1.transpose(1, 2), offs=offsets)
            if self.config.bias_activation_fusion:  # speed.swiglu_fusion: compiled kernels
                from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

                act = weighted_bias_swiglu_impl(hidden, None, probs.unsqueeze(-1))
            else:
                gate, up = hidden.chunk(2, dim=-1)
                act = (F.silu(gate) * up * probs.unsqueeze(-1)).to(tokens.dtype)
            return torch._grouped_mm(act, self.grouped_fc2.transpose(1, 2), offs=offsets), None

    return GroupedExperts


def use_grouped_experts(spec) -> None:
    """Swap SequentialMLP for `GroupedExperts` in a local GPT layer spec built with experts."""
    spec.submodules.mlp = with_grouped_experts(spec.submodules.mlp)


def with_grouped_experts(mlp):
    """A megatron-core MoE module spec (`partial(MoELayer, submodules=...)`) with
    `GroupedExperts` as its experts."""
    submodules = mlp.keywords["submodules"]
    return functools.partial(
        mlp.func,
        *mlp.args,
        **{**mlp.keywords, "submodules": replace(submodules, experts=experts_class())},
    )


def stack(mega: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert names (`...mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`) → the grouped
    module's two stacked weights per layer; every other name as it is."""
    parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in mega.items():
        match = _LOCAL.match(name)
        if match is None:
            out[name] = tensor
            continue
        head, index, fc = match.group(1), int(match.group(2)), match.group(3)
        parts.setdefault((head, FC1 if fc == "1" else FC2), {})[index] = tensor
    for (head, which), by_index in parts.items():
        out[f"{head}.{which}"] = torch.stack([by_index[j] for j in range(len(by_index))])
    return out


def unstack(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `stack` (views of the stacked weights)."""
    out = {}
    for name, tensor in params.items():
        match = _GROUPED.match(name)
        if match is None:
            out[name] = tensor
            continue
        fc = "1" if match.group(2) == FC1 else "2"
        for j in range(tensor.shape[0]):
            out[f"{match.group(1)}.local_experts.{j}.linear_fc{fc}.weight"] = tensor[j]
    return out
