"""LoRA for the `megatron` trainer engine: PEFT's adapters on Megatron's fused linears.

Semantics are the `torch` engine's (peft `LoraConfig(r, lora_alpha=32, lora_dropout=0)`), so a LoRA
client behaves the same on both engines:
- targets from `LoraSpec`: q/k/v/o (`train_attn`), gate/up/down (`train_mlp`), lm_head
  (`train_unembed`); scaling alpha / rank with alpha = 32 for every rank;
- A drawn kaiming-uniform (a = √5, peft's default), B = 0, so a new model equals its base;
- adapters are fp32 whatever the model dtype, and the delta `B(A(x)) · scaling` is computed in fp32
  from x cast to fp32 and added to the base output before that is cast back to the model dtype —
  what peft does with its default `autocast_adapter_dtype`.

Layout: every HF target keeps its own A [rank, in] and B [out, rank], so the adapter exports in
PEFT's layout with no conversion. The deltas of targets Megatron fuses go into the fused output
where `megatron_layout` puts their rows: `linear_qkv` per KV group (that group's query heads, its
key head, its value head — `megatron_layout._fuse_qkv` itself places them), `linear_fc1` gate
then up.

Wiring: a forward hook on each base linear adds its delta; the adapters live in a child module
`lora` of that linear. Base parameter names stay as they were (HF mapping, checkpoints and weight
sync unchanged). Every base parameter is frozen; Megatron DDP and `get_megatron_optimizer` both skip
parameters with `requires_grad=False` (checked in megatron-core 0.19: DDP's buffer collection and
`_get_param_groups`), and frozen linears take Megatron's `linear_with_frozen_weight` path, so the
stock DDP + distributed optimizer hold and update the adapters only.

Limits: TP = 1 (sharded adapters would need column-/row-parallel A and B); the local layer spec
(TransformerEngine's fused norm + linear never exposes the normed input the adapter reads, so the
engine builds LoRA runs on the local spec).
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from oneloop.backends.megatron_local.engines.base import LoraAdapter, LoraSpec
from oneloop.backends.megatron_local.engines.megatron_layout import DenseShape, _fuse_qkv
from oneloop.backends.megatron_local.engines.torch_trainer import LORA_ALPHA
from oneloop.errors import CapabilityError

LORA_CHILD = "lora"  # the attribute of a base linear that holds its adapters
PEFT_PREFIX = "base_model.model."  # PEFT's prefix of HF module names in adapter files
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_Fuse = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class _Site:
    """One Megatron linear that LoRA targets and the HF modules whose adapters feed it."""

    megatron: str  # module path inside `decoder.layers.{i}` ("" prefix for the output layer)
    hf: str  # HF module prefix of the targets inside `model.layers.{i}`
    targets: tuple[str, ...]  # HF target modules, in their order in the fused output


_ATTN = (
    _Site("self_attention.linear_qkv", "self_attn", ("q_proj", "k_proj", "v_proj")),
    _Site("self_attention.linear_proj", "self_attn", ("o_proj",)),
)
_MLP = (
    _Site("mlp.linear_fc1", "mlp", ("gate_proj", "up_proj")),
    _Site("mlp.linear_fc2", "mlp", ("down_proj",)),
)


def is_lora_name(name: str) -> bool:
    """Whether a GPTModel parameter name belongs to an adapter (not to the base model)."""
    return f".{LORA_CHILD}." in f".{name}"


def _dims(shape: DenseShape) -> dict[str, tuple[int, int]]:
    """HF target → (in features, out features)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, f = shape.hidden, shape.ffn
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, f),
        "up_proj": (h, f),
        "down_proj": (f, h),
        "lm_head": (h, shape.vocab),
    }


def _fuser(shape: DenseShape, targets: tuple[str, ...]) -> _Fuse:
    """How per-target deltas ([..., out_t] each) become the fused linear's output [..., out]."""
    if targets == ("q_proj", "k_proj", "v_proj"):
        # _fuse_qkv interleaves along dim 0: move the feature dim there and back.
        return lambda d: _fuse_qkv(shape, *(t.movedim(-1, 0) for t in d)).movedim(0, -1)
    if len(targets) > 1:
        return lambda d: torch.cat(d, dim=-1)
    return lambda d: d[0]


