"""The local backend's ServiceClient and TrainingClient (SamplingClient: `sampling.py`): the
Tinker SDK's surface.

Same method names, signatures and result types (`tinker.types`) as tinker 0.38's clients; calls
return the SDK's `AwaitableConcurrentFuture` (awaitable, `.result()`). Requests are validated here,
at the edge, and converted to numpy (`engines.base`) before they reach an actor. A model's trainer
calls are submitted to its Ray actor in call order, so they run in submission order.
"""

import itertools
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import ray
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from oneloop.backends import capabilities as backend_capabilities
from oneloop.backends.capabilities import Capabilities
from oneloop.backends.config import BackendConfig
from oneloop.backends.megatron_local import losses
from oneloop.backends.megatron_local.actors import SamplerActor, TrainerActor
from oneloop.backends.megatron_local.engines.base import (
    DatumArrays,
    ForwardResult,
    LoraSpec,
)
from oneloop.backends.megatron_local.engines.vllm_lora import (
    check_adapter_targets,
    check_pool_fits,
    pool_lora_rank,
    serves_adapters,
)
from oneloop.backends.megatron_local.futures import chain, chain_with_recovery, completed, gather
from oneloop.backends.megatron_local.paths import TinkerPath, check_component
from oneloop.backends.megatron_local.routing import SamplerPool
from oneloop.backends.megatron_local.sampling import (
    RESTART_ATTEMPTS,
    LocalSamplingClient,
    actor_restarts,
    sampler_recoverable,
    token_ids,
)
from oneloop.backends.ray_runtime import init_ray
from oneloop.errors import CapabilityError, RequestError

ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def datum_to_arrays(datum: types.Datum, loss_fn: str, index: int) -> DatumArrays:
    """Validate one datum and convert it to numpy; errors name the field and the datum index."""
    try:
        tokens = token_ids(datum.model_input)
    except Exception as error:
        raise RequestError(f"data[{index}].model_input: only token chunks are supported ({error})")
    arrays = {key: value.to_numpy() for key, value in datum.loss_fn_inputs.items()}
    losses.validate_datum_inputs(loss_fn, len(tokens), arrays, index=index)
    targets = arrays.pop("target_tokens").astype(np.int64)
    inputs = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()}
    return DatumArrays(tokens=tokens, targets=targets, inputs=inputs)


def forward_output(result: ForwardResult) -> types.ForwardBackwardOutput:
    """Engine result → the SDK's ForwardBackwardOutput (metrics keyed `name:reduction`)."""
    return types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[{"logprobs": types.TensorData.from_numpy(lp)} for lp in result.logprobs],
        metrics={"loss:sum": result.loss, **result.metrics},
    )


