"""Tinker's built-in losses, computed exactly as the service defines them, for both trainer engines.

This module owns the loss definitions, their `loss_fn_config` keys and defaults, and the checks on
`Datum.loss_fn_inputs` that run before any compute. It is pure torch/numpy with no engine state: an
engine gathers the per-token target logprobs `[B, T]` (right-padded, `mask` true on real
positions) and calls `compute_loss`, which returns the summed loss to backpropagate plus detached
per-datum sums.

Every loss is a SUM over tokens (never a mean); reductions such as prompt-mean are the loop's job,
done by scaling advantages/weights. `target_logprobs` is log p_theta (the learner), `logprobs` in
`loss_fn_inputs` is log q (the sampler), `advantages` is A. Definitions (per token, then summed):

- `cross_entropy`: -target_logprobs * weights. Inputs: target_tokens, weights. No config.
  https://tinker-docs.thinkingmachines.ai/tinker/losses/cross-entropy
- `importance_sampling`: -exp(target_logprobs - logprobs) * advantages. Inputs: target_tokens,
  logprobs, advantages. No config.
  https://tinker-docs.thinkingmachines.ai/tinker/losses/importance-sampling
- `ppo`: -min(r * A, clamp(r, clip_low_threshold, clip_high_threshold) * A), r = exp(lp - q).
  Config keys `clip_low_threshold` / `clip_high_threshold` are bounds on the ratio itself (not
  epsilons); defaults 0.8 / 1.2; config may be absent.
  https://tinker-docs.thinkingmachines.ai/tinker/losses/ppo (its "fixed to 0.2" sentence predates
  `loss_fn_config`); defaults from tinker-cookbook tutorials/202_loss_functions.py ("PPO defaults
  to 0.8 and 1.2") https://github.com/thinking-machines-lab/tinker-cookbook
- `cispo`: -sg(clamp(r, clip_low_threshold, clip_high_threshold)) * target_logprobs * A. Same keys
  as ppo; defaults 0.0 / 4.0 (one-sided clip), config may be absent.
  https://tinker-docs.thinkingmachines.ai/tinker/losses/cispo; defaults from the same cookbook
  tutorial ({"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}).
- `dro`: -(target_logprobs * A - 0.5 * beta * (target_logprobs - logprobs)**2). Config key `beta`.
  https://tinker-docs.thinkingmachines.ai/tinker/losses/dro. The quadratic term applies at every
  real position, including advantage-0 ones, and the service rejects a `weights` input for dro
  (https://github.com/thinking-machines-lab/tinker-cookbook/issues/907); we match that: only
  padding is masked here.
- `gspo` (GSPO-token): -min(s_t * A, clamp(s_t, clip_low_threshold, clip_high_threshold) * A),
  where s = exp(mean over the datum's marked tokens M of sg(target_logprobs) - logprobs), M being
  the positions where the `sequence_ratio_mask` input is non-zero, and s_t = sg(s) *
  exp(target_logprobs - sg(target_logprobs)): every token carries the sequence ratio's value and
  the gradient of its own logprob. Inputs: target_tokens, logprobs, advantages,
  sequence_ratio_mask. Config keys `clip_low_threshold` / `clip_high_threshold` (ratio bounds).
  https://tinker-docs.thinkingmachines.ai/tinker/losses/gspo

Departures, stated on purpose:
- `dro` requires `beta`: the docs give no default value, so guessing one would silently change the
  objective; an absent `beta` is a `LossInputError`.
- `gspo` requires both clip thresholds: the part of its page we could read gives the clip as
  (1 - eps_low, 1 + eps_high) with no default, so an absent one is a `LossInputError`, as for dro.
  A datum whose `sequence_ratio_mask` marks no token has no sequence ratio (a mean over nothing):
  a `LossInputError` naming the datum, not a NaN loss.
- `stable_reinforce` (SDK 0.38's `LossFnType`) is refused with its reason: Tinker documents its
  sampling-side inputs (samples taken with `record_stability_info`, named by `sequence_id`
  provenance) and a `kl_coeff` config key, but not its objective or what "stability information"
  holds, so this backend can neither record that information nor compute the loss exactly.
- Threshold sanity (0 <= clip_low_threshold <= 1 <= clip_high_threshold, beta >= 0, finite) is our
  own check; a knob we cannot honour is an error, never a silent no-op.
- `loss_fn_inputs` keys other than `target_tokens` and the loss's required inputs are rejected
  (Tinker rejects `weights` for dro; masks belong in advantages for the RL losses). Top-K
  `cross_entropy` ((N, K) targets) and per-token clip thresholds are not supported by this backend.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from oneloop.errors import LossInputError

LossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]

SUPPORTED_LOSSES: frozenset[str] = frozenset(
    {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"}
)

# Losses whose per-token value depends on the whole datum (a sequence-level statistic): an engine
# that splits one datum's positions across ranks (context parallelism) cannot compute them per rank.
SEQUENCE_LEVEL_LOSSES: frozenset[str] = frozenset({"gspo"})

# Tinker built-ins this backend refuses, with the reason (module docstring, "Departures").
UNSUPPORTED_BUILTINS: dict[str, str] = {
    "stable_reinforce": (
        "Tinker publishes its sampling-side inputs (record_stability_info, sequence_id provenance) "
        "but not its objective, so this backend cannot compute it exactly; use gspo, ppo or cispo "
        "here, or the tinker backend"
    ),
}

REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
}

# Config defaults per loss; a key listed with value None is required (no documented default).
_CONFIG_DEFAULTS: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": None},
    "gspo": {"clip_low_threshold": None, "clip_high_threshold": None},
}
# An example value for each required key, for the error that asks for it.
_REQUIRED_EXAMPLE = {"beta": 0.05, "clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_SEQUENCE_MASK = "sequence_ratio_mask"

_TARGET_TOKENS = "target_tokens"


@dataclass(frozen=True)
class LossResult:
    """The outcome of one loss evaluation over a padded batch.

    loss: 0-d sum over all real tokens of all datums; differentiable w.r.t. target_logprobs.
    per_datum: [B] detached per-datum sums (loss == per_datum.sum() up to rounding).
    metrics: Tinker-style `name:reduction` keys; always `loss:sum`, plus `clipped_tokens:sum`
        (real tokens whose ratio lies outside the clip range) for ppo, cispo and gspo.
    """

    loss: Tensor
    per_datum: Tensor
    metrics: dict[str, float]


def _check_loss_name(loss_fn: str) -> None:
    if loss_fn in UNSUPPORTED_BUILTINS:
        raise LossInputError(
            f"loss_fn {loss_fn!r} is not supported by this backend: {UNSUPPORTED_BUILTINS[loss_fn]}"
        )
    if loss_fn not in SUPPORTED_LOSSES:
        raise LossInputError(
            f"loss_fn {loss_fn!r} is not supported by this backend; "
            f"expected one of {sorted(SUPPORTED_LOSSES)}"
        )


def validate_loss_config(
    loss_fn: str, config: Mapping[str, float | str] | None
) -> dict[str, float]:
    """Resolve `loss_fn_config` for `loss_fn`, filling documented defaults.

    Raises LossInputError for an unknown loss, an unknown key, a non-numeric or non-finite value,
    thresholds outside 0 <= clip_low_threshold <= 1 <= clip_high_threshold, a negative beta, or a
    missing `beta` for dro.
    """
    _check_loss_name(loss_fn)
    defaults = _CONFIG_DEFAULTS[loss_fn]
    given = dict(config or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        allowed = sorted(defaults) if defaults else "no keys"
        raise LossInputError(
            f"loss_fn_config keys {unknown} are not valid for loss {loss_fn!r}; allowed: {allowed}"
        )
    resolved: dict[str, float] = {}
    for key, default in defaults.items():
        if key not in given:
            if default is None:
                example = f"{{{key!r}: {_REQUIRED_EXAMPLE[key]}}}"
                raise LossInputError(
                    f"loss_fn_config[{key!r}] is required by loss {loss_fn!r} (no documented "
                    f"default; expected a finite number, e.g. {example})"
                )
            resolved[key] = default
            continue
        value = given[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise LossInputError(
                f"loss_fn_config[{key!r}] must be a number, got {type(value).__name__} {value!r}"
            )
        if not math.isfinite(value):
            raise LossInputError(f"loss_fn_config[{key!r}] must be finite, got {value!r}")
        resolved[key] = float(value)
    if "clip_low_threshold" in resolved:
        low, high = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
        if not 0.0 <= low <= 1.0 <= high:
            raise LossInputError(
                f"loss_fn_config clip thresholds for loss {loss_fn!r} must satisfy "
                f"0 <= clip_low_threshold <= 1 <= clip_high_threshold (bounds on the ratio "
                f"p/q, not epsilons); got clip_low_threshold={low}, clip_high_threshold={high}"
            )
    if resolved.get("beta", 0.0) < 0.0:
        raise LossInputError(f"loss_fn_config['beta'] must be >= 0, got {resolved['beta']}")
    return resolved


def _datum_prefix(index: int | None) -> str:
    return "" if index is None else f"datum {index}: "


def validate_datum_inputs(
    loss_fn: str,
    model_input_len: int,
    loss_fn_inputs: Mapping[str, np.ndarray],
    index: int | None = None,
) -> None:
    """Check one datum's `loss_fn_inputs` for `loss_fn` before any compute.

    `target_tokens` must be 1-D non-negative integers of length `model_input_len`; every required
    input must be present, 1-D, the same length, and finite; no other keys are allowed. Errors
    name the field and, when `index` is given, the datum.
    """
    _check_loss_name(loss_fn)
    where = _datum_prefix(index)
    if model_input_len <= 0:
        raise LossInputError(f"{where}model_input must hold at least one token, got length 0")
    required = REQUIRED_INPUTS[loss_fn]
    allowed = {_TARGET_TOKENS, *required}
    unknown = sorted(set(loss_fn_inputs) - allowed)
    if unknown:
        raise LossInputError(
            f"{where}loss_fn_inputs keys {unknown} are not accepted by loss {loss_fn!r}; "
            f"expected exactly {sorted(allowed)}"
        )
    for key in (_TARGET_TOKENS, *required):
        if key not in loss_fn_inputs:
            raise LossInputError(f"{where}loss_fn_inputs[{key!r}] is required by loss {loss_fn!r}")
        array = np.asarray(loss_fn_inputs[key])
        if array.ndim != 1:
            raise LossInputError(
                f"{where}loss_fn_inputs[{key!r}] must be 1-D with shape ({model_input_len},), "
                f"got shape {array.shape}"
            )
        if array.shape[0] != model_input_len:
            raise LossInputError(
                f"{where}loss_fn_inputs[{key!r}] has length {array.shape[0]} but model_input "
                f"has length {model_input_len}; they must be equal"
            )
        if key == _TARGET_TOKENS:
            if not np.issubdtype(array.dtype, np.integer):
                raise LossInputError(
                    f"{where}loss_fn_inputs['target_tokens'] must hold integers, "
                    f"got dtype {array.dtype}"
                )
            if (array < 0).any():
                raise LossInputError(
                    f"{where}loss_fn_inputs['target_tokens'] must be non-negative token ids"
                )
            continue
        if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
            raise LossInputError(
                f"{where}loss_fn_inputs[{key!r}] must hold numbers, got dtype {array.dtype}"
            )
        if not np.isfinite(array).all():
            bad = int(np.flatnonzero(~np.isfinite(array))[0])
            raise LossInputError(
                f"{where}loss_fn_inputs[{key!r}] must be finite; position {bad} is {array[bad]}"
            )
        if key == _SEQUENCE_MASK and not array.any():
            raise LossInputError(
                f"{where}loss_fn_inputs[{key!r}] marks no token (all zeros); loss {loss_fn!r} "
                "averages the log-ratio over the marked tokens, so mark at least one"
            )


# --- one function per loss: per-token loss [B, T], already safe at padded positions ---------------

_PerToken = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]


def _cross_entropy(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    return -lp * inputs["weights"]


def _importance_sampling(
    lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]
) -> Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    return -(ratio * inputs["advantages"])


def _ppo(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    advantages = inputs["advantages"]
    ratio = torch.exp(lp - inputs["logprobs"])
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.min(ratio * advantages, clipped * advantages)


def _cispo(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(clipped.detach() * lp * inputs["advantages"])


def _dro(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    quadratic = (lp - inputs["logprobs"]) ** 2
    return -(lp * inputs["advantages"] - 0.5 * cfg["beta"] * quadratic)


def _gspo(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    advantages = inputs["advantages"]
    ratio = _gspo_ratio(lp, inputs)
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.min(ratio * advantages, clipped * advantages)


def _gspo_ratio(lp: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """s_t [B, T]: the row's sequence ratio as value, each token's own logprob as gradient. Inputs
    are zeroed on padding, so padding is never in the ratio's mask."""
    in_ratio = inputs[_SEQUENCE_MASK] != 0
    count = in_ratio.sum(dim=1, keepdim=True)
    if bool((count == 0).any()):
        row = int(torch.nonzero(count.squeeze(1) == 0)[0])
        raise LossInputError(
            f"loss_fn_inputs[{_SEQUENCE_MASK!r}] marks no real token in row {row}; loss 'gspo' "
            "averages the log-ratio over the marked tokens, so mark at least one"
        )
    gap = torch.where(in_ratio, lp.detach() - inputs["logprobs"], torch.zeros_like(lp))
    log_ratio = gap.sum(dim=1, keepdim=True) / count
    return torch.exp(log_ratio + lp - lp.detach())