class LoraDelta(nn.Module):
    """The adapters of one base linear: per HF target A [rank, in] and B [out, rank] (fp32)."""

    def __init__(
        self,
        dims: dict[str, tuple[int, int]],
        rank: int,
        fuse: _Fuse,
        generator: torch.Generator,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.scaling = LORA_ALPHA / rank
        self.fuse = fuse
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for target, (fan_in, fan_out) in dims.items():
            a = torch.empty(rank, fan_in, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            self.lora_A[target] = nn.Parameter(a.to(device))
            self.lora_B[target] = nn.Parameter(torch.zeros(fan_out, rank, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        deltas = [
            F.linear(F.linear(x, self.lora_A[t]), self.lora_B[t]) * self.scaling
            for t in self.lora_A
        ]
        return self.fuse(deltas)

    def delta_weight(self, target: str) -> torch.Tensor:
        """`scaling · B @ A` of one target ([out, in], fp32), as peft's `get_delta_weight`."""
        return (self.lora_B[target] @ self.lora_A[target]) * self.scaling


def _add_delta(linear: nn.Module, args: tuple, output: tuple) -> tuple:
    """Forward hook: Megatron linears return (output, bias); the delta joins the output."""
    out, bias = output
    return (out.float() + getattr(linear, LORA_CHILD)(args[0])).to(out.dtype), bias


class MegatronLora:
    """The adapters injected into one GPTModel (`inject`): export, import, merge, files."""

    def __init__(
        self, spec: LoraSpec, base_model_path: str, by_hf: dict[str, tuple[LoraDelta, str]]
    ) -> None:
        self.spec = spec
        self.base_model_path = base_model_path
        self.by_hf = by_hf  # HF module name ("model.layers.0.self_attn.q_proj") → (delta, target)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted({target for _, target in self.by_hf.values()}))

    def adapter(self) -> LoraAdapter:
        tensors: dict[str, np.ndarray] = {}
        for name, (delta, target) in self.by_hf.items():
            for part, params in (("lora_A", delta.lora_A), ("lora_B", delta.lora_B)):
                value = params[target].detach().float().cpu().numpy().copy()
                tensors[f"{PEFT_PREFIX}{name}.{part}.weight"] = value
        return LoraAdapter(self.spec.rank, LORA_ALPHA, self.target_modules, tensors)

    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Copy `adapter`'s A and B into the model (same rank, alpha and targets, PEFT names)."""
        if (adapter.rank, adapter.alpha) != (self.spec.rank, LORA_ALPHA):
            raise ValueError(
                f"adapter rank/alpha {adapter.rank}/{adapter.alpha}: this model trains "
                f"rank {self.spec.rank} with alpha {LORA_ALPHA}"
            )
        expected = set(self.adapter().tensors)
        if set(adapter.tensors) != expected:
            missing, extra = (
                sorted(expected - set(adapter.tensors)),
                sorted(set(adapter.tensors) - expected),
            )
            raise ValueError(f"adapter tensors differ: missing {missing[:3]}, extra {extra[:3]}")
        with torch.no_grad():
            for name, (delta, target) in self.by_hf.items():
                for part, params in (("lora_A", delta.lora_A), ("lora_B", delta.lora_B)):
                    value = adapter.tensors[f"{PEFT_PREFIX}{name}.{part}.weight"]
                    param = params[target]
                    if tuple(value.shape) != tuple(param.shape):
                        raise ValueError(
                            f"{name}.{part}: adapter has {tuple(value.shape)}, "
                            f"model has {tuple(param.shape)}"
                        )
                    param.copy_(torch.from_numpy(np.asarray(value, np.float32)))

    def merge(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF base weights → LoRA-merged weights: `W + scaling · B @ A` on every target (fp32 there,
        as peft's merge of a bf16 base with fp32 adapters); other entries unchanged."""
        merged = dict(hf)
        with torch.no_grad():
            for name, (delta, target) in self.by_hf.items():
                key = f"{name}.weight"
                merged[key] = hf[key] + delta.delta_weight(target).to(hf[key].device)
        return merged

    def save(self, directory: Path) -> None:
        """Write the adapter as a PEFT adapter directory (loadable by peft and vLLM)."""
        self.adapter().write_peft(directory, self.base_model_path)

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote."""
        config_file = directory / ADAPTER_CONFIG
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file}: a LoRA checkpoint needs its adapter config")
        config = json.loads(config_file.read_text())
        tensors = load_file(str(directory / ADAPTER_WEIGHTS))
        self.load_adapter(
            LoraAdapter(
                rank=int(config["r"]),
                alpha=int(config["lora_alpha"]),
                target_modules=tuple(config["target_modules"]),
                tensors={k: v.float().numpy() for k, v in tensors.items()},
            )
        )


def inject(
    module: nn.Module, shape: DenseShape, spec: LoraSpec, *, tp: int, base_model_path: str
) -> MegatronLora:
    """Freeze `module` (a GPTModel) and add `spec`'s adapters; deterministic in `spec.seed`."""
    if tp != 1:
        raise CapabilityError(
            f"LoRA rank {spec.rank} with local.megatron tp={tp}: the megatron engine's adapters "
            "are not tensor-parallel yet; use tp=1 or local.trainer_engine=torch for LoRA"
        )
    sites = (_ATTN if spec.train_attn else ()) + (_MLP if spec.train_mlp else ())
    if not sites and not spec.train_unembed:
        raise ValueError("LoRA needs at least one of train_mlp, train_attn, train_unembed")
    for param in module.parameters():
        param.requires_grad_(False)
    generator = torch.Generator().manual_seed(spec.seed or 0)
    device = next(module.parameters()).device
    dims = _dims(shape)
    by_hf: dict[str, tuple[LoraDelta, str]] = {}

    def attach(linear: nn.Module, hf_prefix: str, targets: tuple[str, ...]) -> None:
        delta = LoraDelta(
            {t: dims[t] for t in targets}, spec.rank, _fuser(shape, targets), generator, device
        )
        linear.add_module(LORA_CHILD, delta)
        linear.register_forward_hook(_add_delta)
        for target in targets:
            by_hf[f"{hf_prefix}{target}"] = (delta, target)

    for i in range(shape.layers):
        for site in sites:
            linear = module.get_submodule(f"decoder.layers.{i}.{site.megatron}")
            attach(linear, f"model.layers.{i}.{site.hf}.", site.targets)
    if spec.train_unembed:
        attach(module.get_submodule("output_layer"), "", ("lm_head",))
    return MegatronLora(spec, base_model_path, by_hf)
