"""Gated DeltaNet training kernels where flash-linear-attention refuses its own backward.

flash-linear-attention 0.6 raises in the backward of its gated delta rule on Hopper GPUs (H100,
H200) with Triton >= 3.4 and < 3.7.1 ("produces incorrect results", fla issue #640) unless
tilelang is installed. torch 2.11 pins Triton 3.6, so on an H200 every Qwen3.5 / 3.6 hybrid
training step stopped there (measured on the device, 2026-12-03). There the trainer engines switch
their Gated DeltaNet to the chunked delta rule written in torch (transformers' and megatron-core's
own, the path the CPU tests run): the same formula, slower. Forward-only samplers keep fla.
"""

import importlib.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

# transformers modules whose Gated DeltaNet calls the module-level chunked delta rule
TRANSFORMERS_GDN_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)


def fla_backward_refusal() -> str | None:
    """Why flash-linear-attention's gated delta rule backward would refuse to run on this GPU,
    or None (it runs, or fla is not installed)."""
    try:
        from fla import utils
    except ImportError:
        return None
    hopper = getattr(utils, "IS_NVIDIA_HOPPER", False)
    broken = getattr(utils, "TRITON_ABOVE_3_4_0", False) and not getattr(
        utils, "TRITON_ABOVE_3_7_1", True
    )
    if not (hopper and broken) or importlib.util.find_spec("tilelang") is not None:
        return None
    import triton

    return (
        f"flash-linear-attention refuses its gated delta rule backward on Hopper GPUs with "
        f"Triton {triton.__version__} (>= 3.4, < 3.7.1: fla issue #640) without tilelang"
    )


def torch_rule_where_refused(switch: Callable[[], object], engine: str) -> str | None:
    """Run `switch` (one of the `use_torch_delta_rule_in_*` below) and warn when fla refuses
    its backward here; returns "torch" then, else None (fla's kernels stay)."""
    reason = fla_backward_refusal()
    if reason is None:
        return None
    switch()
    log.warning("%s: the %s trainer uses the torch chunked delta rule", reason, engine)
    return "torch"


def use_torch_delta_rule_in_transformers() -> list[str]:
    """Point transformers' Qwen3.5 / 3.6 Gated DeltaNet at its torch chunked delta rule in this
    process (the module-level function it resolved to fla at import); returns the modules
    switched."""
    import importlib

    switched = []
    for name in TRANSFORMERS_GDN_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        rule = getattr(module, "torch_chunk_gated_delta_rule", None)
        original = getattr(rule, "__wrapped__", None)  # the torch function under the dispatcher
        if original is not None:
            module.torch_chunk_gated_delta_rule = original
            switched.append(name)
    return switched


def use_torch_delta_rule_in_megatron(model) -> int:
    """Give every megatron-core `GatedDeltaNet` of `model` its torch chunked delta rule (what
    `deterministic_mode` selects); returns how many layers were switched."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, torch_chunk_gated_delta_rule

    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    for layer in layers:
        layer.gated_delta_rule = torch_chunk_gated_delta_rule
    return len(layers)
