"""The `megatron` engine's optimizer with CPU offload (`local.megatron.optimizer_cpu_offload`), and
the optimizer's checkpoint state in one layout whether offloaded or not.

What megatron-core 0.19 does, and what this module sets or adds (read from
`megatron/core/optimizer/__init__.py` and `cpu_offloading/hybrid_optimizer.py`):

- `optimizer_cpu_offload=True` wraps the update in a `HybridDeviceOptimizer` (HDO) whose
  `offload_fraction` comes from `OptimizerConfig.optimizer_offload_fraction`, default 0.0: alone,
  the flag offloads nothing. We set 1.0: every parameter's update runs in a CPU AdamW.
- fp32 main params: the distributed optimizer keeps fp32 main shards on the GPU unless its
  precision-aware mode is on; with it (and offload) HDO's fp32 copies on the CPU are the only main
  params. So offload sets `use_precision_aware_optimizer` and needs `use_distributed_optimizer`.
- Hyperparameters: HDO copies its own param groups' lr / betas / eps / weight_decay into its
  sub-optimizers at every `step`, so the engine's `optim_step` sets them exactly as without
  offload (on `optimizer.param_groups`, which are HDO's). Without TE/Apex the sub-optimizers are
  torch `AdamW` (decoupled weight decay; `check_adamw` guards it), built with `fused=True`: torch's
  fused CPU kernel. The `fused_adam` speed switch has no GPU part to apply to and is skipped.
- bf16 trained weights only: for fp32 params the distributed optimizer hands HDO views of the
  params that autograd tracks, and torch refuses them ("can't optimize a non-leaf Tensor"), so no
  offload for LoRA (fp32 adapters) or fp32 models; fp16 (loss scaling) is untested, refused too.
- Weights loaded into the model: `reload_model_params` refreshes HDO's CPU fp32 copies.
- Checkpoints: `checkpoint_state` writes, per (chained) optimizer, a torch AdamW `state_dict` and
  the fp32 main params in the optimizer's parameter order — the layout the engine writes without
  offload — so a checkpoint resumes with or without offload. HDO's own `state_dict` and
  `load_state_dict` are not used (its load path moves all state to the CPU when both sides are
  torch AdamW, and rebuilds its sub-optimizers).
- Fractions below 1 are not offered: the GPU part (its placement, the fused_adam switch, its
  checkpoint path) is untested.
- Which Adam: without TE/Apex megatron-core builds torch's `AdamW` (a step count per parameter);
  with TE importable, TE's `FusedAdam` (one step count per param group, `group["step"]`, and its
  own state scaling). Checkpoints hold torch AdamW's form either way (`portable_state`,
  `native_state`), so a run resumes on a machine with or without TE, offloaded or not; loading
  sets only the hyperparameters on the live groups, never the implementation's own keys.
"""

from typing import Any

import torch

from oneloop.errors import CapabilityError

OFFLOAD_FRACTION = 1.0  # every parameter's update on the CPU (megatron-core's default is 0.0)
_HDO_ONLY_KEYS = (  # HDO's own param-group keys; not torch AdamW's
    "offload_fraction",
    "cpu_optimizer_cls",
    "gpu_optimizer_cls",
    "param_update_in_fp32",
    "pin_cpu_grads",
    "pin_cpu_params",
    "overlap_cpu_optimizer_d2h_h2d",
    "bias_correction",
)


