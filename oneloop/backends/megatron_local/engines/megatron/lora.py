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
where `megatron.layout` puts their rows: `linear_qkv` per KV group (that group's query heads, its
key head, its value head — `megatron.layout.fuse_qkv` itself places them), `linear_fc1` gate
then up.

Wiring: a forward hook on each base linear adds its delta; the adapters live in a child module
`lora` of that linear. Base parameter names stay as they were (HF mapping, checkpoints and weight
sync unchanged). Every base parameter is frozen; Megatron DDP and `get_megatron_optimizer` both skip
parameters with `requires_grad=False` (checked in megatron-core 0.19: DDP's buffer collection and
`_get_param_groups`), and frozen linears take Megatron's `linear_with_frozen_weight` path, so the
stock DDP + distributed optimizer hold and update the adapters only.

Tensor parallelism (TP > 1): each rank holds the adapter parts matching its base shard
(`parallel.lora_shard`): column-parallel bases (qkv, fc1, output layer) get A replicated and B
split along the output; row-parallel ones (linear_proj, fc2) get A split along the input and B
replicated. The rank-sized hidden state h = A·x is where the ranks meet, so no extra gradient
sync is needed afterwards:
- column: h goes through Megatron's `copy_to_tensor_model_parallel_region` (identity forward,
  all-reduce backward), so dh — and with it A's gradient and the LoRA path's input gradient — is
  the full sum over the ranks' output blocks, identical on every rank;
