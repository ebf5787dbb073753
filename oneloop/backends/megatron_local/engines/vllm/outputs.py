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


def routing_record(routed, positions: int) -> np.ndarray:
    """vLLM's `CompletionOutput.routed_experts` ([fed positions, MoE layers, top-k], the experts
    each MoE layer routed each position to) → int16 [positions, layers, top-k]: the rows of the
    prompt and every sampled token but the last, which was never fed (R3's record)."""
    if routed is None:
        raise BackendError(
            "vllm returned no routed experts although the engine was started with "
            "enable_return_routed_experts (local.vllm.return_routed_experts)"
        )
    array = np.asarray(routed)
    if array.ndim != 3 or array.shape[0] < positions:
        raise BackendError(
            f"vllm routed experts have shape {array.shape}; expected [>= {positions} positions "
            "(prompt + sampled tokens - 1), MoE layers, top-k]"
        )
    return array[:positions].astype(np.int16)


def sequence(completion, prompt_tokens: int = 0, routing: bool = False) -> SampledArrays:
    """One vLLM `CompletionOutput` → our arrays; `routing`: with its routed experts (R3) for a
    prompt of `prompt_tokens` tokens."""
    if completion.finish_reason not in ("stop", "length"):
        raise BackendError(f"vllm finished a sequence with reason {completion.finish_reason!r}")
    tokens = np.asarray(completion.token_ids, dtype=np.int32)
    if completion.logprobs is None:
        raise BackendError("vllm returned no logprobs although logprobs=0 was asked")
    routed = None
    if routing:
        routed = routing_record(completion.routed_experts, prompt_tokens + len(tokens) - 1)
    return SampledArrays(
        tokens=tokens,
        logprobs=_values(completion.logprobs, tokens),
        stop_reason=completion.finish_reason,
        routed_experts=routed,
    )


def prompt_logprob_array(prompt_logprobs, prompt: np.ndarray) -> np.ndarray:
    """vLLM's prompt logprobs (None / empty at position 0) → float32 [P] with NaN at 0."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(prompt):
        raise BackendError("vllm returned no prompt logprobs for every prompt position")
    rest = [int(t) for t in prompt[1:]]
    # Flat or list form alike: slicing drops position 0 (None, or an empty flat slot).
    scored = _values(prompt_logprobs[1:], rest) if rest else np.empty(0, np.float32)
    return np.concatenate([np.array([np.nan], np.float32), scored])
