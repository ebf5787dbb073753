"""Front door: the local backend's SamplingClient, a Tinker `SamplingClient` over the sampler
actors of one base model (`routing.SamplerPool`) and one named weight set, and the conversion of
its requests to the engine's (`sample_request`, `token_ids`). A crashed sampler is restarted by
Ray; the client re-installs its weights there and resubmits (the rules: `publish.py`).
"""

import itertools
import os
import uuid
from typing import Any, ClassVar

import numpy as np
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from oneloop.backends.megatron_local.engines.base import SampleOutput, SampleRequest
from oneloop.backends.megatron_local.futures import chain_with_recovery
from oneloop.backends.megatron_local.models import load_tokenizer
from oneloop.backends.megatron_local.publish import (
    RESTART_ATTEMPTS,
    reinstall,
    sampler_recoverable,
)
from oneloop.backends.megatron_local.routing import SamplerPool
from oneloop.backends.megatron_local.sample_batch import sample_response
from oneloop.errors import CapabilityError, RequestError

# Tinker's `record_stability_info` (SDK 0.38) asks the server to record, per sampled sequence,
# information that only the `stable_reinforce` loss reads. Tinker documents neither that
# information nor the loss's objective, so the local backend refuses both with this reason rather
# than record something else under that name (`losses.UNSUPPORTED_BUILTINS`).
STABILITY_INFO_REFUSAL = (
    "record_stability_info: not supported by the local backend: it records information that only "
    "the stable_reinforce loss reads, and Tinker does not publish what that information or that "
    "loss's objective is, so this backend neither records it nor trains with stable_reinforce; "
    "sample without it (each sequence still carries its sequence_id)"
)


def check_no_stability_info(record_stability_info: bool | None) -> None:
    """Raise CapabilityError(STABILITY_INFO_REFUSAL) if `record_stability_info` is set."""
    if record_stability_info:
        raise CapabilityError(STABILITY_INFO_REFUSAL)


def token_ids(model_input: types.ModelInput) -> np.ndarray:
    """All token ids as int64, chunk by chunk through numpy, so a chunk that holds an array
    (`oneloop serve` decodes token chunks into `TokenIds`) costs no Python int per token."""
    chunks = model_input.chunks
    if not all(isinstance(c, types.EncodedTextChunk) for c in chunks):
        return np.asarray(model_input.to_ints(), dtype=np.int64)  # raises the SDK's ValueError
    parts = [np.asarray(c.tokens, dtype=np.int64) for c in chunks]
    return parts[0] if len(parts) == 1 else np.concatenate([np.zeros(0, np.int64), *parts])


