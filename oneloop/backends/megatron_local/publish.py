"""Weight publication: how a trainer's weights reach the samplers of one base model, and how a
sampler that Ray restarted gets a client's weights back.

- Sync plans (`local.weight_sync`), per (trainer, sampler) pair: numpy through the Ray object
  store, CUDA IPC in the sampler's parameter layout (same GPU), or NCCL over a weight group
  (another GPU), opened here on first use.
- Exports: merged weights (one per sampler; samplers reached through the object store or CUDA IPC
  share one) or, for LoRA runs on the vllm sampler, one adapter directory every sampler loads.
- Install on every sampler of the pool, waiting for one that restarts meanwhile.
- Recovery rules shared with the sampling clients: which failures are worth a retry, and how a
  client's weights are put back on a restarted sampler (`reinstall`).
"""

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import ray

from oneloop.backends.config import LocalBackendConfig
from oneloop.backends.megatron_local.futures import chain_with_recovery, gather
from oneloop.backends.megatron_local.routing import SamplerPool
from oneloop.backends.megatron_local.weight_sync.layout import fast_path_gap
from oneloop.errors import CapabilityError, MissingWeightsError

# Attempts (about one per second) to reach a restarting sampler before a request fails.
RESTART_ATTEMPTS = 120


def sampler_recoverable(error: BaseException) -> bool:
    """Whether a failed sampler call is worth retrying after re-installing weights."""
    if isinstance(error, MissingWeightsError | ray.exceptions.ActorUnavailableError):
        return True
    # A crash (Ray restarts the actor) is worth retrying; `close()` (ray.kill) is final.
    return isinstance(error, ray.exceptions.RayActorError) and "ray.kill" not in str(error)


def reinstall(actor: Any, key: str, restore: Any, index: int) -> Any:
    """Put weight set `key` back on sampler `index` of a pool (an ObjectRef to wait on).

    `restore`: a sampler checkpoint directory (path clients); per sampler of the pool, the
    published weights' ObjectRef; or None for the base model (nothing to install)."""
    if isinstance(restore, str):
        return actor.load_weights_from.remote(key, restore)
    if restore is not None:
        return actor.set_weights.remote(key, restore[index])
    return actor.ready.remote()


class WeightPublisher:
    """Plans and runs publication from the trainer actors of one service to its sampler pools;
    remembers the samplers' parameter layouts and the NCCL weight groups already opened."""

    def __init__(self, local: LocalBackendConfig) -> None:
        self.local = local
        self._layouts: dict[Any, Any] = {}
        self._groups: set[tuple[Any, Any, str]] = set()  # NCCL weight groups opened

    def sync_plan(self, sampler: Any, trainer: Any, name: str) -> tuple[Any, str | None]:
        """How `trainer` exports weights for `sampler` (`local.weight_sync`): `(None, None)` =
        numpy through the object store; `(layout ref, None)` = CUDA IPC in the sampler's parameter
        layout (same GPU); `(layout ref, group)` = NCCL over weight group `group`, opened here on
        first use (another GPU). `auto` picks by comparing the two actors' GPU UUIDs, and takes
        the object store for a model whose vLLM layout the CUDA paths do not map
        (`layout.fast_path_gap`: Gated DeltaNet)."""
        local = self.local
        mode = local.weight_sync
        cuda_trainer = local.trainer_engine == "megatron" or local.device == "cuda"
        sharded = local.sampler_engine == "vllm" and local.vllm.tp > 1
        if mode == "object_store" or (
            mode == "auto" and (sharded or not (local.sampler_engine == "vllm" and cuda_trainer))
        ):
            # A tensor-parallel vllm engine: every worker loads its shard through vLLM's loader
            # (the CUDA paths write one worker's layout; config refuses them at tp > 1).
            return None, None
        if sharded:
            raise CapabilityError(f"local.weight_sync={mode} cannot reach every worker of a vllm "
                                  f"engine of local.vllm.tp={local.vllm.tp}: use auto or "
                                  "object_store")  # fmt: skip
        if local.sampler_engine != "vllm":
            raise CapabilityError(f"local.weight_sync={mode} needs local.sampler_engine=vllm")
        if sampler not in self._layouts:
            self._layouts[sampler] = sampler.weight_layout.remote()
        # The sampler answers once its engine is up (vLLM start: compile + CUDA graphs).
        gap = fast_path_gap(ray.get(self._layouts[sampler], timeout=900))
        if gap is not None:
            if mode == "auto":  # vLLM's own loader, through the object store
                return None, None
            raise CapabilityError(f"local.weight_sync={mode}: {gap}; use auto or object_store")
        if mode == "auto":
            uuids = ray.get([trainer.gpu_uuid.remote(), sampler.gpu_uuid.remote()], timeout=900)
            mode = "cuda_ipc" if uuids[0] == uuids[1] else "nccl"
        if mode == "cuda_ipc":
            return self._layouts[sampler], None
        group = f"weights:{name}"  # one group per (trainer, sampler) pair
        if (trainer, sampler, group) not in self._groups:
            host, port = ray.get(trainer.weight_group_address.remote(), timeout=120)
            opened = [
                trainer.open_weight_group.remote(group, host, port),
                sampler.open_weight_group.remote(group, host, port),
            ]
            ray.get(opened, timeout=300)
            self._groups.add((trainer, sampler, group))
        return self._layouts[sampler], group

    def export_merged(self, trainer: Any, pool: SamplerPool, model_id: str) -> list[Any]:
        """One weight version for every sampler of `pool`: an ObjectRef per sampler. Samplers
        reached through the object store or CUDA IPC share one export; each NCCL sampler gets its
        own send of the same version over its own weight group."""
        shared, payloads, bump = None, [], True
        for index, sampler in enumerate(pool.actors):
            name = f"{model_id}:{index}"
            layout, group = self.sync_plan(sampler, trainer, name)
            if group is None:
                if shared is None:
                    shared = trainer.export_sampler_weights.remote(layout, None, bump)
                    bump = False
                payloads.append(shared)
            else:
                payloads.append(trainer.export_sampler_weights.remote(layout, group, bump))
                bump = False
        return payloads

    @staticmethod
    def export_adapter(trainer: Any, pool: SamplerPool, root: Path) -> list[Any]:
        """One adapter version written under `root`; every sampler of `pool` loads that file."""
        return [trainer.export_adapter.remote(str(root))] * len(pool.actors)

    @staticmethod
    def install(pool: SamplerPool, key: str, payloads: list[Any]) -> Future[list[Any]]:
        """Install `payloads` (one per sampler of `pool`) as weight set `key` on every sampler;
        one restarting meanwhile is waited for (as sampling clients do). Resolves to the
        versions installed, once all samplers have them."""
        installed = [
            chain_with_recovery(
                lambda sampler=sampler, payload=payload: sampler.set_weights.remote(key, payload),
                lambda version: version,
                lambda sampler=sampler: sampler.ready.remote(),
                sampler_recoverable,
                attempts=RESTART_ATTEMPTS,
            )
            for sampler, payload in zip(pool.actors, payloads, strict=True)
        ]
        return gather(installed)