def optimizer_config_fields(
    offload: bool, use_distributed_optimizer: bool, world_size: int, trained: set[torch.dtype]
) -> dict[str, Any]:
    """`OptimizerConfig` fields for the offload setting (empty when off); refuses the unproven.
    `trained`: the dtypes of the parameters the optimizer updates."""
    if not offload:
        return {}
    if trained != {torch.bfloat16}:
        raise CapabilityError(
            f"local.megatron.optimizer_cpu_offload needs bfloat16 trained weights, not "
            f"{sorted(map(str, trained))} (fp32 LoRA adapters, fp32 norms without the bf16_norms "
            "speed switch, an fp32 model): megatron-core 0.19 cannot offload fp32 params (it hands "
            "the CPU optimizer views of the params, which torch refuses)"
        )
    if not use_distributed_optimizer:
        raise CapabilityError(
            "local.megatron.optimizer_cpu_offload needs local.megatron.use_distributed_optimizer: "
            "without it megatron-core keeps the fp32 main params on the GPU"
        )
    if world_size != 1:
        raise CapabilityError(
            f"local.megatron.optimizer_cpu_offload runs at tp = pp = cp = 1 (this group has "
            f"{world_size} ranks): the TP/PP ranks' checkpoint path is not built for it"
        )
    return {
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": OFFLOAD_FRACTION,
        "use_precision_aware_optimizer": True,
    }


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def hybrid_optimizers(optimizer) -> list:
    """The `HybridDeviceOptimizer`s inside a megatron-core optimizer (chained or not)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    inners = [getattr(o, "optimizer", None) for o in _chained(optimizer)]
    return [inner for inner in inners if isinstance(inner, HybridDeviceOptimizer)]


def check_adamw(optimizer) -> None:
    """Raise unless every update runs in a CPU torch AdamW with decoupled weight decay."""
    hdos = hybrid_optimizers(optimizer)
    if not hdos:
        raise RuntimeError("optimizer_cpu_offload: megatron-core built no HybridDeviceOptimizer")
    for hdo in hdos:
        if hdo.gpu_optimizer is not None:
            raise RuntimeError("optimizer_cpu_offload: part of the update stayed on the GPU")
        for sub in hdo.sub_optimizers:
            decoupled = all(g.get("decoupled_weight_decay", True) for g in sub.param_groups)
            if not isinstance(sub, torch.optim.AdamW) or not decoupled:
                raise RuntimeError(
                    f"optimizer_cpu_offload: CPU optimizer {type(sub).__name__} is not torch "
                    "AdamW with decoupled weight decay (Tinker's AdamW semantics)"
                )


def _inner_params(hdo) -> list[torch.Tensor]:
    """The CPU fp32 params the sub-optimizers update, in HDO's parameter order."""
    return [hdo.param_to_inner_param[p] for group in hdo.param_groups for p in group["params"]]


def _owners(hdo) -> dict[torch.Tensor, torch.optim.Optimizer]:
    return {p: sub for sub in hdo.sub_optimizers for g in sub.param_groups for p in g["params"]}


def state_tensors(optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the offloaded optimizer (main params, moments, steps), by a readable key."""
    tensors: dict[str, torch.Tensor] = {}
    for h, hdo in enumerate(hybrid_optimizers(optimizer)):
        owners = _owners(hdo)
        for i, inner in enumerate(_inner_params(hdo)):
            tensors[f"{h}.{i}.main_param"] = inner
            for key, value in owners[inner].state.get(inner, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{h}.{i}.{key}"] = value
    return tensors


def _checkpoint_hdo(hdo) -> dict:
    owners = _owners(hdo)
    inners = _inner_params(hdo)
    state = {}
    for i, inner in enumerate(inners):
        saved = owners[inner].state.get(inner)
        if saved:
            state[i] = {k: v.detach().clone() for k, v in saved.items() if k != "master_param"}
    groups, start = [], 0
    adamw = hdo.sub_optimizers[0].defaults  # all torch AdamW keys, for a loader without offload
    for group in hdo.param_groups:
        kept = {k: v for k, v in group.items() if k not in _HDO_ONLY_KEYS and k != "params"}
        params = list(range(start, start + len(group["params"])))
        groups.append({**adamw, **kept, "params": params})
        start += len(group["params"])
    main_params = [inner.detach().clone().cpu() for inner in inners]
    return {"optimizer": {"state": state, "param_groups": groups}, "main_params": main_params}


def _load_hdo(hdo, saved: dict | None) -> None:
    owners = _owners(hdo)
    inners = _inner_params(hdo)
    if saved is None:  # saved before any step: fresh moments
        for inner in inners:
            owners[inner].state.pop(inner, None)
        return
    state = saved["optimizer"]["state"]
    with torch.no_grad():
        for i, (inner, main) in enumerate(zip(inners, saved["main_params"], strict=True)):
            if tuple(main.shape) != tuple(inner.shape):
                raise ValueError(f"optimizer state: param {i} saved {tuple(main.shape)}, "
                                 f"this model has {tuple(inner.shape)}")  # fmt: skip
            inner.copy_(main)
            entry = state.get(i)
            if entry is None:
                owners[inner].state.pop(inner, None)
                continue
            owners[inner].state[inner] = {
                k: v.detach().to(inner.device, torch.float32).clone() for k, v in entry.items()
            }
        # The model's weights follow the main params (the weights file holds them rounded).
        for param, inner in hdo.param_to_inner_param.items():
            if inner is not param:
                param.copy_(inner)


HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def steps_per_group(optimizer: torch.optim.Optimizer) -> bool:
    """TE's / Apex's FusedAdam count steps per param group; torch's Adam(W) per parameter."""
    return not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)