_PER_TOKEN: dict[str, _PerToken] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
}


def _prepare_inputs(
    loss_fn: str, target_logprobs: Tensor, inputs: Mapping[str, Tensor], mask: Tensor
) -> dict[str, Tensor]:
    """Check shapes, dtypes and finiteness; return required inputs cast and zeroed on padding."""
    if target_logprobs.ndim != 2 or not target_logprobs.is_floating_point():
        raise LossInputError(
            f"target_logprobs must be a float tensor of shape [B, T], got dtype "
            f"{target_logprobs.dtype} shape {tuple(target_logprobs.shape)}"
        )
    shape = tuple(target_logprobs.shape)
    if mask.dtype != torch.bool or tuple(mask.shape) != shape:
        raise LossInputError(
            f"mask must be a bool tensor with the shape of target_logprobs {shape}, got dtype "
            f"{mask.dtype} shape {tuple(mask.shape)}"
        )
    required = REQUIRED_INPUTS[loss_fn]
    unknown = sorted(set(inputs) - {_TARGET_TOKENS, *required})
    if unknown:
        raise LossInputError(
            f"loss_fn_inputs keys {unknown} are not accepted by loss {loss_fn!r}; "
            f"expected {sorted({_TARGET_TOKENS, *required})}"
        )
    dtype = torch.promote_types(target_logprobs.dtype, torch.float32)
    prepared: dict[str, Tensor] = {}
    for key in required:
        if key not in inputs:
            raise LossInputError(f"loss_fn_inputs[{key!r}] is required by loss {loss_fn!r}")
        value = inputs[key]
        if tuple(value.shape) != shape:
            raise LossInputError(
                f"loss_fn_inputs[{key!r}] has shape {tuple(value.shape)} but target_logprobs "
                f"has shape {shape}; they must be equal"
            )
        value = value.detach().to(device=target_logprobs.device, dtype=dtype)
        real_ok = torch.isfinite(value) | ~mask
        if not bool(real_ok.all()):
            row, col = (int(i) for i in torch.nonzero(~real_ok)[0])
            raise LossInputError(
                f"loss_fn_inputs[{key!r}] must be finite; row {row} position {col} is "
                f"{value[row, col].item()}"
            )
        prepared[key] = torch.where(mask, value, torch.zeros((), dtype=dtype, device=value.device))
    return prepared


