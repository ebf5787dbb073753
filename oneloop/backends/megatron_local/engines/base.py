"""The two engine contracts of the local backend: a trainer engine and a sampler engine.

Implementations:
- trainer: `torch_trainer.TorchTrainerEngine` (transformers, CPU/GPU); `megatron` (GPU issue).
- sampler: `torch_sampler.TorchSamplerEngine` (transformers generation); `vllm` (GPU issue).

Engines are plain single-process objects; the Ray actors in `actors.py` host them and the clients
in `clients.py` give them Tinker's surface. Data crossing the seam is numpy, never tinker types.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class DatumArrays:
    """One training example: `tokens` = model_input, `targets` = target_tokens, `inputs` = the rest."""

    tokens: np.ndarray  # int64 [T]
    targets: np.ndarray  # int64 [T]
    inputs: dict[str, np.ndarray]  # float32 [T] each (weights, logprobs, advantages, ...)


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


@dataclass(frozen=True)
class SampleOutput:
    """All sequences of one request, the weight version they started on, and optional prompt logprobs."""

    sequences: list[SampledArrays]
    version: int
    prompt_logprobs: np.ndarray | None = None  # float32 [P], NaN at position 0


class TrainerEngine(ABC):
    """Holds the trainable model and its optimizer. Calls arrive in submission order.

    Contract: gradients accumulate across `forward_backward` calls until `optim_step`, which
    applies AdamW with the given params and zeroes them. Losses are Tinker's (sums over tokens).
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
    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        """Write trainable weights (and the optimizer state) into `directory`."""

    @abstractmethod
    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        """Restore what `save_state` wrote (the optimizer only when asked)."""


class SamplerEngine(ABC):
    """Generates from token ids on one of several named weight sets ("base", inflight, snapshots)."""

    @abstractmethod
    def set_weights(self, key: str, weights: dict[str, np.ndarray], version: int) -> None:
        """Install (or replace) the weight set `key` at `version`."""

    @abstractmethod
    def drop_weights(self, key: str) -> None:
        """Forget the weight set `key` (no-op if absent)."""

    @abstractmethod
    def sample(self, key: str, request: SampleRequest) -> SampleOutput:
        """Generate `request.num_samples` sequences on weight set `key`."""

    @abstractmethod
    def prompt_logprobs(self, key: str, tokens: np.ndarray) -> np.ndarray:
        """Logprob of each token given its prefix (NaN at position 0) on weight set `key`."""