def portable_state(state_dict: dict, group_steps: bool) -> dict:
    """An Adam `state_dict` in torch AdamW's form: a group's step count (`group_steps`, FusedAdam)
    becomes each of its parameters' `step`; torch's own form is returned as it is."""
    if not group_steps:
        return state_dict
    state = {i: dict(entry) for i, entry in state_dict["state"].items()}
    groups = []
    for group in state_dict["param_groups"]:
        group = dict(group)
        step = group.pop("step", None)
        for i in group["params"]:
            if step is not None and i in state:
                state[i]["step"] = torch.tensor(float(step))
        groups.append(group)
    return {"state": state, "param_groups": groups}


def native_state(saved: dict, live_groups: list[dict], group_steps: bool) -> dict:
    """`portable_state`'s form → a `state_dict` for the live optimizer: its own group keys with the
    saved hyperparameters, and the steps where it keeps them (per group: one count, all equal)."""
    if len(saved["param_groups"]) != len(live_groups):
        raise ValueError(
            f"optimizer state holds {len(saved['param_groups'])} param groups, this optimizer "
            f"{len(live_groups)}"
        )
    state = {i: dict(entry) for i, entry in saved["state"].items()}
    groups = []
    for live, group in zip(live_groups, saved["param_groups"], strict=True):
        native = {k: v for k, v in live.items() if k not in ("params", "step")}
        native.update({k: group[k] for k in HYPERPARAMETERS if k in group})
        native["params"] = list(group["params"])
        if group_steps:
            steps = {
                float(state[i].pop("step")) for i in native["params"] if "step" in state.get(i, {})
            }
            if len(steps) > 1:
                raise ValueError(
                    f"optimizer state: one param group holds the step counts {sorted(steps)}; "
                    "this optimizer (TE's FusedAdam) keeps one count per group"
                )
            if steps:
                native["step"] = int(steps.pop())
        groups.append(native)
    return {"state": state, "param_groups": groups}


def checkpoint_state(optimizer) -> list[dict]:
    """Per chained optimizer: a torch AdamW `state_dict` and the fp32 main params, in the
    optimizer's parameter order (the same layout with and without offload, TE or not).

    Saved directly rather than through Megatron's dp-zero gather: the engine is one rank, and the
    main params keep the fp32 precision the bf16 weights file cannot hold."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    state = []
    for chained in _chained(optimizer):
        inner = chained.optimizer
        if isinstance(inner, HybridDeviceOptimizer):
            state.append(_checkpoint_hdo(inner))
            continue
        mains = [p.detach().cpu() for group in inner.param_groups for p in group["params"]]
        portable = portable_state(inner.state_dict(), steps_per_group(inner))
        state.append({"optimizer": portable, "main_params": mains})
    return state


def load_state(optimizer, saved: list[dict] | None) -> None:
    """Load `checkpoint_state`'s layout (written with or without offload); `saved` None (saved
    before any step) resets the moments. Call after the model's weights were loaded."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    chained = _chained(optimizer)
    if saved is not None and len(saved) != len(chained):
        raise ValueError(f"optimizer state holds {len(saved)} optimizers, this one {len(chained)}")
    for c, wrapper in enumerate(chained):
        inner, part = wrapper.optimizer, None if saved is None else saved[c]
        if isinstance(inner, HybridDeviceOptimizer):
            _load_hdo(inner, part)
        elif part is None:
            inner.state.clear()
        else:
            group_steps = steps_per_group(inner)
            inner.load_state_dict(native_state(part["optimizer"], inner.param_groups, group_steps))
            mains = [p for group in inner.param_groups for p in group["params"]]
            with torch.no_grad():
                for main, value in zip(mains, part["main_params"], strict=True):
                    main.copy_(value.to(main.device))


def reload_main_params(optimizer) -> None:
    """After new weights were imported into the model: the fp32 main params follow them
    (offloaded: HDO's CPU copies, through Megatron's `reload_model_params`)."""
    for chained in _chained(optimizer):
        if hasattr(chained, "reload_model_params"):
            chained.reload_model_params()
