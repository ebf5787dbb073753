"""What the two torch engines share: loading a Hugging Face causal LM and scoring tokens.

Both engines compute token logprobs through `token_logprobs`, so the trainer-vs-sampler gap on CPU
in fp32 is only the difference between a full forward and an incremental (KV-cached) one.
"""

import inspect
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def set_threads(threads: int | None) -> None:
    """Pin torch's intra-op threads (None leaves torch's default)."""
    if threads is not None:
        torch.set_num_threads(threads)


def load_causal_lm(path: Path, dtype: str) -> PreTrainedModel:
    """Load a local HF causal LM directory with eager-free SDPA attention, in `dtype`."""
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES[dtype], attn_implementation="sdpa"
    )
    return model


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) under `logits` ([..., V]); computed in fp32 whatever the model dtype."""
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint-named MoE weights (`...mlp.experts.{j}.gate_proj.weight`, as on disk and as the
    megatron engine exports them) → transformers' module layout (`...mlp.experts.gate_up_proj`
    [E, 2F, H]: expert j's gate rows then up rows; `...mlp.experts.down_proj` [E, H, F]), torch
    tensors or numpy arrays alike; every other name as it is. No per-expert name: `weights`."""
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    out: dict[str, Any] = {}
    for name, value in weights.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = value
            continue
        head, index, proj = match.group(1), int(match.group(2)), match.group(3)
        experts.setdefault(head, {}).setdefault(index, {})[proj] = value
    if not experts:
        return weights
    for head, by_index in experts.items():
        order = [by_index[j] for j in range(len(by_index))]
        lib = torch if isinstance(order[0]["gate_proj"], torch.Tensor) else np
        out[f"{head}.gate_up_proj"] = lib.stack(
            [lib.concatenate([e["gate_proj"], e["up_proj"]]) for e in order]
        )
        out[f"{head}.down_proj"] = lib.stack([e["down_proj"] for e in order])
    return out


def split_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `fuse_experts`: a checkpoint that stores each layer's experts fused
    (`...mlp.experts.gate_up_proj` [E, 2F, H], `...mlp.experts.down_proj` [E, H, F]) → per-expert
    checkpoint names; every other name as it is. No fused expert tensor: `weights`."""
    fused = [n for n in weights if n.endswith(".mlp.experts.gate_up_proj")]
    if not fused:
        return weights
    out = dict(weights)
    for name in fused:
        head = name[: -len(".gate_up_proj")]
        gate_up, down = out.pop(name), out.pop(f"{head}.down_proj")
        if gate_up.dim() != 3 or down.shape[:2] != (gate_up.shape[0], gate_up.shape[2]):
            raise ValueError(f"{name}: expected [experts, 2·ffn, hidden] with {head}.down_proj "
                             f"[experts, hidden, ffn]; got {tuple(gate_up.shape)} and "
                             f"{tuple(down.shape)}")  # fmt: skip
        for j in range(gate_up.shape[0]):
            gate, up = gate_up[j].chunk(2)
            out[f"{head}.{j}.gate_proj.weight"] = gate
            out[f"{head}.{j}.up_proj.weight"] = up
            out[f"{head}.{j}.down_proj.weight"] = down[j]
    return out


def untie_embeddings(model: PreTrainedModel) -> PreTrainedModel:
    """Give `lm_head` its own copy of tied input embeddings.

    A sampler must: LoRA on the unembedding (Tinker's `train_unembed`) merges into `lm_head` only,
    so after a sync the two matrices differ even when the base model ties them.
    """
    if getattr(model.config, "tie_word_embeddings", False):
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
        model.config.tie_word_embeddings = False
    return model


def cache_kwarg(model: PreTrainedModel) -> str:
    """forward()'s keyword for the KV cache: `cache` (transformers >= 5.2x) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