def compute_loss(
    loss_fn: str,
    target_logprobs: Tensor,
    inputs: Mapping[str, Tensor],
    mask: Tensor,
    config: Mapping[str, float] | None,
) -> LossResult:
    """Evaluate Tinker's `loss_fn` on a right-padded batch.

    target_logprobs: [B, T] float learner logprobs of the target tokens (may require grad).
    inputs: the loss's required inputs, each [B, T] (a `target_tokens` entry is ignored).
    mask: [B, T] bool, true on real positions; padded positions contribute exactly 0 to the
        loss, to per_datum and to the gradient, whatever values they hold.
    config: `loss_fn_config`, resolved with defaults by `validate_loss_config`.
    """
    cfg = validate_loss_config(loss_fn, config)
    prepared = _prepare_inputs(loss_fn, target_logprobs, inputs, mask)
    dtype = torch.promote_types(target_logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=target_logprobs.device)
    # Replace padded logprobs before any exp/square so no inf or nan can leak into the gradient.
    lp = torch.where(mask, target_logprobs.to(dtype), zero)
    # With lp and inputs zeroed every current loss is already 0 on padding; masking the result too
    # keeps that true for a loss whose value at all-zero inputs is not 0.
    per_token = torch.where(mask, _PER_TOKEN[loss_fn](lp, prepared, cfg), zero)
    per_row = per_token.sum(dim=1)
    loss = per_row.sum()
    metrics = {"loss:sum": float(loss.detach().item())}
    if loss_fn in ("ppo", "cispo", "gspo"):
        with torch.no_grad():
            if loss_fn == "gspo":
                ratio = _gspo_ratio(lp, prepared)
            else:
                ratio = torch.exp(lp - prepared["logprobs"])
            outside = (ratio < cfg["clip_low_threshold"]) | (ratio > cfg["clip_high_threshold"])
            metrics["clipped_tokens:sum"] = float((outside & mask).sum().item())
    return LossResult(loss=loss, per_datum=per_row.detach(), metrics=metrics)
