"""Front door: the local backend's ServiceClient, a Tinker `ServiceClient` on a Ray cluster of our
engines (`oneloop.backends.connect(BackendConfig(backend="local"))`, or `LocalServiceClient(config)`
directly, as `oneloop serve` does).

It starts the actors (a trainer actor per training client, a pool of sampler actors per base
model, `actors.py`), creates the training (`training_client.py`) and sampling
(`sampling_client.py`) clients on them, and restores clients from checkpoints (`checkpoints.py`).
Model names resolve through `models.py`; weights reach the samplers through `publish.py`.
"""

import logging
import uuid
from pathlib import Path
from typing import Any

import ray
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from oneloop.backends import capabilities as backend_capabilities
from oneloop.backends.capabilities import Capabilities
from oneloop.backends.config import BackendConfig, check_model_dirs
from oneloop.backends.megatron_local import models
from oneloop.backends.megatron_local.actors import SamplerActor, TrainerActor
from oneloop.backends.megatron_local.checkpoints import CheckpointMeta, TinkerPath, sweep_partials
from oneloop.backends.megatron_local.engines.base import LoraSpec
from oneloop.backends.megatron_local.engines.factory import trainer_actor_gpus
from oneloop.backends.megatron_local.futures import chain, completed, gather
from oneloop.backends.megatron_local.lora_serving import (
    check_adapter_targets,
    check_pool_fits,
    pool_lora_rank,
    serves_adapters,
)
from oneloop.backends.megatron_local.placement import placement_groups, sampler_actor_options
from oneloop.backends.megatron_local.publish import WeightPublisher
from oneloop.backends.megatron_local.routing import SamplerPool
from oneloop.backends.megatron_local.sampling_client import (
    LocalSamplingClient,
    check_no_stability_info,
)
from oneloop.backends.megatron_local.training_client import LocalTrainingClient
from oneloop.backends.ray_runtime import init_ray
from oneloop.errors import CapabilityError, RequestError

log = logging.getLogger(__name__)


def actor_restarts(actor: Any) -> int:
    """How many times Ray has restarted `actor` (0 for one that never died).

    Read from the GCS actor table, the record Ray's state API reports `num_restarts` from: that
    API (`ray.util.state`) needs the dashboard, which the local backend does not start, so this
    reads the table directly (`ray._private.state`, pinned with Ray in uv.lock).
    """
    from ray._private import state

    info = state.actors(actor_id=actor._actor_id.hex())
    return int(info.get("NumRestarts", 0)) if info else 0


