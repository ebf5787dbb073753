"""Builds the engine a `local` backend config names; the only place that maps names to classes.

GPU engines are imported lazily, so a CPU install never imports megatron-core or vLLM.
"""

from pathlib import Path

from oneloop.backends.config import LocalBackendConfig, VllmSettings
from oneloop.backends.megatron_local.engines.base import LoraSpec, SamplerEngine, TrainerEngine
from oneloop.errors import ConfigError, MissingDependencyError


def missing_gpu_extra(knob: str, kind: str, error: ImportError) -> MissingDependencyError:
    """The error for a GPU engine named in config whose package (vLLM, megatron-core) is missing."""
    return MissingDependencyError(
        f"local.{knob}={kind!r} needs the GPU engines: install oneloop[gpu] on a CUDA host "
        f"(import failed: {error})"
    )


def make_trainer_engine(
    local: LocalBackendConfig, model_path: Path, lora: LoraSpec
) -> TrainerEngine:
    """The trainer engine `local.trainer_engine` on `model_path` with `lora`."""
    common = {
        "dtype": local.dtype,
        "threads": local.torch_threads,
        "max_tokens_per_microbatch": local.max_tokens_per_microbatch,
    }
    if local.trainer_engine == "torch":
        from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine

        return TorchTrainerEngine(model_path, lora, device=local.device, **common)
    from oneloop.backends.megatron_local.engines.megatron.parallel.pp_plan import (
        check_gpus_per_trainer,
        group_size,
        resolve_dp,
    )

    m = local.megatron
    dp = resolve_dp(m.dp, local.gpus_per_trainer, m.tp, m.pp, m.cp)
    check_gpus_per_trainer(local.gpus_per_trainer, m.tp, m.pp, m.cp, dp=dp)
    try:
        import megatron.core  # noqa: F401

        from oneloop.backends.megatron_local.engines.megatron.trainer import (
            MegatronTrainerEngine,
        )
    except ImportError as error:
        raise missing_gpu_extra("trainer_engine", local.trainer_engine, error) from error
    from oneloop.backends.megatron_local.engines.megatron.moe import MoeSettings
    from oneloop.backends.megatron_local.engines.megatron.speed import MegatronSpeed

    parallel = megatron_parallel(local)
    common["speed"] = MegatronSpeed(**m.speed.model_dump())
    common["moe"] = MoeSettings(
        aux_loss_coeff=m.moe_aux_loss_coeff, z_loss_coeff=m.moe_z_loss_coeff
    )
    if group_size(m.tp, m.pp, m.cp, dp) > 1:  # one Ray actor per rank, in a placement group
        from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup

        return MegatronRayGroup(
            model_path,
            lora,
            device="cuda",
            parallel=parallel,
            placement_strategy=m.placement_strategy,
            **common,
        )
    return MegatronTrainerEngine(model_path, lora, device="cuda", parallel=parallel, **common)


def megatron_parallel(local: LocalBackendConfig):
    """The megatron engine's `MegatronParallel` from `local.megatron` (dp resolved:
    `parallel.pp_plan.resolve_dp`)."""
    from oneloop.backends.megatron_local.engines.megatron.parallel.pp_plan import resolve_dp
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel

    m = local.megatron
    dp = resolve_dp(m.dp, local.gpus_per_trainer, m.tp, m.pp, m.cp)
    moe = {"moe_aux_loss_coeff", "moe_z_loss_coeff"}
    exclude = {"speed", "placement_strategy", "dp", *moe}
    return MegatronParallel(**m.model_dump(exclude=exclude), dp=dp)


def trainer_actor_gpus(local: LocalBackendConfig) -> float:
    """GPUs the trainer actor itself reserves: `local.gpus_per_trainer`, except for a megatron
    group of more than one rank, whose rank actors hold the GPUs (one each, in their placement
    group) while the trainer actor that drives them holds none."""
    if local.trainer_engine != "megatron":
        return local.gpus_per_trainer
    from oneloop.backends.megatron_local.engines.megatron.parallel.pp_plan import (
        group_size,
        resolve_dp,
    )

    m = local.megatron
    dp = resolve_dp(m.dp, local.gpus_per_trainer, m.tp, m.pp, m.cp)
    return 0.0 if group_size(m.tp, m.pp, m.cp, dp) > 1 else local.gpus_per_trainer


def make_sampler_engine(
    local: LocalBackendConfig, model_path: Path, lora_rank: int = 0
) -> SamplerEngine:
    """The sampler engine `local.sampler_engine` on `model_path` (its base weights); a vllm engine
    serves LoRA adapters up to `lora_rank` (`lora_serving.pool_lora_rank`; 0 = LoRA off)."""
    if local.sampler_engine == "torch":
        from oneloop.backends.megatron_local.engines.torch.sampler import TorchSamplerEngine

        return TorchSamplerEngine(
            model_path,
            dtype=local.dtype,
            threads=local.torch_threads,
            max_snapshots=local.max_snapshots,
            device=local.device,
        )
    try:
        import vllm  # noqa: F401

        from oneloop.backends.megatron_local.engines.vllm.sampler import VllmSamplerEngine
    except ImportError as error:
        raise missing_gpu_extra("sampler_engine", local.sampler_engine, error) from error
    from oneloop.backends.megatron_local.engines.vllm.lora import lora_serving

    dtype = "bfloat16" if local.dtype == "bfloat16" else "float32"
    settings = local.vllm.model_dump(exclude={"max_lora_rank", "max_loras", "max_cpu_loras"})
    settings["return_routed_experts"] = vllm_routed_experts(local.vllm, model_path)
    v = local.vllm
    lora = lora_serving(lora_rank, v.max_loras, v.max_cpu_loras, local.max_snapshots)
    return VllmSamplerEngine(
        model_path,
        dtype=dtype,
        lora=lora,
        max_snapshots=local.max_snapshots,
        extra_engine_args=vllm_model_args(model_path),
        **settings,
    )


def vllm_model_args(model_path: Path) -> dict:
    """vLLM engine arguments the model at `model_path` needs (measured with vLLM 0.26 on the
    device): a multimodal checkpoint (Qwen3.5 / 3.6) is served text-only (`language_model_only`:
    we train and sample the language model), and Gated DeltaNet layers prefill with vLLM's Triton
    kernel where FlashInfer is not installed (vLLM's `auto` picks FlashInfer's on SM90 and fails
    without it)."""
    import importlib.util

    from oneloop.backends.model_check import model_config

    config = model_config({}, str(model_path))  # top-level fields and the text model's
    if config is None:
        return {}
    args: dict = {}
    if "vision_config" in config:
        args["language_model_only"] = True
    linear = "linear_attention" in (config.get("layer_types") or ())
    if linear and importlib.util.find_spec("flashinfer") is None:
        args["additional_config"] = {"gdn_prefill_backend": "triton"}
    return args


def vllm_routed_experts(settings: VllmSettings, model_path: Path) -> bool:
    """`local.vllm.return_routed_experts` for the model at `model_path`: None → on for a
    mixture-of-experts model; true on a dense model is refused (there is nothing to record)."""
    from oneloop.backends.model_check import model_config, num_experts

    config = model_config({}, str(model_path))
    experts = num_experts(config) if config is not None else 0
    if settings.return_routed_experts and not experts:
        raise ConfigError(
            f"local.vllm.return_routed_experts: true needs a mixture-of-experts model, but "
            f"{model_path} has no experts; leave it unset (on for MoE models) or false"
        )
    return (
        bool(experts) if settings.return_routed_experts is None else settings.return_routed_experts
    )
