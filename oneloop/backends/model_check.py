"""Checks of a model's architecture against the backend settings that depend on it, run before
any engine starts: mixture-of-experts settings (expert parallelism, routing replay), the
hybrid layer pattern, and the megatron engine's layout of these models (pipeline stages, what it
does not build).

Reads the model's Hugging Face `config.json` (the multimodal Qwen3.5 checkpoints keep the text
model's fields under `text_config`); a model the local backend does not resolve here (a name
only a Tinker service knows) is not checked.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oneloop.backends.capabilities import ROUTING_REPLAY_SUPPORT
from oneloop.errors import CapabilityError

KNOWN_LAYER_TYPES = ("full_attention", "linear_attention")
"""`layer_types` entries the engines build: gated full attention and Gated DeltaNet."""


def model_config(models: Mapping[str, Path], base_model: str) -> dict[str, Any] | None:
    """The text model's config.json fields of `base_model` (backend.models name, a named tiny
    model, built on first use, or a directory), or None when it does not resolve locally."""
    from oneloop.tiny.model import build_tiny_model, named_tiny_specs

    if base_model in models:
        directory = Path(models[base_model])
    elif base_model in named_tiny_specs():
        directory = build_tiny_model(named_tiny_specs()[base_model])
    elif Path(base_model).is_dir():
        directory = Path(base_model)
    else:
        return None
    path = directory / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    return {**config, **config.get("text_config", {})}


def num_experts(config: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    return 0


def check_model(
    config: Mapping[str, Any],
    *,
    base_model: str,
    ep: int = 1,
    routing_replay: bool = False,
    replay_field: str = "algo.routing_replay",
) -> None:
    """Raise CapabilityError naming the field when the model cannot run with these settings:
    an unknown layer type, experts not divisible by `ep` (`local.megatron.ep`), or routing
    replay asked of a dense model."""
    for index, kind in enumerate(config.get("layer_types") or ()):
        if kind not in KNOWN_LAYER_TYPES:
            raise CapabilityError(
                f"model.base_model={base_model!r}: config.json layer_types[{index}]={kind!r} is "
                f"not a layer type the engines build; expected one of {KNOWN_LAYER_TYPES}"
            )
    experts = num_experts(config)
    if ep > 1 and (not experts or experts % ep):
        what = f"its {experts} experts" if experts else "it is a dense model (no experts)"
        raise CapabilityError(
            f"local.megatron.ep={ep}: expert parallelism splits each MoE layer's experts over "
            f"{ep} ranks, but model.base_model={base_model!r} cannot be split: {what}; "
            "use an ep that divides the expert count"
        )
    if routing_replay and not experts:
        raise CapabilityError(
            f"{replay_field}: routing replay needs a mixture-of-experts model, but "
            f"model.base_model={base_model!r} is dense (model_type "
            f"{config.get('model_type')!r}, no experts); set {replay_field}: false"
        )


def check_routing_replay_backend(supported: bool, backend: str, field: str) -> None:
    """Raise CapabilityError naming `field` when the backend cannot replay routing."""
    if not supported:
        raise CapabilityError(
            f"{field}: routing replay (R3) is not supported by backend {backend!r}: "
            + ROUTING_REPLAY_SUPPORT
        )


def check_megatron_layout(
    config: Mapping[str, Any], *, megatron: Any, gpus_per_trainer: float, lora_rank: int
) -> None:
    """The megatron engine's refusals for this model's layout (`local.megatron`), raised here so
    they come before any engine starts: RoPE scaling other than Llama 3's (and `fused_rope` with
    any scaling) is refused, pp must split the decoder layers evenly, and a MoE or
    hybrid model refuses what `moe.check_engine_layout` refuses (a tp that does not split the
    Gated DeltaNet heads or the MLP widths, cp > 1, LoRA, an ep that does not divide tp · dp).
    CapabilityError naming the field."""
    from oneloop.backends.megatron_local.engines.megatron import moe
    from oneloop.backends.megatron_local.engines.megatron.layout import rope_scaling_factor
    from oneloop.backends.megatron_local.engines.megatron.parallel.pp_plan import (
        check_pp,
        resolve_dp,
    )
    from oneloop.backends.megatron_local.engines.megatron.speed import check_rope

    m = megatron
    try:
        check_pp(int(config["num_hidden_layers"]), m.pp)
        check_rope(m.speed, rope_scaling_factor(config))
        if config.get("model_type") in moe.FAMILIES:
            dp = resolve_dp(m.dp, gpus_per_trainer, m.tp, m.pp, m.cp)
            shape = moe.HybridShape.from_hf(dict(config))
            moe.check_engine_layout(
                shape, tp=m.tp, pp=m.pp, cp=m.cp, ep=m.ep, dp=dp, lora_rank=lora_rank
            )
    except CapabilityError:
        raise
    except ValueError as error:
        raise CapabilityError(str(error)) from None
