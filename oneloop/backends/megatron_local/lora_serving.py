"""The LoRA serving policy of the local backend: how a LoRA run's weights reach its samplers.

Decided without vLLM (CPU-tested; the clients and actors call it before any engine starts):
- whether a training client's weights go to the samplers as an adapter (`serves_adapters`): LoRA
  runs (rank > 0) on `sampler_engine=vllm`; full fine-tuning and the torch sampler keep merged
  weights;
- which adapter layouts the vLLM sampler can serve (`check_adapter_targets`);
- the LoRA capacity a vLLM engine starts with (`pool_lora_rank`) and the check that a later client
  fits an engine already started (`check_pool_fits`).
What vLLM itself accepts (ranks, engine arguments) and the engine's adapter books are
`engines/vllm/lora.py`.
"""

from oneloop.backends.megatron_local.engines.vllm.lora import VLLM_LORA_RANKS, vllm_lora_rank
from oneloop.errors import CapabilityError


def serves_adapters(sampler_engine: str, lora_rank: int) -> bool:
    """Whether a training client's sampler weights travel as a LoRA adapter (else merged)."""
    return sampler_engine == "vllm" and lora_rank > 0


def check_adapter_targets(train_mlp: bool, train_attn: bool, train_unembed: bool) -> None:
    """Refuse a LoRA layout the vLLM sampler cannot serve, before the trainer starts."""
    if train_unembed:
        raise CapabilityError(
            "train_unembed=True: local.sampler_engine=vllm serves LoRA runs as vLLM LoRA modules, "
            "and vLLM 0.26's lm_head LoRA is not verified against the trainer (it loads and "
            "changes logprobs; parity on tied embeddings is untested); create the training client "
            "with train_unembed=False (loop: model.train_unembed=false), or use "
            "local.sampler_engine=torch"
        )
    if not (train_mlp or train_attn):
        raise CapabilityError("LoRA on vllm needs train_mlp or train_attn")


def pool_lora_rank(sampler_engine: str, configured: int | None, lora_rank: int | None) -> int:
    """The `max_lora_rank` a new sampler engine starts with (0 = LoRA off).

    `configured` is `local.vllm.max_lora_rank` (None = from the first client); `lora_rank` is the
    rank of the client starting the engine (None for a sampling-only client, 0 = full FT)."""
    if sampler_engine != "vllm":
        return 0
    if configured is not None:
        return configured
    return vllm_lora_rank(lora_rank) if lora_rank else 0


def check_pool_fits(sampler_engine: str, model: str, capacity: int, lora_rank: int | None) -> None:
    """Raise when a client of `lora_rank` cannot use a vLLM engine started with LoRA `capacity`
    (torch samplers take merged weights of any run)."""
    if sampler_engine != "vllm" or lora_rank is None:  # None: sampling only, any engine serves
        return
    if lora_rank == 0 and capacity > 0:
        raise CapabilityError(
            f"full fine-tuning (rank 0) of {model}: its vllm sampler serves LoRA adapters "
            f"(max_lora_rank={capacity}) and takes no full-weight updates; do not mix full "
            "fine-tuning and LoRA runs of one base model on vllm (or unset "
            "backend.local.vllm.max_lora_rank)"
        )
    if lora_rank > capacity:
        started = "without LoRA" if capacity == 0 else f"with max_lora_rank={capacity}"
        raise CapabilityError(
            f"lora rank {lora_rank} on {model}: its vllm sampler was started {started} by an "
            f"earlier client; set backend.local.vllm.max_lora_rank >= {lora_rank} (one of "
            f"{list(VLLM_LORA_RANKS)}) so the engine starts ready for it"
        )
