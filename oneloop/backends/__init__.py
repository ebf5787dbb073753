"""Backends: `connect(config)` returns a Tinker-shaped ServiceClient.

- `local`  → `megatron_local.service_client.LocalServiceClient` (Ray cluster of our engines).
- `tinker` → `tinker_remote.connect_remote` (the official SDK's own `ServiceClient`).
"""

from pathlib import Path
from typing import Any

from oneloop.backends.capabilities import Capabilities
from oneloop.backends.config import BackendConfig, parse_backend_config
from oneloop.errors import ConfigError

__all__ = ["BackendConfig", "capabilities", "connect", "parse_backend_config", "plan"]


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
            vllm_routed_experts=local.vllm.return_routed_experts,
        )
    from oneloop.backends.tinker_remote import remote_capabilities

    return remote_capabilities(config)


def plan(config: BackendConfig, cluster_file: Path | None = None) -> Any:
    """The local backend's placement plan (`megatron_local.placement.PlacementPlan`: `.format()`
    prints it) for the cluster described in `cluster_file` (YAML/JSON), or else the Ray cluster
    `local.ray_address` reaches, without starting any engine. Raises ConfigError (PlacementError)
    naming what is short when the layout does not fit."""
    if config.backend != "local":
        raise ConfigError("--plan: backend.backend=tinker places nothing here (the Tinker service "
                          "places its own engines); use backend.backend=local")  # fmt: skip
    from oneloop.backends.megatron_local import placement

    if cluster_file is not None:
        nodes = placement.read_cluster_file(cluster_file)
    else:
        import ray

        from oneloop.backends.ray_runtime import init_ray

        started = not ray.is_initialized()
        address = config.local.ray_address
        try:
            init_ray(address=address, num_cpus=config.local.ray_num_cpus,
                     include_dashboard=False, configure_logging=False)  # fmt: skip
        except ConnectionError as error:
            raise ConfigError(f"--plan: no Ray cluster at backend.local.ray_address={address!r} "
                              f"({error}); start one (scripts/cluster/head.sh) or describe it "
                              "with --cluster FILE") from None  # fmt: skip
        try:
            nodes = placement.live_cluster()
        finally:
            if started:
                ray.shutdown()
    return placement.plan_placement(config.local, nodes)