def sample_request(
    prompt: types.ModelInput,
    num_samples: int,
    params: types.SamplingParams,
    include_prompt_logprobs: bool,
    eos_ids: tuple[int, ...],
    context_length: int,
) -> SampleRequest:
    """Validate a sample call and convert it to the engine's request."""
    tokens = np.asarray(prompt.to_ints(), dtype=np.int64)
    if len(tokens) == 0:
        raise RequestError("prompt: must contain at least one token")
    if num_samples < 1:
        raise RequestError(f"num_samples: must be >= 1, got {num_samples}")
    room = context_length - len(tokens)
    if room < 1:
        raise RequestError(
            f"prompt: {len(tokens)} tokens leave no room in the model's context of {context_length}"
        )
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens < 1:
        raise RequestError(f"sampling_params.max_tokens: must be >= 1, got {max_tokens}")
    if params.temperature < 0:
        raise RequestError(f"sampling_params.temperature: must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise RequestError(f"sampling_params.top_p: must be in (0, 1], got {params.top_p}")
    stop = params.stop
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    if stop is None:
        stop_ids = eos_ids
    elif isinstance(stop, str):
        stop_strings = (stop,)
    elif all(isinstance(s, str) for s in stop):
        stop_strings = tuple(stop)  # type: ignore[arg-type]
    elif all(isinstance(s, int) for s in stop):
        stop_ids = tuple(int(s) for s in stop)  # type: ignore[arg-type]
    else:
        raise RequestError(
            "sampling_params.stop: must be a string, a list of strings or of token ids"
        )
    return SampleRequest(
        prompt=tokens,
        num_samples=num_samples,
        max_tokens=min(max_tokens, room),
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop_token_ids=stop_ids,
        stop_strings=stop_strings,
        include_prompt_logprobs=include_prompt_logprobs,
    )


class LocalSamplingClient:
    """A Tinker SamplingClient on a local sampler actor and one named weight set.

    Picklable (it holds an actor handle and strings), so it can be sent to Ray tasks running trials.
    """

    nonblocking_submit_max_tokens: ClassVar[int] = 8192
    """`sample` of a prompt up to this many tokens never waits: it checks the request, converts it
    and enqueues one actor task (`.remote()`), whose arguments Ray sends inline up to 100 KiB
    (`max_direct_call_object_size`; 8,192 int64 tokens are 64 KiB) rather than through the object
    store; the result is the returned future's. `oneloop serve` calls it on its event loop up to
    this size (a worker thread beyond)."""

    def __init__(
        self,
        pool: SamplerPool,
        key: str,
        base_model: str,
        model_path_local: str,
        model_path: str | None,
        eos_ids: tuple[int, ...],
        context_length: int,
        version: int,
        restore: Any = None,
    ) -> None:
        self._pool = pool  # requests go to one of its samplers, session-affine (routing.py)
        # How to put this client's weights back on a restarted sampler: per sampler of the pool,
        # the weights' ObjectRef (published weights); or a checkpoint directory (path clients);
        # None for the base model.
        self._restore = restore
        self._key = key
        self.sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        self.base_model = base_model
        self.model_path = model_path
        self.version = version
        self._model_dir = model_path_local
        self._eos_ids = eos_ids
        self._context_length = context_length
        self._counter = itertools.count(int.from_bytes(os.urandom(4)))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_counter"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._counter = itertools.count(int.from_bytes(os.urandom(4)))

    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> AwaitableConcurrentFuture[types.SampleResponse]:
        for name, value in (
            ("topk_prompt_logprobs", topk_prompt_logprobs),
            ("topk_sample_logprobs", topk_sample_logprobs),
            ("prompt_alt_tokens_k", prompt_alt_tokens_k),
        ):
            if value:
                raise CapabilityError(f"{name} is not supported by the local backend's samplers")
        if target_prompt_logprobs is not None or prompt_logprobs_last_n is not None:
            raise CapabilityError(
                "target_prompt_logprobs / prompt_logprobs_last_n are not supported by the local "
                "backend's samplers"
            )
        request = sample_request(
            prompt,
            num_samples,
            sampling_params,
            include_prompt_logprobs,
            self._eos_ids,
            self._context_length,
        )
        first = next(self._counter) * 1024  # room for up to 1024 sequences per request
        if num_samples > 1024:
            raise RequestError(f"num_samples: at most 1024 per request, got {num_samples}")
        namespace = self.sampler_id

        def convert(out: SampleOutput) -> types.SampleResponse:
            # batched once here; the SDK's SampledSequence objects are built on first access
            return sample_response(
                out.sequences, out.prompt_logprobs, namespace, out.version, first
            )

        index, actor = self._pool.route(request.prompt)
        return self._call(
            index, lambda: actor.sample.remote(self._key, request, self.version), convert
        )

    def _call(self, index: int, submit: Any, convert: Any) -> AwaitableConcurrentFuture:
        """Submit to sampler `index` of the pool, and if it restarted or lacks this client's
        weights, re-install them and resubmit (weights only move forward: a newer version stays)."""
        actor = self._pool.actors[index]
        return chain_with_recovery(
            submit,
            convert,
            lambda: reinstall(actor, self._key, self._restore, index),
            sampler_recoverable,
            attempts=RESTART_ATTEMPTS,
        )

    def compute_logprobs(
        self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None
    ) -> AwaitableConcurrentFuture[list[float | None]]:
        tokens = np.asarray(prompt.to_ints(), dtype=np.int64)
        if len(tokens) == 0:
            raise RequestError("prompt: must contain at least one token")
        if prompt_logprobs_last_n is not None and prompt_logprobs_last_n < 0:
            raise RequestError("prompt_logprobs_last_n: must be >= 0")

        def convert(values: np.ndarray) -> list[float | None]:
            out: list[float | None] = [None if np.isnan(v) else float(v) for v in values]
            if prompt_logprobs_last_n is not None:
                cut = max(len(out) - prompt_logprobs_last_n, 0)
                out[:cut] = [None] * cut
            return out

        index, actor = self._pool.route(tokens)
        return self._call(
            index, lambda: actor.prompt_logprobs.remote(self._key, tokens, self.version), convert
        )

    def get_tokenizer(self):
        return load_tokenizer(self._model_dir)

    def get_base_model(self) -> str:
        return self.base_model
