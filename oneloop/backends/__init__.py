"""Backends: `connect(config)` returns a Tinker-shaped ServiceClient.

- `local`  → `megatron_local.clients.LocalServiceClient` (Ray cluster of our engines).
- `tinker` → `tinker_remote.connect_remote` (the official SDK's own `ServiceClient`).
"""

from typing import Any

from oneloop.backends.capabilities import Capabilities
from oneloop.backends.config import BackendConfig, parse_backend_config

__all__ = ["BackendConfig", "capabilities", "connect", "parse_backend_config"]


def connect(config: BackendConfig | dict) -> Any:
    """A ServiceClient for `config.backend`; a dict is validated first (errors name dotted paths)."""
    if isinstance(config, dict):
        config = parse_backend_config(config)
    if config.backend == "local":
        from oneloop.backends.megatron_local.clients import LocalServiceClient

        return LocalServiceClient(config)
    from oneloop.backends.tinker_remote import connect_remote

    return connect_remote(config)


def capabilities(service: Any, config: BackendConfig) -> Capabilities:
    """What the connected backend supports (checked before a run starts)."""
    from oneloop.backends.megatron_local.clients import LocalServiceClient

    if isinstance(service, LocalServiceClient):
        return service.capabilities
    from oneloop.backends.tinker_remote import remote_capabilities

    return remote_capabilities(config)