class LocalTrainingClient:
    """A Tinker TrainingClient on one trainer actor (one training run)."""

    def __init__(
        self,
        service: "LocalServiceClient",
        actor: Any,
        run_id: str,
        base_model: str,
        model_dir: Path,
        lora: LoraSpec,
    ) -> None:
        self._service = service
        self._actor = actor
        self.model_id = run_id
        self.run_id = run_id
        self.base_model = base_model
        self._model_dir = model_dir
        self.lora = lora
        self._snapshots = itertools.count(1)

    # -- training --------------------------------------------------------------------------------

    def _submit_forward(
        self,
        data: list[types.Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None,
        forward_only: bool,
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        return self._submit_arrays(
            lambda: [datum_to_arrays(d, loss_fn, i) for i, d in enumerate(data)],
            len(data), loss_fn, loss_fn_config, forward_only,
        )

    def forward_backward_arrays(
        self,
        arrays: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None,
        forward_only: bool,
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        """`forward_backward` (or `forward`) on datums already in engine form that passed the
        checks of `datum_to_arrays` (`oneloop serve` decodes protobuf bodies straight into them,
        checking the whole batch at once: `serve/proto_scan.py`)."""
        return self._submit_arrays(lambda: arrays, len(arrays), loss_fn, loss_fn_config,
                                   forward_only)  # fmt: skip

    def _submit_arrays(
        self,
        make_arrays: Callable[[], list[DatumArrays]],
        count: int,
        loss_fn: str,
        loss_fn_config: Mapping[str, float | str] | None,
        forward_only: bool,
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        self._service.capabilities.check(loss_fns=[loss_fn])
        config = losses.validate_loss_config(loss_fn, loss_fn_config)
        if not count:
            raise RequestError("data: forward_backward needs at least one datum")
        ref = self._actor.forward_backward.remote(make_arrays(), loss_fn, config, forward_only)
        return chain(ref, forward_output)

    def forward(
        self,
        data: list[types.Datum],
        loss_fn: types.LossFnType,
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        return self._submit_forward(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(
        self,
        data: list[types.Datum],
        loss_fn: types.LossFnType,
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        return self._submit_forward(data, loss_fn, loss_fn_config, forward_only=False)

    def optim_step(
        self,
        optim_params: types.AdamParams | None = None,
        *,
        adam_params: types.AdamParams | None = None,
    ) -> AwaitableConcurrentFuture[types.OptimStepResponse]:
        if optim_params is not None and adam_params is not None:
            raise RequestError("optim_step: pass optim_params or adam_params, not both")
        params = optim_params if optim_params is not None else adam_params
        if params is None:
            raise RequestError("optim_step: AdamParams are required")
        if not isinstance(params, types.AdamParams):
            raise CapabilityError(
                f"optim_step: the local backend implements AdamW only, got {type(params).__name__}"
            )
        values = {name: float(getattr(params, name)) for name in ADAM_FIELDS}
        for name, value in values.items():
            if not np.isfinite(value) or value < 0:
                raise RequestError(f"adam_params.{name}: must be a finite number >= 0, got {value}")
        ref = self._actor.optim_step.remote(values)
        return chain(ref, lambda metrics: types.OptimStepResponse(metrics=metrics))

    # -- checkpoints -----------------------------------------------------------------------------

    def _meta(self, kind: str, name: str) -> dict:
        return {
            "kind": kind,
            "name": name,
            "run_id": self.run_id,
            "base_model": self.base_model,
            "model_dir": str(self._model_dir),
            "lora_rank": self.lora.rank,
            "train_mlp": self.lora.train_mlp,
            "train_attn": self.lora.train_attn,
            "train_unembed": self.lora.train_unembed,
        }

    def _new_checkpoint(self, kind: str, name: str, overwrite: bool) -> tuple[TinkerPath, Path]:
        path = TinkerPath(self.run_id, kind, check_component(name, "name"))  # type: ignore[arg-type]
        directory = path.directory(self._service.run_dir)
        if directory.exists() and not overwrite:
            raise RequestError(f"name: checkpoint {path} already exists (pass overwrite=True)")
        directory.mkdir(parents=True, exist_ok=True)
        return path, directory

    def save_state(
        self,
        name: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> AwaitableConcurrentFuture[types.SaveWeightsResponse]:
        path, directory = self._new_checkpoint("weights", name, overwrite)
        meta = {**self._meta("weights", name), "user_metadata": user_metadata or {}}
        ref = self._actor.save_state.remote(str(directory), meta, True)
        return chain(ref, lambda _: types.SaveWeightsResponse(path=str(path)))

    def load_state(self, path: str) -> AwaitableConcurrentFuture[None]:
        return self._load(path, with_optimizer=False)

    def load_state_with_optimizer(self, path: str) -> AwaitableConcurrentFuture[None]:
        return self._load(path, with_optimizer=True)

    def _load(self, path: str, with_optimizer: bool) -> AwaitableConcurrentFuture[None]:
        directory = TinkerPath.parse(path).existing_directory(self._service.run_dir)
        return chain(self._actor.load_state.remote(str(directory), with_optimizer), lambda _: None)

    def save_weights_for_sampler(
        self, name: str, ttl_seconds: int | None = None, user_metadata: dict[str, str] | None = None
    ) -> AwaitableConcurrentFuture[types.SaveWeightsForSamplerResponse]:
        path, directory = self._new_checkpoint("sampler_weights", name, overwrite=True)
        ref = self._actor.save_sampler_weights.remote(
            str(directory), self._meta("sampler_weights", name)
        )
        return chain(ref, lambda _: types.SaveWeightsForSamplerResponse(path=str(path)))

    def save_weights_and_get_sampling_client(
        self,
        name: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
        kind: types.SamplingClientKind = "snapshot",
    ) -> AwaitableConcurrentFuture[LocalSamplingClient]:
        """Publish the current weights to the sampler and return a client on them.

        `inflight`: one mutable weight set per training model, shared by all its inflight clients;
        each returned client is a fresh namespace. `snapshot`: a fixed weight set kept in the
        sampler's memory (at most `local.max_snapshots`; older ones fail clearly when used).
        LoRA runs on the vllm sampler publish the adapter (a vLLM LoRA module per key and
        version, so both kinds work there); everything else publishes merged weights.
        """
        adapters = serves_adapters(self._service.config.local.sampler_engine, self.lora.rank)
        if not adapters:  # the table's vllm row (one live weight set) is for merged weights
            self._service.capabilities.check(sampler_kind=kind)
        if record_stability_info:
            raise CapabilityError("record_stability_info is not supported by the local backend")
        key = (
            f"inflight:{self.model_id}"
            if kind == "inflight"
            else f"snapshot:{self.model_id}:{next(self._snapshots)}"
        )
        pool = self._service.sampler_pool(self._model_dir)
        payloads = self._export_adapter(pool) if adapters else self._export_for(pool)
        # Every sampler of the pool gets the weights; one restarting meanwhile is waited for (as
        # sampling clients do). The client is ready when all have them.
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
        return chain(
            gather(installed),
            lambda versions: self._service.sampling_client(
                pool, key, self.base_model, self._model_dir, None, min(versions), payloads
            ),
        )

    def _export_adapter(self, pool: SamplerPool) -> list[Any]:
        """One adapter version written under the run directory; every sampler loads that file."""
        root = self._service.run_dir / self.run_id / "sampler_adapters"
        return [self._actor.export_adapter.remote(str(root))] * len(pool.actors)

    def _export_for(self, pool: SamplerPool) -> list[Any]:
        """One weight version for every sampler of `pool`: an ObjectRef per sampler. Samplers
        reached through the object store or CUDA IPC share one export; each NCCL sampler gets its
        own send of the same version over its own weight group."""
        shared, payloads, bump = None, [], True
        for index, sampler in enumerate(pool.actors):
            name = f"{self.model_id}:{index}"
            layout, group = self._service.sync_plan(sampler, self._actor, name)
            if group is None:
                if shared is None:
                    shared = self._actor.export_sampler_weights.remote(layout, None, bump)
                    bump = False
                payloads.append(shared)
            else:
                payloads.append(self._actor.export_sampler_weights.remote(layout, group, bump))
                bump = False
        return payloads

    def create_sampling_client(
        self, model_path: str, retry_config: Any = None, record_stability_info: bool = False
    ) -> AwaitableConcurrentFuture[LocalSamplingClient]:
        return self._service.create_sampling_client(model_path=model_path)

    # -- info ------------------------------------------------------------------------------------

    def get_info(self) -> types.GetInfoResponse:
        return types.GetInfoResponse(
            model_id=self.model_id,
            model_data=types.ModelData(
                arch="qwen3", model_name=self.base_model, tokenizer_id=str(self._model_dir)
            ),
            is_lora=self.lora.rank > 0,
            lora_rank=self.lora.rank or None,
            model_name=self.base_model,
        )

    def get_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self._model_dir))


class LocalServiceClient:
    """A Tinker ServiceClient on a Ray cluster of our engines (`connect(BackendConfig(backend="local"))`)."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.run_dir = config.run_dir.resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.capabilities: Capabilities = backend_capabilities(config)
        init_ray(
            address=config.local.ray_address,
            num_cpus=config.local.ray_num_cpus,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
        self._samplers: dict[str, SamplerPool] = {}
        self._layouts: dict[Any, Any] = {}
        self._groups: set[tuple[Any, Any, str]] = set()  # NCCL weight groups opened
        self._sampler_info: dict[str, tuple[tuple[int, ...], int]] = {}
        self._pool_lora: dict[str, int] = {}  # LoRA rank each model's vllm samplers serve
        self._trainers: list[Any] = []

    # -- models ----------------------------------------------------------------------------------

    def resolve_model(self, base_model: str) -> Path:
        """A base-model name → its local Hugging Face directory (config.models, tiny, or a path)."""
        if base_model in self.config.models:
            return self.config.models[base_model].resolve()
        from oneloop.tiny_model import TINY_MODEL_NAME, build_tiny_model, named_tiny_specs

        if base_model in named_tiny_specs():
            return build_tiny_model(named_tiny_specs()[base_model])
        if Path(base_model).is_dir():
            return Path(base_model).resolve()
        raise CapabilityError(
            f"base_model={base_model!r} is not known to the local backend: add it under "
            f"backend.models (name: local HF directory), use {TINY_MODEL_NAME!r}, or pass a path"
        )

    def sampler_pool(self, model_dir: Path, lora_rank: int | None = None) -> SamplerPool:
        """The sampler actors of one base model (`local.samplers_per_model`), started on first
        use, behind a session-affine router. `lora_rank`: the training client's rank (None for
        sampling only); a vllm pool starts with LoRA for it, or must already serve it."""
        key = str(model_dir)
        local = self.config.local
        capacity = self._pool_capacity(key, lora_rank)
        if key not in self._samplers:
            self._pool_lora[key] = capacity
            actors = [
                SamplerActor.options(num_gpus=local.gpus_per_sampler).remote(local, key, capacity)
                for _ in range(local.samplers_per_model)
            ]
            self._samplers[key] = SamplerPool(actors)
            from transformers import AutoConfig, GenerationConfig

            eos = GenerationConfig.from_pretrained(key).eos_token_id
            eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
            context = int(AutoConfig.from_pretrained(key).max_position_embeddings)
            self._sampler_info[key] = (eos_ids, context)
        return self._samplers[key]

    def _pool_capacity(self, key: str, lora_rank: int | None) -> int:
        """The LoRA rank model `key`'s samplers serve (or will, if not started); raises when a
        client of `lora_rank` cannot use them (`vllm_lora.check_pool_fits`)."""
        local = self.config.local
        capacity = self._pool_lora.get(key)
        if capacity is None:
            capacity = pool_lora_rank(local.sampler_engine, local.vllm.max_lora_rank, lora_rank)
        check_pool_fits(local.sampler_engine, key, capacity, lora_rank)
        return capacity

    def _sampler_actors(self) -> list[Any]:
        return [a for pool in list(self._samplers.values()) for a in pool.actors]  # a snapshot

    def sync_plan(self, sampler: Any, trainer: Any, name: str) -> tuple[Any, str | None]:
        """How `trainer` exports weights for `sampler` (`local.weight_sync`): `(None, None)` =
        numpy through the object store; `(layout ref, None)` = CUDA IPC in the sampler's parameter
        layout (same GPU); `(layout ref, group)` = NCCL over weight group `group`, opened here on
        first use (another GPU). `auto` picks by comparing the two actors' GPU UUIDs."""
        local = self.config.local
        mode = local.weight_sync
        cuda_trainer = local.trainer_engine == "megatron" or local.device == "cuda"
        if mode == "object_store" or (
            mode == "auto" and not (local.sampler_engine == "vllm" and cuda_trainer)
        ):
            return None, None
        if local.sampler_engine != "vllm":
            raise CapabilityError(f"local.weight_sync={mode} needs local.sampler_engine=vllm")
        if sampler not in self._layouts:
            self._layouts[sampler] = sampler.weight_layout.remote()
        if mode == "auto":
            # The sampler answers once its engine is up (vLLM start: compile + CUDA graphs).
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
        from oneloop.tiny_model import named_tiny_specs

        names = sorted({*self.config.models, *named_tiny_specs()})
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
        actor = TrainerActor.options(num_gpus=local.gpus_per_trainer).remote(
            local, str(model_dir), lora
        )
        self._trainers.append(actor)
        return actor, run_id or f"run-{uuid.uuid4().hex[:12]}"

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
        """rank > 0 trains LoRA adapters; rank == 0 is full fine-tuning (a local-backend extension)."""
        if optimizer is not None and not isinstance(optimizer, types.AdamOptimizerConfig):
            raise CapabilityError("optimizer: the local backend implements AdamW only")
        if not (train_mlp or train_attn or train_unembed):
            raise RequestError("at least one of train_mlp, train_attn, train_unembed must be True")
        lora = LoraSpec(rank, seed, train_mlp, train_attn, train_unembed)
        self.capabilities.check(lora_rank=rank)
        model_dir = self.resolve_model(base_model)
        actor, run_id = self._start_trainer(base_model, model_dir, lora)
        self.sampler_pool(model_dir, lora.rank)
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
        import json

        meta = json.loads((directory / "meta.json").read_text())
        lora = LoraSpec(
            meta["lora_rank"], None, meta["train_mlp"], meta["train_attn"], meta["train_unembed"]
        )
        model_dir = Path(meta["model_dir"])
        actor, run_id = self._start_trainer(meta["base_model"], model_dir, lora)
        self.sampler_pool(model_dir, lora.rank)
        loaded = actor.load_state.remote(str(directory), with_optimizer)
        return chain(
            loaded,
            lambda _: LocalTrainingClient(self, actor, run_id, meta["base_model"], model_dir, lora),
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
        if model_path is None and base_model is None:
            raise RequestError("create_sampling_client: pass model_path or base_model")
        if model_path is None:
            assert base_model is not None
            model_dir = self.resolve_model(base_model)
            pool = self.sampler_pool(model_dir)
            return completed(self.sampling_client(pool, "base", base_model, model_dir, None, 0))
        parsed = TinkerPath.parse(model_path)
        directory = parsed.existing_directory(self.run_dir)
        import json

        meta = json.loads((directory / "meta.json").read_text())
        if parsed.kind == "weights":
            raise RequestError(
                f"model_path: {model_path} holds training state; sample from a "
                "save_weights_for_sampler path (tinker://<run>/sampler_weights/<name>)"
            )
        model_dir = Path(meta["model_dir"])
        pool = self.sampler_pool(model_dir)
        key = f"path:{parsed}:{meta['sync_version']}"
        loaded = [actor.load_weights_from.remote(key, str(directory)) for actor in pool.actors]
        return chain(
            gather([chain(ref, lambda version: version) for ref in loaded]),
            lambda versions: self.sampling_client(
                pool, key, meta["base_model"], model_dir, model_path, min(versions), str(directory)
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
        for actor in [*self._trainers, *self._sampler_actors()]:
            ray.kill(actor)
        self._trainers.clear()
        self._samplers.clear()
        self._pool_lora.clear()
        return completed(None)
