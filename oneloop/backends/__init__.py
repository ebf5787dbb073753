"""Backends: `connect(config)` returns a Tinker-shaped ServiceClient.

- `local`  → `megatron_local.service_client.LocalServiceClient` (Ray cluster of our engines).
- `tinker` → `tinker_remote.connect_remote` (the official SDK's own `ServiceClient`).
"""

from typing import Any

from oneloop.backends.capabilities import Capabilities
from oneloop.backends.config import BackendConfig, parse_backend_config

__all__ = ["BackendConfig", "capabilities", "connect", "parse_backend_config"]


def connect(config: BackendConfig | dict) -> Any:
    """A ServiceClient for `config.backend`; a dict is validated first (errors name dotted
    paths)."""
    if isinstance(config, dict):
        config = parse_backend_config(config)
    if config.backend == "local":
        from oneloop.backends.megatron_local.service_client import LocalServiceClient

        return LocalServiceClient(config)
    from oneloop.backends.tinker_remote import connect_remote

    return connect_remote(config)


def capabilities(config: BackendConfig) -> Capabilities:
    """What the configured backend supports, known before connecting (so a run refuses an
    unsupported knob before Ray or any actor starts): the local backend's table follows from its
    engines; a Tinker service is asked (`get_server_capabilities`) and its table applied."""
    if config.backend == "local":
        from oneloop.backends.capabilities import local_capabilities

        local = config.local
        return local_capabilities(
            local.max_lora_rank,
            models=(),
            trainer_engine=local.trainer_engine,
            sampler_engine=local.sampler_engine,
            megatron_tp_only=local.megatron.pp == 1 and local.megatron.cp == 1,
        )
    from oneloop.backends.tinker_remote import remote_capabilities

    return remote_capabilities(config)
