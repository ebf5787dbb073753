"""Concurrent `sample` calls through the local backend's Ray sampler actor (issue 21): the actor
hands the torch engine each request as it comes and the engine batches them
(tests/backends/engines/test_torch_sampler_batching.py tests the batching itself)."""

import numpy as np
from tinker import types

from oneloop.tiny.model import TINY_MODEL_NAME

TIMEOUT_S = 120


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 1000, size=length).tolist()


def test_concurrent_requests_through_the_sampler_actor(local_service):
    """Concurrent seeded `sample` calls through the Ray sampler actor (which hands the torch
    engine each request as it comes) give what the same calls give one at a time."""
    client = local_service.create_sampling_client(base_model=TINY_MODEL_NAME).result(TIMEOUT_S)
    params = [types.SamplingParams(max_tokens=6 + i, seed=100 + i, stop=[]) for i in range(6)]
    prompts = [types.ModelInput.from_ints(prompt(50 + i, 4 + 2 * i)) for i in range(6)]
    alone = [
        client.sample(p, 2, s).result(timeout=TIMEOUT_S)
        for p, s in zip(prompts, params, strict=True)
    ]
    futures = [client.sample(p, 2, s) for p, s in zip(prompts, params, strict=True)]
    together = [f.result(timeout=TIMEOUT_S) for f in futures]
    for a, b, s in zip(alone, together, params, strict=True):
        assert [x.tokens for x in a.sequences] == [x.tokens for x in b.sequences]
        assert all(len(x.tokens) == s.max_tokens for x in b.sequences)
