"""The engine contracts of the local backend: a trainer engine and a sampler engine.

Implementations:
- trainer: `engines.torch.trainer.TorchTrainerEngine` (transformers, CPU/GPU);
  `engines.megatron.trainer.MegatronTrainerEngine` (megatron-core, one rank; its parallel ranks in
  `engines.megatron.parallel`) and `engines.megatron.group.MegatronRayGroup` (drives dp × tp × pp ×
  cp ranks, each a Ray actor).
- sampler: `engines.torch.sampler.TorchSamplerEngine` (transformers generation);
  `engines.vllm.sampler.VllmSamplerEngine` (vLLM `AsyncLLM`).

Optional capabilities are small protocols the actors test with `isinstance`:
- `CudaWeightSource` (trainer): Hugging Face-named CUDA tensors, for weight sync straight into a
  sampler's parameters (megatron engines);
- `CudaWeightSink` (sampler): takes weights into its CUDA parameters, packed to its parameter
  layout and shared over CUDA IPC or received over an NCCL weight group (vllm);
- `ConcurrentSampler` (sampler): any number of threads may call at once and the engine batches
  concurrent requests itself (vllm; torch).

Engines are plain single-process objects; the Ray actors in `actors.py` host them and the clients
give them Tinker's surface. Data crossing the seam is numpy, never tinker types.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch

# `(vLLM parameter name, dtype name, shape)` of every parameter of a sampler, in model order.
ParamLayoutRows = list[tuple[str, str, tuple[int, ...]]]


@dataclass(frozen=True)
class DatumArrays:
    """One training example: `tokens` = model_input, `targets` = target_tokens, `inputs` = rest."""

    tokens: np.ndarray  # int64 [T]
    targets: np.ndarray  # int64 [T]
    inputs: dict[str, np.ndarray]  # float32 [T] each (weights, logprobs, advantages, ...)
    routing: np.ndarray | None = None
    """Rollout routing replay (R3): int [positions <= T, MoE layers, top-k], the experts the
    sampler routed each input position to (`SampledArrays.routed_experts`); None routes freely."""


@dataclass(frozen=True)
class ForwardResult:
    """What a forward(+backward) pass returns: per-datum target logprobs and the summed loss."""

    logprobs: list[np.ndarray]  # float32 [T_i] per datum
    loss: float
    per_datum_loss: list[float]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LoraSpec:
    """LoRA settings of a training model; rank 0 means full fine-tuning."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class LoraAdapter:
    """A trained LoRA adapter in PEFT's layout, for samplers that apply adapters themselves (vLLM
    LoRA modules) instead of merged weights.

    `tensors` use PEFT's names on the Hugging Face model, e.g.
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ([rank, in]) and
    `...lora_B.weight` ([out, rank]); `target_modules` are the HF module suffixes (`q_proj`, ...,
    `lm_head`). The delta on a target's weight is `alpha / rank · B @ A`. `write_peft` stores it as
    a PEFT adapter directory.
    """

    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    tensors: dict[str, np.ndarray]  # float32

    def write_peft(self, directory: Path, base_model_path: str) -> Path:
        """Write `adapter_config.json` + `adapter_model.safetensors` (vLLM's LoRARequest loads
        them)."""
        import json

        from safetensors.numpy import save_file

        directory.mkdir(parents=True, exist_ok=True)
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_path,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": sorted(self.target_modules),
            "fan_in_fan_out": False,
            "modules_to_save": None,
        }
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
        contiguous = {k: np.ascontiguousarray(v) for k, v in self.tensors.items()}
        save_file(contiguous, str(directory / "adapter_model.safetensors"))
        return directory


@dataclass(frozen=True)
class AdapterDir:
    """A LoRA adapter in PEFT layout at `path` (`LoraAdapter.write_peft`): the `set_weights`
    payload of the adapter path. The trainer writes it under the run directory; samplers read it
    (so trainer and samplers share that file system, as checkpoints already require)."""

    path: str
    rank: int
    nbytes: int


@dataclass(frozen=True)
class SampleRequest:
    """One `sample` call, in engine terms."""

    prompt: np.ndarray  # int64 [P]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    include_prompt_logprobs: bool = False


@dataclass(frozen=True)
class SampledArrays:
    """One generated sequence: tokens, their raw (temperature-1) logprobs and why it stopped."""

    tokens: np.ndarray  # int32 [N]
    logprobs: np.ndarray  # float32 [N]
    stop_reason: str  # "stop" | "length"
    routed_experts: np.ndarray | None = None
    """MoE samplers: int16 [prompt + tokens - 1, MoE layers, top-k], the experts each fed
    position was routed to (R3's record; vLLM's `routed_experts` layout); None otherwise."""


