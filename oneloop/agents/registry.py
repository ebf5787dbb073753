"""The process-level registry of sampling clients that agents look up by key.

Harbor builds agents from a JSON-able config (`AgentConfig.kwargs`), so a live sampling client
cannot travel through it. The trial runner registers the client in the process that runs the
trial (`register_sampler(key, client)`) and passes `sampler_key=key` in the agent kwargs; the
agent calls `get_sampler(key)`. A client is anything with the Tinker `SamplingClient.sample`
signature (the official SDK's client or the local backend's).
"""

from __future__ import annotations

import threading
from typing import Any

from oneloop.errors import OneloopError


class SamplerNotRegisteredError(OneloopError, LookupError):
    """No sampling client is registered under the requested key in this process."""


_lock = threading.Lock()
_samplers: dict[str, Any] = {}


def register_sampler(key: str, client: Any) -> None:
    """Register `client` under `key`, replacing any client already there."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"sampler key: expected a non-empty string, got {key!r}")
    if not callable(getattr(client, "sample", None)):
        raise TypeError(
            f"sampler {key!r}: {type(client).__name__} has no sample(prompt, num_samples, "
            "sampling_params) method"
        )
    with _lock:
        _samplers[key] = client


def get_sampler(key: str) -> Any:
    """The client registered under `key`; `SamplerNotRegisteredError` naming the key if none."""
    with _lock:
        client = _samplers.get(key)
        known = sorted(_samplers)
    if client is None:
        raise SamplerNotRegisteredError(
            f"sampler_key {key!r} is not registered in this process (registered: {known}); "
            "call oneloop.agents.registry.register_sampler(key, client) in the process that "
            "runs the trial before starting it"
        )
    return client


def unregister_sampler(key: str) -> None:
    """Remove `key`; removing a key that is not registered is not an error."""
    with _lock:
        _samplers.pop(key, None)
