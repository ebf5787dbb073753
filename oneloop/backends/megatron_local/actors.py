"""Ray actors hosting the engines: a trainer actor per training model, a sampler per base model.

The trainer actor is a plain (single-threaded) actor, so a model's calls run in submission order.
The sampler actor is an async actor: many `sample` calls queue at once and its event loop never
blocks. Engines that batch concurrent requests themselves (`ConcurrentSampler`: vllm, and torch,
whose worker thread batches whatever is waiting) get each request as it comes, without a lock, and
guard their own model, so weight updates land between batches; any other engine runs one call at a
time in a worker thread behind a FIFO lock. Weights travel trainer → sampler through the Ray object
store (numpy arrays, zero-copy on the reading side), or on GPUs in vLLM's parameter layout over
CUDA IPC (same GPU) or NCCL (another GPU); each sync bumps the trainer's version. LoRA runs on
the vllm sampler send adapters instead (`export_adapter`: a PEFT directory under the run
directory, loaded by the sampler as a vLLM LoRA module; `lora_serving.py`, `engines/vllm/lora.py`).
Optional engine capabilities are tested with `isinstance` on the protocols of `engines/base.py`.
"""

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import ray
from safetensors.numpy import load_file, save_file

from oneloop.backends.config import LocalBackendConfig
from oneloop.backends.megatron_local.checkpoints import CheckpointMeta, staged
from oneloop.backends.megatron_local.engines.base import (
    AdapterDir,
    ConcurrentSampler,
    CudaWeightSink,
    CudaWeightSource,
    DatumArrays,
    ForwardResult,
    LoraSpec,
    SampleOutput,
    SampleRequest,
)
from oneloop.backends.megatron_local.engines.factory import make_sampler_engine, make_trainer_engine
from oneloop.backends.megatron_local.lora_serving import serves_adapters
from oneloop.errors import CapabilityError, MissingWeightsError

SAMPLER_WEIGHTS_FILE = "model.safetensors"
ADAPTER_DIR = "adapter"  # a sampler checkpoint's PEFT adapter (LoRA runs on the vllm sampler)


