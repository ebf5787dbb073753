"""Conversions at the `vllm` sampler engine's edge: vLLM outputs → our arrays, Hugging Face
tensors → the reference RPC payload, adapters → `LoRARequest`s. vLLM is imported lazily."""

import numpy as np
import torch

from oneloop.backends.megatron_local.engines.base import SampledArrays
from oneloop.backends.megatron_local.engines.vllm.lora import Adapter
from oneloop.backends.megatron_local.weight_sync.layout import dtype_name
from oneloop.errors import BackendError


def lora_request(adapter: Adapter | None):
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.lora_id, lora_path=adapter.path)


def hf_payload(weights: dict) -> tuple[tuple, int]:
    """Hugging Face tensors → (names, dtype names, shapes, raw bytes) for the reference RPC."""
    names, dtypes, shapes, blobs = [], [], [], []
    nbytes = 0
    for name, value in weights.items():
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        tensor = tensor.detach().to("cpu").contiguous()
        raw = tensor.view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)
        names.append(name)
        dtypes.append(dtype_name(tensor.dtype))
        shapes.append(list(tensor.shape))
        blobs.append(raw.numpy().tobytes())
        nbytes += len(blobs[-1])
    return (names, dtypes, shapes, blobs), nbytes


def _values(logprobs, tokens) -> np.ndarray:
    """Logprob of `tokens[i]` at position i from vLLM's flat or list-of-dict logprobs."""
    tokens = [int(t) for t in tokens]
    flat_ids = getattr(logprobs, "token_ids", None)
    if flat_ids is not None and len(logprobs.logprobs) == len(tokens) and flat_ids == tokens:
        return np.asarray(logprobs.logprobs, dtype=np.float32)  # one entry per position
    out = np.empty(len(tokens), dtype=np.float32)
    for i, token in enumerate(tokens):
        entry = logprobs[i]
        if not entry or token not in entry:
            raise BackendError(f"vllm returned no logprob for token {token} at position {i}")
        out[i] = entry[token].logprob
    return out


def sequence(completion) -> SampledArrays:
    if completion.finish_reason not in ("stop", "length"):
        raise BackendError(f"vllm finished a sequence with reason {completion.finish_reason!r}")
    tokens = np.asarray(completion.token_ids, dtype=np.int32)
    if completion.logprobs is None:
        raise BackendError("vllm returned no logprobs although logprobs=0 was asked")
    return SampledArrays(
        tokens=tokens,
        logprobs=_values(completion.logprobs, tokens),
        stop_reason=completion.finish_reason,
    )


def prompt_logprob_array(prompt_logprobs, prompt: np.ndarray) -> np.ndarray:
    """vLLM's prompt logprobs (None / empty at position 0) → float32 [P] with NaN at 0."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(prompt):
        raise BackendError("vllm returned no prompt logprobs for every prompt position")
    rest = [int(t) for t in prompt[1:]]
    # Flat or list form alike: slicing drops position 0 (None, or an empty flat slot).
    scored = _values(prompt_logprobs[1:], rest) if rest else np.empty(0, np.float32)
    return np.concatenate([np.array([np.nan], np.float32), scored])
