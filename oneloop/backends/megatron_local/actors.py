"""Ray actors hosting the engines: a trainer actor per training model, a sampler per base model.

The trainer actor is a plain (single-threaded) actor, so a model's calls run in submission order.
The sampler actor is an async actor: many `sample` calls queue at once while one engine call runs in
a worker thread behind a FIFO lock, so weight updates take effect between requests and the actor's
event loop never blocks. Weights travel trainer → sampler through the Ray object store (numpy
arrays, zero-copy on the reading side); each sync bumps the trainer's version.
"""

import asyncio
import json
from pathlib import Path

import numpy as np
import ray
from safetensors.numpy import load_file, save_file

from oneloop.backends.megatron_local.engines.base import (
    DatumArrays,
    ForwardResult,
    LoraSpec,
    SampleOutput,
    SampleRequest,
)
from oneloop.backends.megatron_local.paths import META_FILE

SAMPLER_WEIGHTS_FILE = "model.safetensors"


def write_meta(directory: Path, meta: dict) -> None:
    """Write the checkpoint's meta last, atomically: its presence marks a complete checkpoint."""
    tmp = directory / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
    tmp.replace(directory / META_FILE)


@ray.remote(num_cpus=0)
class TrainerActor:
    """Hosts one trainer engine (see `engines.base.TrainerEngine`)."""

    def __init__(self, engine_kind: str, model_path: str, lora: LoraSpec, options: dict) -> None:
        if engine_kind != "torch":
            raise ValueError(
                f"local.trainer_engine={engine_kind!r} needs the GPU engines (oneloop[gpu]); "
                "only 'torch' is available in this install"
            )
        from oneloop.backends.megatron_local.engines.torch_trainer import TorchTrainerEngine

        self.engine = TorchTrainerEngine(Path(model_path), lora, **options)
        self.sync_version = 0

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

    def export_sampler_weights(self) -> tuple[int, dict[str, np.ndarray]]:
        """Bump the sync version and return it with the full sampler weights."""
        self.sync_version += 1
        return self.sync_version, self.engine.sampler_weights()

    def save_state(self, directory: str, meta: dict, with_optimizer: bool = True) -> None:
        path = Path(directory)
        self.engine.save_state(path, with_optimizer=with_optimizer)
        write_meta(path, {**meta, "sync_version": self.sync_version})

    def load_state(self, directory: str, with_optimizer: bool) -> None:
        self.engine.load_state(Path(directory), with_optimizer=with_optimizer)

    def save_sampler_weights(self, directory: str, meta: dict) -> int:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.sync_version += 1
        save_file(self.engine.sampler_weights(), str(path / SAMPLER_WEIGHTS_FILE))
        write_meta(path, {**meta, "sync_version": self.sync_version})
        return self.sync_version


class MissingWeightsError(RuntimeError):
    """The sampler lacks the weights a client needs (it restarted, or they were replaced by older
    ones after a restart); the client re-installs its own and retries."""


# A sampler that dies (OOM, a crash) is restarted by Ray; clients re-install their weights.
@ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=-1, max_task_retries=0)
class SamplerActor:
    """Hosts one sampler engine (see `engines.base.SamplerEngine`) for one base model."""

    def __init__(self, engine_kind: str, model_path: str, options: dict) -> None:
        if engine_kind != "torch":
            raise ValueError(
                f"local.sampler_engine={engine_kind!r} needs the GPU engines (oneloop[gpu]); "
                "only 'torch' is available in this install"
            )
        from oneloop.backends.megatron_local.engines.torch_sampler import TorchSamplerEngine

        self.engine = TorchSamplerEngine(Path(model_path), **options)
        self.lock = asyncio.Lock()

    async def ready(self) -> bool:
        return True

    async def _run(self, fn, *args):
        async with self.lock:
            return await asyncio.to_thread(fn, *args)

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
        meta = json.loads((Path(directory) / META_FILE).read_text())
        weights = load_file(str(Path(directory) / SAMPLER_WEIGHTS_FILE))
        await self._run(self.engine.set_weights, key, weights, int(meta["sync_version"]))
        return int(meta["sync_version"])

    async def drop_weights(self, key: str) -> None:
        await self._run(self.engine.drop_weights, key)

    async def sample(self, key: str, request: SampleRequest, min_version: int = 0) -> SampleOutput:
        self._require(key, min_version)
        return await self._run(self.engine.sample, key, request)

    async def prompt_logprobs(
        self, key: str, tokens: np.ndarray, min_version: int = 0
    ) -> np.ndarray:
        self._require(key, min_version)
        return await self._run(self.engine.prompt_logprobs, key, tokens)
