"""What the two torch engines share: loading a Hugging Face causal LM and scoring tokens.

Both engines compute token logprobs through `token_logprobs`, so the trainer-vs-sampler gap on CPU
in fp32 is only the difference between a full forward and an incremental (KV-cached) one.
"""

import inspect
from pathlib import Path

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
    """The forward() keyword for the KV cache: `cache` (transformers >= 5.2x) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