class LocalServiceClient:
    """A Tinker ServiceClient on a Ray cluster of our engines, for one `BackendConfig`."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.run_dir = config.run_dir.resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.capabilities: Capabilities = backend_capabilities(config)
        check_model_dirs(config)  # before Ray starts: a wrong path is a config error
        for staging in sweep_partials(self.run_dir):  # left by a save that was killed
            log.info("removed an unfinished checkpoint save: %s", staging)
        init_ray(
            address=config.local.ray_address,
            num_cpus=config.local.ray_num_cpus,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
        self._samplers: dict[str, SamplerPool] = {}
        self.publisher = WeightPublisher(config.local)
        self._sampler_info: dict[str, tuple[tuple[int, ...], int]] = {}
        self._pool_lora: dict[str, int] = {}  # LoRA rank each model's vllm samplers serve
        self._trainers: dict[str, Any] = {}
        """Live trainer actors by run id (`release_training_client` stops one)."""
        self._placement_groups: list[Any] = []  # the sampler engines' (several nodes)

    # -- models ----------------------------------------------------------------------------------

    def resolve_model(self, base_model: str) -> Path:
        """A base-model name → its local Hugging Face directory (`models.resolve_model`)."""
        return models.resolve_model(self.config.models, base_model)

    def sampler_pool(self, model_dir: Path, lora_rank: int | None = None) -> SamplerPool:
        """The sampler actors of one base model (`local.samplers_per_model`), started on first
        use, behind a session-affine router. `lora_rank`: the training client's rank (None for
        sampling only); a vllm pool starts with LoRA for it, or must already serve it."""
        key = str(model_dir)
        local = self.config.local
        capacity = self._pool_capacity(key, lora_rank)
        if key not in self._samplers:
            # Read first: a directory that is not a model fails here, before any actor starts
            # and before the pool is registered half-made.
            limits = models.sampling_limits(key)
            self._pool_lora[key] = capacity
            placed = sampler_actor_options(local)  # on the plan's nodes (several nodes)
            self._placement_groups += placement_groups(placed)
            actors = [
                SamplerActor.options(**options).remote(local, key, capacity) for options in placed
            ]
            self._sampler_info[key] = limits
            self._samplers[key] = SamplerPool(actors)
        return self._samplers[key]

    def _pool_capacity(self, key: str, lora_rank: int | None) -> int:
        """The LoRA rank model `key`'s samplers serve (or will, if not started); raises when a
        client of `lora_rank` cannot use them (`lora_serving.check_pool_fits`)."""
        local = self.config.local
        capacity = self._pool_lora.get(key)
        if capacity is None:
            capacity = pool_lora_rank(local.sampler_engine, local.vllm.max_lora_rank, lora_rank)
        check_pool_fits(local.sampler_engine, key, capacity, lora_rank)
        return capacity

    def _sampler_actors(self) -> list[Any]:
        return [a for pool in list(self._samplers.values()) for a in pool.actors]  # a snapshot

    def sampling_client(
        self,
        pool: SamplerPool,
        key: str,
        base_model: str,
        model_dir: Path,
        model_path: str | None,
        version: int,
        restore: Any = None,
    ) -> LocalSamplingClient:
        eos_ids, context = self._sampler_info[str(model_dir)]
        return LocalSamplingClient(
            pool, key, base_model, str(model_dir), model_path, eos_ids, context, version, restore
        )

    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        names = models.served_model_names(self.config.models)
        return types.GetServerCapabilitiesResponse(
            supported_models=[
                types.SupportedModel(model_name=n, trainable=True, sampleable=True) for n in names
            ]
        )

    # -- training clients ------------------------------------------------------------------------

    def _start_trainer(
        self, base_model: str, model_dir: Path, lora: LoraSpec, run_id: str | None = None
    ) -> tuple[Any, str]:
        self.capabilities.check(lora_rank=lora.rank)
        local = self.config.local
        if serves_adapters(local.sampler_engine, lora.rank):
            check_adapter_targets(lora.train_mlp, lora.train_attn, lora.train_unembed)
        self._pool_capacity(str(model_dir), lora.rank)  # before any actor starts
        self.sampler_pool(model_dir, lora.rank)  # before the trainer: nothing leaks if it fails
        # A megatron group of several ranks holds its GPUs in its rank actors' placement group.
        actor = TrainerActor.options(num_gpus=trainer_actor_gpus(local)).remote(
            local, str(model_dir), lora
        )
        run_id = run_id or f"run-{uuid.uuid4().hex[:12]}"
        self._trainers[run_id] = actor
        return actor, run_id

    @property
    def live_trainers(self) -> int:
        """Trainer actors started by this client and not yet released."""
        return len(self._trainers)

    @property
    def live_training_runs(self) -> tuple[str, ...]:
        """Run ids of the live trainer actors (each can be `release_training_client`ed)."""
        return tuple(self._trainers)

    def release_training_client(self, run_id: str) -> bool:
        """Stop the trainer actor of training run `run_id` (a local-backend extension: `oneloop
        serve` calls it when a session ends, a model is unloaded or sits idle). Its checkpoints
        stay; a request to the released client fails with Ray's actor-died error. False if no
        live trainer has that run id (already released)."""
        actor = self._trainers.pop(run_id, None)
        if actor is None:
            return False
        ray.kill(actor)
        return True

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        optimizer: Any = None,
    ) -> AwaitableConcurrentFuture[LocalTrainingClient]:
        """rank > 0 trains LoRA adapters; rank == 0 is full fine-tuning (a local-backend
        extension)."""
        if optimizer is not None and not isinstance(optimizer, types.AdamOptimizerConfig):
            raise CapabilityError("optimizer: the local backend implements AdamW only")
        if not (train_mlp or train_attn or train_unembed):
            raise RequestError("at least one of train_mlp, train_attn, train_unembed must be True")
        lora = LoraSpec(rank, seed, train_mlp, train_attn, train_unembed)
        self.capabilities.check(lora_rank=rank)
        model_dir = self.resolve_model(base_model)
        actor, run_id = self._start_trainer(base_model, model_dir, lora)
        return chain(
            actor.ready.remote(),
            lambda _: LocalTrainingClient(self, actor, run_id, base_model, model_dir, lora),
        )

    def _from_state(
        self, path: str, with_optimizer: bool
    ) -> AwaitableConcurrentFuture[LocalTrainingClient]:
        parsed = TinkerPath.parse(path)
        if parsed.kind != "weights":
            raise RequestError(
                f"path: {path} is a sampler checkpoint; training needs tinker://<run>/weights/<name>"
            )
        directory = parsed.existing_directory(self.run_dir)
        meta = CheckpointMeta.read(directory)
        lora = meta.lora
        model_dir = Path(meta.model_dir)
        actor, run_id = self._start_trainer(meta.base_model, model_dir, lora)
        loaded = actor.load_state.remote(str(directory), with_optimizer)
        return chain(
            loaded,
            lambda _: LocalTrainingClient(self, actor, run_id, meta.base_model, model_dir, lora),
        )

    def create_training_client_from_state(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
        optimizer: Any = None,
    ):
        return self._from_state(path, with_optimizer=False)

    def create_training_client_from_state_with_optimizer(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ):
        return self._from_state(path, with_optimizer=True)

    # -- sampling clients ------------------------------------------------------------------------

    def create_sampling_client(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
    ) -> AwaitableConcurrentFuture[LocalSamplingClient]:
        check_no_stability_info(record_stability_info)
        if model_path is None and base_model is None:
            raise RequestError("create_sampling_client: pass model_path or base_model")
        if model_path is None:
            assert base_model is not None
            model_dir = self.resolve_model(base_model)
            pool = self.sampler_pool(model_dir)
            return completed(self.sampling_client(pool, "base", base_model, model_dir, None, 0))
        parsed = TinkerPath.parse(model_path)
        directory = parsed.existing_directory(self.run_dir)
        meta = CheckpointMeta.read(directory)
        if parsed.kind == "weights":
            raise RequestError(
                f"model_path: {model_path} holds training state; sample from a "
                "save_weights_for_sampler path (tinker://<run>/sampler_weights/<name>)"
            )
        model_dir = Path(meta.model_dir)
        pool = self.sampler_pool(model_dir)
        key = f"path:{parsed}:{meta.sync_version}"
        loaded = [actor.load_weights_from.remote(key, str(directory)) for actor in pool.actors]
        return chain(
            gather([chain(ref, lambda version: version) for ref in loaded]),
            lambda versions: self.sampling_client(
                pool, key, meta.base_model, model_dir, model_path, min(versions), str(directory)
            ),
        )

    def backend_metrics(self) -> dict[str, float]:
        """Counters of backend events since this client started (a local-backend extension that
        the loop logs per step; see `oneloop.loop.metrics.ReportsBackendMetrics`).

        `backend/sampler_restarts`: restarts of this client's sampler actors by Ray after a
        crash (OOM, a killed process); clients re-install their weights on the new actor and
        resubmit, so an in-flight sample is retried, not failed. Blocking (one GCS read).
        """
        restarts = sum(actor_restarts(a) for a in self._sampler_actors())
        return {"backend/sampler_restarts": float(restarts)}

    def close(
        self, status: str = "success", detail: str | None = None
    ) -> AwaitableConcurrentFuture[None]:
        """Stop this client's actors (the Ray runtime stays up for other clients). Same signature
        as the SDK's `ServiceClient.close(status, detail)`; returns a finished future."""
        for actor in [*self._trainers.values(), *self._sampler_actors()]:
            ray.kill(actor)
        for group in self._placement_groups:
            ray.util.remove_placement_group(group)
        self._placement_groups.clear()
        self._trainers.clear()
        self._samplers.clear()
        self._pool_lora.clear()
        return completed(None)
