"""What each backend can do, and the check that turns an unsupported knob into an error up front.

A knob a backend cannot honour is a `CapabilityError` naming the knob before a run starts, never a
silent no-op. `tinker_remote` refines its row with the server's `get_server_capabilities` answer.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

from oneloop.errors import CapabilityError

# Tinker's built-in losses that both backends implement with the same (sum) definitions.
BUILTIN_LOSSES = frozenset({"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"})
# SDK 0.38's built-ins that only the Tinker service computes: its objective is not published, so
# the local backend refuses it with the reason (`megatron_local.losses.UNSUPPORTED_BUILTINS`).
SERVICE_ONLY_LOSSES = frozenset({"stable_reinforce"})
ROUTING_REPLAY_SUPPORT = (
    "it needs the local backend with the torch trainer and torch sampler engines (a Tinker "
    "service returns no routed experts and cannot replay them; megatron / vllm: not yet)"
)


@dataclass(frozen=True)
class Capabilities:
    """One backend's supported knobs."""

    backend: str
    losses: frozenset[str]
    sampler_kinds: frozenset[str]
    lora: bool
    full_finetune: bool
    max_lora_rank: int
    sampled_logprobs: bool = True
    """Whether `sample` returns per-token logprobs of sampled tokens."""
    models: frozenset[str] = field(default_factory=frozenset)
    """Known base models; empty = not enumerable (any name is tried)."""
    full_finetune_sampler_kinds: frozenset[str] | None = None
    """Sampler kinds of full fine-tuning runs when fewer than `sampler_kinds` (None = the same)."""
    routing_replay: bool = False
    """Rollout routing replay (R3) on MoE models: samples carry the experts each token was routed
    to and training replays them (`algo.routing_replay`)."""

    def check(
        self,
        *,
        loss_fns: Iterable[str] = (),
        sampler_kind: str | None = None,
        lora_rank: int | None = None,
        base_model: str | None = None,
        routing_replay: bool = False,
    ) -> None:
        """Raise CapabilityError naming the first knob this backend cannot honour."""
        if routing_replay and not self.routing_replay:
            raise CapabilityError(
                f"routing replay (R3) is not supported by backend {self.backend!r}: "
                + ROUTING_REPLAY_SUPPORT
            )
        for loss_fn in loss_fns:
            if loss_fn not in self.losses:
                raise CapabilityError(
                    f"loss_fn={loss_fn!r} is not supported by backend {self.backend!r}; "
                    f"supported: {sorted(self.losses)}"
                )
        if sampler_kind is not None and sampler_kind not in self.sampler_kinds:
            raise CapabilityError(
                f"sampler kind {sampler_kind!r} is not supported by backend {self.backend!r}; "
                f"supported: {sorted(self.sampler_kinds)}"
            )
        full_kinds = self.full_finetune_sampler_kinds
        if sampler_kind is not None and lora_rank == 0 and full_kinds is not None:
            if sampler_kind not in full_kinds:
                raise CapabilityError(
                    f"sampler kind {sampler_kind!r} of a full fine-tuning run (lora_rank=0) is not "
                    f"supported by backend {self.backend!r}; supported: {sorted(full_kinds)} "
                    f"(LoRA runs: {sorted(self.sampler_kinds)})"
                )
        if lora_rank is not None:
            if lora_rank < 0:
                raise CapabilityError(
                    f"lora_rank must be >= 0 (0 = full fine-tuning), got {lora_rank}"
                )
            if lora_rank == 0 and not self.full_finetune:
                raise CapabilityError(
                    f"lora_rank=0 (full fine-tuning) is not supported by backend {self.backend!r}"
                )
            if lora_rank > 0 and not self.lora:
                raise CapabilityError(f"LoRA is not supported by backend {self.backend!r}")
            if lora_rank > self.max_lora_rank:
                raise CapabilityError(
                    f"lora_rank={lora_rank} exceeds backend {self.backend!r}'s maximum "
                    f"{self.max_lora_rank}"
                )
        if base_model is not None and self.models and base_model not in self.models:
            raise CapabilityError(
                f"base_model={base_model!r} is not offered by backend {self.backend!r}; "
                f"offered: {sorted(self.models)}"
            )


def local_capabilities(
    max_lora_rank: int,
    models: Iterable[str] = (),
    trainer_engine: str = "torch",
    sampler_engine: str = "torch",
    megatron_tp_only: bool = True,
    vllm_routed_experts: bool | None = None,
) -> Capabilities:
    """The local Ray backend: every built-in loss; both sampler kinds and LoRA with the torch
    engines. The vllm engine holds one live set of full weights, so full fine-tuning runs get
    `inflight` clients only (a snapshot would evict the weights in-flight clients sample from);
    LoRA runs on vllm get both, each version being its own LoRA module (`lora_serving`). The
    megatron engine trains LoRA at any TP size (`megatron.parallel.lora_tp`) but not with pipeline
    or context parallelism (`megatron.group` refuses it): `megatron_tp_only` is false when pp or
    cp > 1.
    `vllm_routed_experts` is `local.vllm.return_routed_experts` (false: no R3 record on vllm)."""
    return Capabilities(
        backend="local",
        losses=BUILTIN_LOSSES,
        sampler_kinds=frozenset({"snapshot", "inflight"}),
        full_finetune_sampler_kinds=frozenset({"inflight"}) if sampler_engine == "vllm" else None,
        lora=trainer_engine != "megatron" or megatron_tp_only,
        full_finetune=True,
        max_lora_rank=max_lora_rank,
        models=frozenset(models),
        # R3: both trainer engines replay; the torch sampler records, and so does vllm unless
        # `local.vllm.return_routed_experts` is false
        routing_replay=trainer_engine in ("torch", "megatron")
        and (sampler_engine == "torch" or vllm_routed_experts is not False),
    )


# Thinking Machines' service as documented for SDK 0.38: LoRA only; rank 128 is the largest it
# documents. `tinker_remote` narrows `models` from the server's own answer.
TINKER_SERVICE = Capabilities(
    backend="tinker",
    losses=BUILTIN_LOSSES | SERVICE_ONLY_LOSSES,
    sampler_kinds=frozenset({"snapshot", "inflight"}),
    lora=True,
    full_finetune=False,
    max_lora_rank=128,
)
