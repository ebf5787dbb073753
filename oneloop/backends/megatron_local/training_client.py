"""Front door: the local backend's TrainingClient, a Tinker `TrainingClient` on one trainer actor
(one training run), and the conversion of its requests to the engine's (`datum_to_arrays`) and of
the engine's results back (`forward_output`).

Same method names, signatures and result types (`tinker.types`) as tinker 0.38's; calls return the
SDK's `AwaitableConcurrentFuture`. Requests are validated here, at the edge, and converted to numpy
(`engines.base`) before they reach the actor; the actor runs a model's calls in submission order.
Checkpoints: `checkpoints.py`; publishing weights to the samplers: `publish.py`.
"""

import itertools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from oneloop.backends.megatron_local import losses
from oneloop.backends.megatron_local.checkpoints import (
    CheckpointKind,
    CheckpointMeta,
    TinkerPath,
    check_component,
)
from oneloop.backends.megatron_local.engines.base import DatumArrays, ForwardResult, LoraSpec
from oneloop.backends.megatron_local.futures import chain
from oneloop.backends.megatron_local.lora_serving import serves_adapters
from oneloop.backends.megatron_local.models import load_tokenizer
from oneloop.backends.megatron_local.sampling_client import (
    LocalSamplingClient,
    check_no_stability_info,
    token_ids,
)
from oneloop.errors import CapabilityError, RequestError

if TYPE_CHECKING:
    from oneloop.backends.megatron_local.service_client import LocalServiceClient

ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
ROUTED_EXPERTS = "routed_experts"
"""The loss input that carries a datum's routing for rollout routing replay (R3): int
[positions, MoE layers, top-k] (`Trajectory.to_datum` writes it; the loop keeps it only with
`algo.routing_replay`); a backend that cannot replay refuses it."""


def datum_to_arrays(datum: types.Datum, loss_fn: str, index: int) -> DatumArrays:
    """Validate one datum and convert it to numpy; errors name the field and the datum index."""
    try:
        tokens = token_ids(datum.model_input)
    except Exception as error:
        raise RequestError(
            f"data[{index}].model_input: only token chunks are supported ({error})"
        ) from error
    arrays = {key: value.to_numpy() for key, value in datum.loss_fn_inputs.items()}
    # R3's local extension: the sampler's routed experts ride along as a loss input
    routing = arrays.pop(ROUTED_EXPERTS, None)
    if routing is not None and (routing.ndim != 3 or routing.shape[0] > len(tokens)):
        raise RequestError(
            f"data[{index}].loss_fn_inputs[{ROUTED_EXPERTS!r}]: expected int "
            f"[positions <= {len(tokens)}, MoE layers, top-k], got shape {routing.shape}"
        )
    losses.validate_datum_inputs(loss_fn, len(tokens), arrays, index=index)
    targets = arrays.pop("target_tokens").astype(np.int64)
    inputs = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()}
    return DatumArrays(tokens=tokens, targets=targets, inputs=inputs, routing=routing)


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
        if any(ROUTED_EXPERTS in d.loss_fn_inputs for d in data):
            self._service.capabilities.check(routing_replay=True)
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
        checking the whole batch at once: `serve/codec/fast_scan.py`)."""
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

    def _meta(
        self, kind: CheckpointKind, name: str, user_metadata: dict[str, str] | None = None
    ) -> CheckpointMeta:
        """This run's checkpoint meta; the trainer actor sets `sync_version` when it writes."""
        return CheckpointMeta(
            kind=kind,
            name=name,
            run_id=self.run_id,
            base_model=self.base_model,
            model_dir=str(self._model_dir),
            lora_rank=self.lora.rank,
            train_mlp=self.lora.train_mlp,
            train_attn=self.lora.train_attn,
            train_unembed=self.lora.train_unembed,
            sync_version=0,
            user_metadata=user_metadata,
        )

    def _new_checkpoint(
        self, kind: CheckpointKind, name: str, overwrite: bool
    ) -> tuple[TinkerPath, Path]:
        path = TinkerPath(self.run_id, kind, check_component(name, "name"))
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
        meta = self._meta("weights", name, user_metadata or {})
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
        check_no_stability_info(record_stability_info)
        key = (
            f"inflight:{self.model_id}"
            if kind == "inflight"
            else f"snapshot:{self.model_id}:{next(self._snapshots)}"
        )
        pool = self._service.sampler_pool(self._model_dir)
        publisher = self._service.publisher
        if adapters:
            root = self._service.run_dir / self.run_id / "sampler_adapters"
            payloads = publisher.export_adapter(self._actor, pool, root)
        else:
            payloads = publisher.export_merged(self._actor, pool, self.model_id)
        return chain(
            publisher.install(pool, key, payloads),
            lambda versions: self._service.sampling_client(
                pool, key, self.base_model, self._model_dir, None, min(versions), payloads
            ),
        )

    def create_sampling_client(
        self, model_path: str, retry_config: Any = None, record_stability_info: bool = False
    ) -> AwaitableConcurrentFuture[LocalSamplingClient]:
        check_no_stability_info(record_stability_info)
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
        return load_tokenizer(self._model_dir)