- row: h goes through `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity
  backward): the full h on every rank, the delta replicated like the base's reduced output, B's
  gradient full on every rank, A's the rank's own columns.
Split parameters carry Megatron's `tensor_model_parallel` attributes, so its grad norm counts them
once per rank and the replicated ones once (TP rank 0). Megatron's `finalize_model_grads` would
leave the replicated adapters alone too (it TP-sums only QK-norm, sequence-parallel and
`average_gradients_across_tp_domain` parameters), which is right: their gradients are complete
(checked against TP = 1 by tests/backends/engines/megatron_cpu/test_megatron_lora_tp_gloo.py).
Export (`adapter`, `merge`, `save`) all-gathers the split parts: a collective every rank must call;
every rank gets full tensors and only rank 0 writes files. The init draws the full A on every
rank and keeps the rank's part, so TP = 1 and TP > 1 start from the same adapter for the same
seed.

Limits: the local layer spec (TransformerEngine's fused norm + linear never exposes the normed
input the adapter reads, so the engine builds LoRA runs on the local spec); no sequence
parallelism (the engine does not enable it).
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from oneloop.backends.megatron_local.engines.base import LoraAdapter, LoraSpec
from oneloop.backends.megatron_local.engines.megatron.layout import DenseShape, fuse_qkv
from oneloop.backends.megatron_local.engines.megatron.parallel import lora_shard as lshard
from oneloop.backends.megatron_local.engines.microbatch import LORA_ALPHA

LORA_CHILD = "lora"  # the attribute of a base linear that holds its adapters
PEFT_PREFIX = "base_model.model."  # PEFT's prefix of HF module names in adapter files
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_Fuse = Callable[[list[torch.Tensor]], torch.Tensor]
_PARTS = (lshard.LORA_A, lshard.LORA_B)


@dataclass(frozen=True)
class LoraTp:
    """This rank's place in the tensor-parallel group (size 1: no tensor parallelism)."""

    size: int = 1
    rank: int = 0
    group: Any = None  # the TP process group (torch.distributed), None at size 1


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


def target_dims(shape: DenseShape) -> dict[str, tuple[int, int]]:
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


def delta_fuser(shape: DenseShape, targets: tuple[str, ...]) -> _Fuse:
    """How per-target deltas ([..., out_t] each) become the fused linear's output [..., out]
    (at TP > 1 pass `parallel.lora_shard.local_shape`: the rank's heads and KV groups)."""
    if targets == ("q_proj", "k_proj", "v_proj"):
        # fuse_qkv interleaves along dim 0: move the feature dim there and back.
        return lambda d: fuse_qkv(shape, *(t.movedim(-1, 0) for t in d)).movedim(0, -1)
    if len(targets) > 1:
        return lambda d: torch.cat(d, dim=-1)
    return lambda d: d[0]


def _join_ranks(hidden: list[torch.Tensor], row: bool, tp: LoraTp) -> list[torch.Tensor]:
    """Where the TP ranks meet: the rank-sized hidden states h = A·x (module docstring)."""
    if tp.size == 1:
        return hidden
    from megatron.core.tensor_parallel import mappings

    join = (
        mappings.reduce_from_tensor_model_parallel_region
        if row
        else mappings.copy_to_tensor_model_parallel_region
    )
    joined = join(torch.cat(hidden, dim=-1), group=tp.group)  # one collective for all targets
    return list(torch.split(joined, [h.shape[-1] for h in hidden], dim=-1))


class LoraDelta(nn.Module):
    """The adapters of one base linear: per HF target A [rank, in] and B [out, rank] (fp32), or
    at TP > 1 this rank's parts of them (`parallel.lora_shard`)."""

    def __init__(
        self,
        dims: dict[str, tuple[int, int]],
        rank: int,
        fuse: _Fuse,
        generator: torch.Generator,
        device: torch.device,
        tp: LoraTp | None = None,
    ) -> None:
        super().__init__()
        self.scaling = LORA_ALPHA / rank
        self.fuse = fuse
        self.tp = tp or LoraTp()
        self.row = any(lshard.is_row_parallel(t) for t in dims)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for target, (fan_in, fan_out) in dims.items():
            a = torch.empty(rank, fan_in, dtype=torch.float32)  # full A on every rank: same init
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            b = torch.zeros(fan_out, rank)
            for part, full, params in (
                (lshard.LORA_A, a, self.lora_A),
                (lshard.LORA_B, b, self.lora_B),
            ):
                local = lshard.shard_part(target, part, full, self.tp.size, self.tp.rank)
                param = nn.Parameter(local.contiguous().to(device))
                dim = lshard.split_dim(target, part)
                if self.tp.size > 1 and dim is not None:  # Megatron's marks of a split param
                    param.tensor_model_parallel = True
                    param.partition_dim = dim
                    param.partition_stride = 1
                params[target] = param

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        hidden = _join_ranks([F.linear(x, self.lora_A[t]) for t in self.lora_A], self.row, self.tp)
        deltas = [
            F.linear(h, self.lora_B[t]) * self.scaling
            for h, t in zip(hidden, self.lora_A, strict=True)
        ]
        return self.fuse(deltas)

    def full(self, target: str, part: str) -> torch.Tensor:
        """The full A or B of `target` (all-gathered at TP > 1: every rank must call it)."""
        local = (self.lora_A if part == lshard.LORA_A else self.lora_B)[target].detach()
        if self.tp.size == 1 or lshard.split_dim(target, part) is None:
            return local
        shards = [torch.empty_like(local) for _ in range(self.tp.size)]
        torch.distributed.all_gather(shards, local.contiguous(), group=self.tp.group)
        return lshard.gather_part(target, part, shards)


def _add_delta(linear: nn.Module, args: tuple, output: tuple) -> tuple:
    """Forward hook: Megatron linears return (output, bias); the delta joins the output."""
    out, bias = output
    return (out.float() + getattr(linear, LORA_CHILD)(args[0])).to(out.dtype), bias


class MegatronLora:
    """The adapters injected into one GPTModel (`inject`): export, import, merge, files.

    At TP > 1 `adapter`, `merge` and `save` are collectives (every rank calls them in the same
    order); every rank gets the full tensors, only rank 0 writes files."""

    def __init__(
        self,
        spec: LoraSpec,
        base_model_path: str,
        by_hf: dict[str, tuple[LoraDelta, str]],
        tp: LoraTp | None = None,
    ) -> None:
        self.spec = spec
        self.base_model_path = base_model_path
        self.by_hf = by_hf  # HF module name ("model.layers.0.self_attn.q_proj") → (delta, target)
        self.tp = tp or LoraTp()

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted({target for _, target in self.by_hf.values()}))

    def _full_tensors(self) -> dict[str, torch.Tensor]:
        """PEFT name → full fp32 tensor (a collective at TP > 1)."""
        return {
            f"{PEFT_PREFIX}{name}.{part}.weight": delta.full(target, part).float()
            for name, (delta, target) in self.by_hf.items()
            for part in _PARTS
        }

    def adapter(self) -> LoraAdapter:
        tensors = {k: v.cpu().numpy().copy() for k, v in self._full_tensors().items()}
        return LoraAdapter(self.spec.rank, LORA_ALPHA, self.target_modules, tensors)

    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Copy `adapter`'s A and B (full tensors, PEFT names; same rank, alpha and targets) into
        the model: at TP > 1 each rank copies its part."""
        if (adapter.rank, adapter.alpha) != (self.spec.rank, LORA_ALPHA):
            raise ValueError(
                f"adapter rank/alpha {adapter.rank}/{adapter.alpha}: this model trains "
                f"rank {self.spec.rank} with alpha {LORA_ALPHA}"
            )
        expected = {f"{PEFT_PREFIX}{name}.{part}.weight" for name in self.by_hf for part in _PARTS}
        if set(adapter.tensors) != expected:
            missing, extra = (
                sorted(expected - set(adapter.tensors)),
                sorted(set(adapter.tensors) - expected),
            )
            raise ValueError(f"adapter tensors differ: missing {missing[:3]}, extra {extra[:3]}")
        size, rank = self.tp.size, self.tp.rank
        with torch.no_grad():
            for name, (delta, target) in self.by_hf.items():
                for part, params in ((lshard.LORA_A, delta.lora_A), (lshard.LORA_B, delta.lora_B)):
                    value = torch.from_numpy(
                        np.asarray(
                            adapter.tensors[f"{PEFT_PREFIX}{name}.{part}.weight"], np.float32
                        )
                    )
                    param = params[target]
                    model_shape = lshard.full_shape(target, part, tuple(param.shape), size)
                    if tuple(value.shape) != model_shape:
                        raise ValueError(
                            f"{name}.{part}: adapter has {tuple(value.shape)}, "
                            f"model has {model_shape}"
                        )
                    param.copy_(lshard.shard_part(target, part, value, size, rank))

    def merge(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF base weights → LoRA-merged weights: `W + scaling · B @ A` on every target (fp32 there,
        as peft's merge of a bf16 base with fp32 adapters); other entries unchanged. At TP > 1 a
        collective; ranks that hold no HF weights (`hf` empty) get an empty dict."""
        full = self._full_tensors()
        merged = dict(hf)
        scaling = LORA_ALPHA / self.spec.rank
        with torch.no_grad():
            for name in self.by_hf:
                key = f"{name}.weight"
                if key not in hf:
                    continue
                a = full[f"{PEFT_PREFIX}{name}.{lshard.LORA_A}.weight"]
                b = full[f"{PEFT_PREFIX}{name}.{lshard.LORA_B}.weight"]
                merged[key] = hf[key] + ((b @ a) * scaling).to(hf[key].device)
        return merged

    def save(self, directory: Path) -> None:
        """Write the adapter as a PEFT adapter directory (loadable by peft and vLLM); at TP > 1
        every rank calls it and rank 0 writes."""
        adapter = self.adapter()
        if self.tp.rank == 0:
            adapter.write_peft(directory, self.base_model_path)

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (a full PEFT adapter: loads at any TP size)."""
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


def _tp_of(tp: int) -> LoraTp:
    if tp == 1:
        return LoraTp()
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() != tp:
        raise RuntimeError(
            f"LoRA at tp={tp}: Megatron's parallel state has TP size "
            f"{parallel_state.get_tensor_model_parallel_world_size()}"
        )
    return LoraTp(
        tp,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def inject(
    module: nn.Module, shape: DenseShape, spec: LoraSpec, *, tp: int, base_model_path: str
) -> MegatronLora:
    """Freeze `module` (a GPTModel, this rank's TP shard) and add `spec`'s adapters (this rank's
    parts at TP > 1: Megatron's parallel state must be initialised); deterministic in
    `spec.seed` and the same full adapter at every TP size."""
    sites = (_ATTN if spec.train_attn else ()) + (_MLP if spec.train_mlp else ())
    if not sites and not spec.train_unembed:
        raise ValueError("LoRA needs at least one of train_mlp, train_attn, train_unembed")
    rank_tp = _tp_of(tp)
    for param in module.parameters():
        param.requires_grad_(False)
    generator = torch.Generator().manual_seed(spec.seed or 0)
    device = next(module.parameters()).device
    dims = target_dims(shape)
    local = lshard.local_shape(shape, tp)
    by_hf: dict[str, tuple[LoraDelta, str]] = {}

    def attach(linear: nn.Module, hf_prefix: str, targets: tuple[str, ...]) -> None:
        delta = LoraDelta(
            {t: dims[t] for t in targets},
            spec.rank,
            delta_fuser(local, targets),
            generator,
            device,
            rank_tp,
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
    return MegatronLora(spec, base_model_path, by_hf, rank_tp)