@dataclass(frozen=True)
class SampleOutput:
    """All sequences of one request, the weight version they started on, and optional prompt
    logprobs."""

    sequences: list[SampledArrays]
    version: int
    prompt_logprobs: np.ndarray | None = None  # float32 [P], NaN at position 0


class TrainerEngine(ABC):
    """Holds the trainable model and its optimizer. Calls arrive in submission order.

    Contract: gradients accumulate across `forward_backward` calls until `optim_step`, which
    applies AdamW with the given params and zeroes them. Losses are Tinker's (sums over tokens).
    Implementations: see the module docstring.
    """

    @abstractmethod
    def forward_backward(
        self,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardResult:
        """Per-datum target logprobs and loss; also backward (accumulating) unless forward_only."""

    @abstractmethod
    def optim_step(self, adam_params: dict[str, float]) -> dict[str, float]:
        """One AdamW step with `adam_params` (Tinker's AdamParams fields); returns metrics."""

    @abstractmethod
    def sampler_weights(self) -> dict[str, np.ndarray]:
        """Full (LoRA-merged) weights in Hugging Face names, for a sampler of the base model."""

    @abstractmethod
    def adapter(self) -> LoraAdapter:
        """The current LoRA adapter, for samplers that load adapters; raises ValueError on a
        full fine-tuning model (LoRA rank 0), which has none."""

    @abstractmethod
    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        """Write trainable weights (and the optimizer state) into `directory`."""

    @abstractmethod
    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        """Restore what `save_state` wrote (the optimizer only when asked)."""


@runtime_checkable
class CudaWeightSource(Protocol):
    """A trainer engine whose weights live on a CUDA device (the megatron engines): the trainer
    actor packs them into a sampler's parameter layout on that device and shares them over CUDA
    IPC or sends them over NCCL (`weight_sync`), never through host memory."""

    def hf_weights(self) -> "dict[str, torch.Tensor]":
        """Full (LoRA-merged) weights in Hugging Face names, as CUDA tensors of this process."""
        ...


class SamplerEngine(ABC):
    """Generates from token ids on one of several named weight sets ("base", inflight, snapshots).

    Declared state every implementation sets in `__init__` (the sampler actor reads it):
    - `evicted`: weight keys dropped to make room (or replaced); sampling on one raises the
      engine's own error, which names the fix;
    - `serves_adapters`: True when weight sets are LoRA adapters (`set_weights` takes an
      `AdapterDir`) rather than full weights;
    - `sync_history`: one record (a dataclass) per weight update, oldest first; empty when the
      engine keeps none.
    Implementations: see the module docstring.
    """

    evicted: set[str]
    serves_adapters: bool
    sync_history: Sequence[Any]

    @abstractmethod
    def set_weights(self, key: str, weights: Any, version: int) -> None:
        """Install (or replace) the weight set `key` at `version`. `weights` is a dict of Hugging
        Face arrays; engines may take more payloads (an `AdapterDir` when `serves_adapters`;
        CUDA IPC / NCCL descriptors on a `CudaWeightSink`)."""

    @abstractmethod
    def drop_weights(self, key: str) -> None:
        """Forget the weight set `key` (no-op if absent)."""

    @abstractmethod
    def has_weights(self, key: str) -> bool:
        """Whether weight set `key` can be sampled now."""

    @abstractmethod
    def version(self, key: str) -> int:
        """The version weight set `key` was installed at (KeyError when it is not held)."""

    @abstractmethod
    def sample(self, key: str, request: SampleRequest) -> SampleOutput:
        """Generate `request.num_samples` sequences on weight set `key`."""

    @abstractmethod
    def prompt_logprobs(self, key: str, tokens: np.ndarray) -> np.ndarray:
        """Logprob of each token given its prefix (NaN at position 0) on weight set `key`."""


@runtime_checkable
class CudaWeightSink(Protocol):
    """A sampler engine that takes weights straight into its CUDA parameters (vllm): packed to its
    `param_layout` and shared over CUDA IPC (same GPU), or received over an NCCL weight group
    opened with `open_weight_group` (another GPU)."""

    def param_layout(self) -> ParamLayoutRows:
        """`(name, dtype name, shape)` of every engine parameter (pack weights to this)."""
        ...

    def open_weight_group(self, name: str, host: str, port: int, world_size: int, rank: int) -> str:
        """Join a trainer's NCCL weight group `name` as `rank`; returns the engine's GPU UUID."""
        ...


@runtime_checkable
class ConcurrentSampler(Protocol):
    """A sampler engine any number of threads may call at once, batching concurrent requests
    itself (vllm; torch): the actor runs its calls without a lock and awaits `submit_sample`
    instead of holding a thread per request."""

    def submit_sample(self, key: str, request: SampleRequest) -> "Future[SampleOutput]":
        """Like `sample`, but returns a future at once (await it with `asyncio.wrap_future`)."""
        ...