@ray.remote(num_cpus=0)
class TrainerActor:
    """Hosts one trainer engine (see `engines.base.TrainerEngine`). A megatron trainer of more
    than one rank is `engines.megatron.group.MegatronRayGroup`: this actor creates the rank actors
    (one GPU each, one placement group) and drives them, holding no GPU itself (start it with
    `num_gpus=factory.trainer_actor_gpus(local)`)."""

    def __init__(self, local: LocalBackendConfig, model_path: str, lora: LoraSpec) -> None:
        self.engine = make_trainer_engine(local, Path(model_path), lora)
        self.model_path = model_path
        self.adapters = serves_adapters(local.sampler_engine, lora.rank)  # else merged weights
        self.sync_version = 0
        self._shared_buffer = None  # the last CUDA IPC weight buffer, alive until the next export
        self._senders: dict = {}  # NCCL weight groups this trainer hosts, by name

    def ready(self) -> bool:
        return True

    def forward_backward(
        self,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardResult:
        return self.engine.forward_backward(data, loss_fn, loss_fn_config, forward_only)

    def optim_step(self, adam_params: dict[str, float]) -> dict[str, float]:
        return self.engine.optim_step(adam_params)

    def gpu_uuid(self) -> str | None:
        """The UUID of the GPU this actor's engine runs on (None on CPU)."""
        from oneloop.backends.megatron_local.weight_sync.ipc import gpu_uuid

        return gpu_uuid()

    def weight_group_address(self) -> tuple[str, int]:
        """Where this trainer will host an NCCL weight group: (node IP, a free port)."""
        from oneloop.backends.megatron_local.ports import free_port

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def open_weight_group(self, name: str, host: str, port: int) -> None:
        """Host NCCL weight group `name` as rank 0 (the sampler joins at the same time)."""
        import torch

        from oneloop.backends.megatron_local.weight_sync.nccl import NcclSender

        old = self._senders.pop(name, None)
        if old is not None:
            old.close()
        device = torch.device("cuda", torch.cuda.current_device())  # NCCL wants an index
        self._senders[name] = NcclSender(name, host, port, device)

    def export_sampler_weights(
        self, layout: list | None = None, group: str | None = None, bump: bool = True
    ) -> tuple[int, Any]:
        """Bump the sync version (unless `bump` is False: another sampler's copy of the version
        just exported) and return it with the full sampler weights: numpy arrays, or —
        given the sampler's parameter `layout` — one CUDA buffer already in that layout, shared
        over CUDA IPC (same GPU) or, given an open NCCL weight `group`, queued on it for the
        sampler to receive (another GPU). Either way the sampler writes straight into its
        parameters; the buffer lives until the next export (IPC) or until received (NCCL)."""
        self.sync_version += int(bump)
        if layout is None:
            return self.sync_version, self.engine.sampler_weights()
        from oneloop.backends.megatron_local.weight_sync.ipc import make_ipc_weights
        from oneloop.backends.megatron_local.weight_sync.layout import hf_to_vllm_layout, pack_flat

        if not isinstance(self.engine, CudaWeightSource):
            raise CapabilityError(
                f"weight sync into the sampler's CUDA parameters needs a trainer engine with CUDA "
                f"weights (megatron); {type(self.engine).__name__} has none: use "
                "local.weight_sync=object_store"
            )
        if getattr(self.engine, "hf_weights_on_host", False):  # megatron ranks in other actors
            raise CapabilityError(
                "weight sync into the sampler's CUDA parameters from a megatron trainer of more "
                "than one rank (its ranks are Ray actors of their own, not this process): use "
                "local.weight_sync=object_store"
            )
        hf = self.engine.hf_weights()
        device = next(iter(hf.values())).device
        if group is not None:
            sender = self._senders.get(group)
            if sender is None:
                raise RuntimeError(f"no NCCL weight group {group!r} on this trainer")
            sender.wait_sent()  # the previous buffer is released before a new one is packed
            buffer, entries = pack_flat(hf_to_vllm_layout(hf, layout), device)
            return self.sync_version, sender.send(buffer, entries, self.sync_version)
        self._shared_buffer = None
        self._shared_buffer, entries = pack_flat(hf_to_vllm_layout(hf, layout), device)
        return self.sync_version, make_ipc_weights(self._shared_buffer, entries, self.sync_version)

    def export_adapter(self, root: str) -> tuple[int, AdapterDir]:
        """Bump the sync version and write the current LoRA adapter (PEFT layout) to
        `root/v<version>`, for samplers that load adapters (vLLM LoRA modules)."""
        self.sync_version += 1
        return self.sync_version, self._write_adapter(Path(root) / f"v{self.sync_version:06d}")

    def _write_adapter(self, directory: Path) -> AdapterDir:
        adapter = self.engine.adapter()
        adapter.write_peft(directory, self.model_path)
        nbytes = sum(int(t.nbytes) for t in adapter.tensors.values())
        return AdapterDir(path=str(directory), rank=adapter.rank, nbytes=nbytes)

    def save_state(self, directory: str, meta: CheckpointMeta, with_optimizer: bool = True) -> None:
        with staged(Path(directory)) as path:  # a kill mid-save leaves no half checkpoint
            self.engine.save_state(path, with_optimizer=with_optimizer)
            meta.with_version(self.sync_version).write(path)

    def load_state(self, directory: str, with_optimizer: bool) -> None:
        self.engine.load_state(Path(directory), with_optimizer=with_optimizer)

    def save_sampler_weights(self, directory: str, meta: CheckpointMeta) -> int:
        with staged(Path(directory)) as path:
            self.sync_version += 1
            save_file(self.engine.sampler_weights(), str(path / SAMPLER_WEIGHTS_FILE))
            if self.adapters:  # what a LoRA-serving sampler loads from this checkpoint
                self._write_adapter(path / ADAPTER_DIR)
            meta.with_version(self.sync_version).write(path)
        return self.sync_version


# A sampler that dies (OOM, a crash) is restarted by Ray; clients re-install their weights.
@ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=-1, max_task_retries=0)
class SamplerActor:
    """Hosts one sampler engine (see `engines.base.SamplerEngine`) for one base model."""

    def __init__(self, local: LocalBackendConfig, model_path: str, lora_rank: int = 0) -> None:
        self.engine = make_sampler_engine(local, Path(model_path), lora_rank)
        # Concurrent engines (vllm, torch) batch concurrent requests themselves and are safe to
        # call from many threads; others run one call at a time behind a FIFO lock.
        self.concurrent = isinstance(self.engine, ConcurrentSampler)
        self.lock = asyncio.Lock()

    async def ready(self) -> bool:
        return True

    async def _run(self, fn, *args):
        if self.concurrent:
            return await asyncio.to_thread(fn, *args)
        async with self.lock:
            return await asyncio.to_thread(fn, *args)

    async def weight_layout(self) -> list | None:
        """The engine's parameter layout for CUDA IPC weight sync, or None (numpy sync only)."""
        if not isinstance(self.engine, CudaWeightSink):
            return None
        return await asyncio.to_thread(self.engine.param_layout)

    async def sync_history(self) -> list[dict]:
        """Phase timings of every weight update the engine recorded (empty if it keeps none)."""
        from dataclasses import asdict

        return [asdict(r) for r in self.engine.sync_history]

    async def gpu_uuid(self) -> str | None:
        from oneloop.backends.megatron_local.weight_sync.ipc import gpu_uuid

        return gpu_uuid()

    async def open_weight_group(self, name: str, host: str, port: int) -> str:
        """Join a trainer's NCCL weight group `name` (the trainer opens it at the same time)."""
        if not isinstance(self.engine, CudaWeightSink):
            raise RuntimeError("NCCL weight sync needs local.sampler_engine=vllm")
        return await asyncio.to_thread(self.engine.open_weight_group, name, host, port, 2, 1)

    async def set_weights(self, key: str, payload: tuple[int, dict[str, np.ndarray]]) -> int:
        """Install `payload` as `key` unless a newer version is already there; returns the
        version now installed (weights only move forward)."""
        version, weights = payload
        if self.engine.has_weights(key) and self.engine.version(key) >= version:
            return self.engine.version(key)
        await self._run(self.engine.set_weights, key, weights, version)
        return version

    def _require(self, key: str, min_version: int) -> None:
        if key in self.engine.evicted:
            return  # the engine raises its own clear error
        if not self.engine.has_weights(key) or self.engine.version(key) < min_version:
            raise MissingWeightsError(f"sampler lacks weights {key!r} at version >= {min_version}")

    async def load_weights_from(self, key: str, directory: str) -> int:
        """Install the sampler checkpoint in `directory` as `key` unless it is already there."""
        if self.engine.has_weights(key):
            return self.engine.version(key)
        meta = CheckpointMeta.read(Path(directory))
        adapter = Path(directory) / ADAPTER_DIR
        if self.engine.serves_adapters and adapter.is_dir():
            nbytes = sum(f.stat().st_size for f in adapter.iterdir())
            weights = AdapterDir(str(adapter), meta.lora_rank, nbytes)
        else:
            weights = load_file(str(Path(directory) / SAMPLER_WEIGHTS_FILE))
        await self._run(self.engine.set_weights, key, weights, meta.sync_version)
        return meta.sync_version

    async def drop_weights(self, key: str) -> None:
        await self._run(self.engine.drop_weights, key)

    async def sample(self, key: str, request: SampleRequest, min_version: int = 0) -> SampleOutput:
        self._require(key, min_version)
        if isinstance(self.engine, ConcurrentSampler):
            # No thread per request: the engine's own loop carries them.
            return await asyncio.wrap_future(self.engine.submit_sample(key, request))
        return await self._run(self.engine.sample, key, request)

    async def prompt_logprobs(
        self, key: str, tokens: np.ndarray, min_version: int = 0
    ) -> np.ndarray:
        self._require(key, min_version)
        return await self._run(self.engine.prompt_logprobs, key, tokens)
