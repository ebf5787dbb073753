"""Tests for oneloop.backends.megatron_local.losses: Tinker's built-in loss definitions.

Expected values are worked out by hand from probabilities such as 0.5 and 0.25 (so every ratio is
a power of two) and written out in each test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from oneloop.backends.megatron_local.losses import (
    REQUIRED_INPUTS,
    SUPPORTED_LOSSES,
    compute_loss,
    validate_datum_inputs,
    validate_loss_config,
)
from oneloop.errors import LossInputError

LN2 = math.log(2.0)
GSPO_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def _t(rows: list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


def _lp(rows: list[list[float]]) -> torch.Tensor:
    """Target logprobs from probabilities, as a leaf that requires grad."""
    return torch.tensor(rows, dtype=torch.float64).log().requires_grad_(True)


def _full_mask(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(x.shape, dtype=torch.bool)


def _grad(result_loss: torch.Tensor, lp: torch.Tensor) -> list[list[float]]:
    (g,) = torch.autograd.grad(result_loss, lp)
    return g.tolist()


# --- closed-form values and hand-derived gradients --------------------------------------------


def test_cross_entropy_is_weighted_negative_logprob_sum() -> None:
    lp = _lp([[0.5, 0.25, 0.125]])
    weights = _t([[1.0, 1.0, 0.0]])
    res = compute_loss("cross_entropy", lp, {"weights": weights}, _full_mask(lp), None)
    # -(log 0.5 + log 0.25) = ln2 + 2 ln2; the third token has weight 0.
    assert res.loss.item() == pytest.approx(3 * LN2)
    assert res.metrics == {"loss:sum": pytest.approx(3 * LN2)}
    assert _grad(res.loss, lp) == [[-1.0, -1.0, 0.0]]


def test_importance_sampling_is_ratio_times_advantage() -> None:
    lp = _lp([[0.5, 0.5]])
    sampler = _t([[0.25, 0.5]]).log()
    adv = _t([[1.5, -2.0]])
    res = compute_loss(
        "importance_sampling", lp, {"logprobs": sampler, "advantages": adv}, _full_mask(lp), None
    )
    # ratios 2 and 1: -(2 * 1.5 + 1 * -2) = -1; d/dlp = -ratio * A = [-3, 2].
    assert res.loss.item() == pytest.approx(-1.0)
    assert _grad(res.loss, lp) == [[pytest.approx(-3.0), pytest.approx(2.0)]]


def test_ppo_default_clip_active_and_inactive() -> None:
    # Token ratios: 2, 2, 0.5, 0.5, 1 with advantages +1, -1, +1, -1, +3 and defaults 0.8 / 1.2.
    lp = _lp([[0.5, 0.5, 0.25, 0.25, 0.5]])
    sampler = _t([[0.25, 0.25, 0.5, 0.5, 0.5]]).log()
    adv = _t([[1.0, -1.0, 1.0, -1.0, 3.0]])
    res = compute_loss("ppo", lp, {"logprobs": sampler, "advantages": adv}, _full_mask(lp), None)
    # r=2,A=+1: min(2, 1.2)=1.2 clipped   -> loss -1.2, grad 0
    # r=2,A=-1: min(-2,-1.2)=-2 unclipped -> loss +2,   grad -A*r = 2
    # r=.5,A=+1: min(.5, .8)=.5 unclipped -> loss -0.5, grad -0.5
    # r=.5,A=-1: min(-.5,-.8)=-.8 clipped -> loss +0.8, grad 0
    # r=1,A=3: inside range              -> loss -3,   grad -3
    assert res.loss.item() == pytest.approx(-1.2 + 2.0 - 0.5 + 0.8 - 3.0)
    assert _grad(res.loss, lp) == [[0.0, pytest.approx(2.0), pytest.approx(-0.5), 0.0, -3.0]]
    # Ratio 2 and ratio 0.5 lie outside [0.8, 1.2]: four clipped tokens.
    assert res.metrics["clipped_tokens:sum"] == 4.0


def test_ppo_custom_thresholds_change_which_tokens_clip() -> None:
    lp = _lp([[0.5]])
    sampler = _t([[0.25]]).log()
    adv = _t([[1.0]])
    inputs = {"logprobs": sampler, "advantages": adv}
    wide = {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}
    res = compute_loss("ppo", lp, inputs, _full_mask(lp), wide)
    # ratio 2 is inside [0.5, 3]: loss -2, gradient -A*r = -2, nothing clipped.
    assert res.loss.item() == pytest.approx(-2.0)
    assert res.metrics["clipped_tokens:sum"] == 0.0
    assert _grad(res.loss, lp) == [[pytest.approx(-2.0)]]
    tight = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    res = compute_loss("ppo", lp, inputs, _full_mask(lp), tight)
    assert res.loss.item() == pytest.approx(-1.1)
    assert _grad(res.loss, lp) == [[0.0]]


def test_cispo_uses_detached_clipped_ratio_with_one_sided_default() -> None:
    # ratios: 2 (inside default [0, 4]), 8 (clipped to 4), 1/8 (inside: low bound is 0).
    lp = _lp([[0.5, 0.5, 0.0625]])
    sampler = _t([[0.25, 0.0625, 0.5]]).log()
    adv = _t([[1.0, 1.0, -2.0]])
    res = compute_loss("cispo", lp, {"logprobs": sampler, "advantages": adv}, _full_mask(lp), None)
    # per token -c * lp * A: -2*(-ln2)*1 = 2ln2; -4*(-ln2)*1 = 4ln2; -(1/8)*(-4ln2)*(-2) = -ln2.
    assert res.loss.item() == pytest.approx(5 * LN2)
    # The coefficient is a constant for autograd: d/dlp = -c * A = [-2, -4, 0.25].
    assert _grad(res.loss, lp) == [[pytest.approx(-2.0), pytest.approx(-4.0), pytest.approx(0.25)]]
    assert res.metrics["clipped_tokens:sum"] == 1.0


def test_dro_quadratic_penalty_applies_even_at_zero_advantage() -> None:
    lp = _lp([[0.5, 0.5]])
    sampler = _t([[0.25, 0.125]]).log()
    adv = _t([[1.0, 0.0]])
    res = compute_loss(
        "dro", lp, {"logprobs": sampler, "advantages": adv}, _full_mask(lp), {"beta": 0.1}
    )
    # token 1: -(-ln2 * 1 - 0.05 * ln2^2) = ln2 + 0.05 ln2^2
    # token 2: -(0 - 0.05 * (2 ln2)^2)     = 0.2 ln2^2
    assert res.loss.item() == pytest.approx(LN2 + 0.25 * LN2**2)
    # d/dlp = -(A - beta * (lp - q)) = [-(1 - 0.1 ln2), 0.1 * 2 ln2]
    assert _grad(res.loss, lp) == [[pytest.approx(-(1 - 0.1 * LN2)), pytest.approx(0.2 * LN2)]]


def _gspo_inputs(sampler: list[list[float]], adv: list[list[float]], marks: list[list[float]]):
    return {
        "logprobs": _t(sampler).log(),
        "advantages": _t(adv),
        "sequence_ratio_mask": _t(marks),
    }


def test_gspo_sequence_ratio_value_with_each_tokens_own_gradient() -> None:
    # Row 0: token ratios 2, 1/2, 1, all marked: mean log-ratio 0, s = 1 (inside [0.8, 1.2]).
    # Row 1: token ratios 2, 2, 1/4, the last unmarked: mean over the marked two is ln2, s = 2
    # (were the third marked, the mean would be 0 and s = 1: the mask decides).
    lp = _lp([[0.5, 0.25, 0.5], [0.5, 0.5, 0.125]])
    inputs = _gspo_inputs(
        [[0.25, 0.5, 0.5], [0.25, 0.25, 0.5]], [[1.0, -1.0, 2.0], [1.0, 1.0, -1.0]],
        [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]],
    )
    res = compute_loss("gspo", lp, inputs, _full_mask(lp), GSPO_CLIP)
    # Row 0, s = 1 for every token: -(1*1 + 1*-1 + 1*2) = -2; d/dlp_t = -A_t * s = [-1, 1, -2].
    # Row 1, s = 2 for every token (the unmarked one too):
    #   A=+1: min(2, 1.2) = 1.2 clipped  -> -1.2 each, gradient 0
    #   A=-1: min(-2, -1.2) = -2 unclipped -> +2, gradient -A * s = 2
    assert res.per_datum.tolist() == [pytest.approx(-2.0), pytest.approx(-0.4)]
    assert res.loss.item() == pytest.approx(-2.4)
    assert _grad(res.loss, lp) == [
        [pytest.approx(-1.0), pytest.approx(1.0), pytest.approx(-2.0)],
        [0.0, 0.0, pytest.approx(2.0)],
    ]
    # s = 2 lies outside [0.8, 1.2] for all three real tokens of row 1.
    assert res.metrics["clipped_tokens:sum"] == 3.0
    # Token-level ppo on the same numbers differs: row 1's third token has ratio 1/4, not 2.
    ppo = compute_loss("ppo", lp, {k: inputs[k] for k in ("logprobs", "advantages")},
                       _full_mask(lp), GSPO_CLIP)  # fmt: skip
    assert ppo.per_datum[1].item() == pytest.approx(-1.2 - 1.2 + 0.8)


def test_gspo_row_with_no_marked_token_is_an_error_not_nan() -> None:
    lp = _lp([[0.5, 0.5], [0.5, 0.5]])
    inputs = _gspo_inputs([[0.5, 0.5], [0.5, 0.5]], [[1.0, 1.0], [1.0, 1.0]],
                          [[1.0, 0.0], [0.0, 0.0]])  # fmt: skip
    with pytest.raises(LossInputError, match=r"mask'\] marks no real token in row 1"):
        compute_loss("gspo", lp, inputs, _full_mask(lp), GSPO_CLIP)
    # A mark on a padded position does not count: padding is never in the ratio.
    inputs["sequence_ratio_mask"] = _t([[1.0, 0.0], [0.0, 1.0]])
    mask = torch.tensor([[True, True], [True, False]])
    with pytest.raises(LossInputError, match="in row 1"):
        compute_loss("gspo", lp, inputs, mask, GSPO_CLIP)


def test_per_datum_is_detached_row_sums_and_loss_is_their_sum() -> None:
    lp = _lp([[0.5, 0.25], [0.125, 0.5]])
    weights = _t([[1.0, 1.0], [1.0, 0.0]])
    res = compute_loss("cross_entropy", lp, {"weights": weights}, _full_mask(lp), None)
    assert res.per_datum.tolist() == [pytest.approx(3 * LN2), pytest.approx(3 * LN2)]
    assert not res.per_datum.requires_grad
    assert res.loss.ndim == 0 and res.loss.requires_grad
    assert res.loss.item() == pytest.approx(6 * LN2)


# --- padding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_fn", sorted(SUPPORTED_LOSSES))
def test_padded_positions_contribute_nothing(loss_fn: str) -> None:
    """Garbage in padded positions (huge logprob gaps, inf, nan) changes neither loss nor grad."""
    real_lp = [math.log(0.5), math.log(0.25)]
    real = {"logprobs": [math.log(0.25), math.log(0.5)], "advantages": [1.0, -1.0]}
    real["weights"] = [1.0, 1.0]
    real["sequence_ratio_mask"] = [1.0, 1.0]
    config = {"beta": 0.5} if loss_fn == "dro" else GSPO_CLIP if loss_fn == "gspo" else None

    def inputs(pad: list[float]) -> dict[str, torch.Tensor]:
        return {k: _t([real[k] + pad]) for k in REQUIRED_INPUTS[loss_fn]}

    lp_short = _t([real_lp], grad=True)
    short = compute_loss(loss_fn, lp_short, inputs([]), _full_mask(lp_short), config)
    lp_long = _t([real_lp + [-50.0, float("nan")]], grad=True)
    mask = torch.tensor([[True, True, False, False]])
    long = compute_loss(loss_fn, lp_long, inputs([40.0, float("inf")]), mask, config)
    assert long.loss.item() == pytest.approx(short.loss.item())
    assert long.per_datum.tolist() == pytest.approx(short.per_datum.tolist())
    g_short = _grad(short.loss, lp_short)[0]
    g_long = _grad(long.loss, lp_long)[0]
    assert g_long[:2] == pytest.approx(g_short)
    assert g_long[2:] == [0.0, 0.0]


def test_dro_quadratic_term_is_masked_on_padding() -> None:
    lp = _t([[math.log(0.5), -7.0]], grad=True)
    sampler = _t([[math.log(0.5), 0.0]])
    adv = _t([[0.0, 0.0]])
    mask = torch.tensor([[True, False]])
    res = compute_loss("dro", lp, {"logprobs": sampler, "advantages": adv}, mask, {"beta": 2.0})
    # Real token: lp == q and A == 0, so 0. Padding would add 0.5 * 2 * 49 = 49 if unmasked.
    assert res.loss.item() == 0.0
    assert res.per_datum.tolist() == [0.0]


# --- gradients against finite differences -----------------------------------------------------


def _gradcheck(
    loss_fn: str,
    lp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
    cfg: dict[str, float] | None,
) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return compute_loss(loss_fn, x, inputs, mask, cfg).loss

    assert torch.autograd.gradcheck(fn, (lp,), eps=1e-6, atol=1e-7)


def test_gradients_match_finite_differences() -> None:
    gen = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 5, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    sampler = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 3
    adv = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    weights = torch.rand(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    rl = {"logprobs": sampler, "advantages": adv}
    _gradcheck("cross_entropy", lp, {"weights": weights}, mask, None)
    _gradcheck("importance_sampling", lp, rl, mask, None)
    _gradcheck("dro", lp, rl, mask, {"beta": 0.3})


def test_ppo_gradient_matches_finite_differences_away_from_kinks() -> None:
    # log-ratios chosen well away from log 0.8 and log 1.2, both signs of advantage.
    log_ratio = _t([[1.0, -1.0, 0.05, -0.05], [1.0, -1.0, 0.7, -0.7]])
    sampler = _t([[-1.0, -2.0, -0.5, -3.0], [-1.5, -2.5, -0.2, -1.0]])
    lp = (sampler + log_ratio).detach().requires_grad_(True)
    adv = _t([[1.0, 1.0, -2.0, 0.5], [-1.0, -1.0, 0.3, -0.3]])
    _gradcheck("ppo", lp, {"logprobs": sampler, "advantages": adv}, _full_mask(lp), None)


def test_cispo_gradient_matches_finite_differences_where_coefficient_is_constant() -> None:
    # Every ratio is outside [0.9, 1.1], so the clipped coefficient is constant in lp and the
    # stop-gradient matches the finite-difference derivative (inside the range it cannot, by
    # design: there the stop-gradient is checked by hand in the closed-form test above).
    log_ratio = _t([[0.5, -0.5, 1.0], [-1.0, 0.3, -0.3]])
    sampler = _t([[-1.0, -2.0, -0.5], [-1.5, -2.5, -0.2]])
    lp = (sampler + log_ratio).detach().requires_grad_(True)
    adv = _t([[1.0, -1.0, 2.0], [0.5, -0.5, 1.0]])
    cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    _gradcheck("cispo", lp, {"logprobs": sampler, "advantages": adv}, _full_mask(lp), cfg)


def test_gspo_gradient_matches_finite_differences_with_sequence_advantages() -> None:
    """With one advantage per sequence on its marked tokens (0 elsewhere), GSPO-token's loss is
    |M| * -min(s A, clip(s) A) as a function of the logprobs (s recomputed from them), and its
    stop-gradient gradient is that function's true gradient (the GSPO paper's equivalence): so
    finite differences of the loss value check the autograd gradient, padding and the mask
    included. Sequence ratios sit away from the clip kinks: s = e^0.2 inside [0.5, 2] (A > 0),
    e^1 above it with A < 0 (unclipped branch) and with A > 0 (clipped: gradient 0), e^-1 below
    it with A > 0 (unclipped)."""
    gen = torch.Generator().manual_seed(1)
    sampler = -torch.rand(5, 5, generator=gen, dtype=torch.float64) * 3 - 0.5
    noise = torch.randn(5, 5, generator=gen, dtype=torch.float64) * 0.3
    marks = _t([[1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 0, 0, 0],
                [0, 1, 1, 1, 0]])  # fmt: skip
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0],
                         [1, 1, 1, 1, 0]], dtype=torch.bool)  # fmt: skip
    target = torch.tensor([0.2, 1.0, 1.0, -1.0, 0.2], dtype=torch.float64)
    adv_row = torch.tensor([0.7, -1.3, 0.9, 0.4, -0.6], dtype=torch.float64)
    # Centre each row's marked noise so the marked mean log-ratio is exactly `target`.
    centred = noise - (noise * marks).sum(1, keepdim=True) / marks.sum(1, keepdim=True)
    lp = (sampler + target[:, None] + centred).detach().requires_grad_(True)
    adv = adv_row[:, None] * marks
    inputs = {"logprobs": sampler, "advantages": adv, "sequence_ratio_mask": marks}
    cfg = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    _gradcheck("gspo", lp, inputs, mask, cfg)
    # The clipped row really has no gradient and the others do (the check is not vacuous).
    (g,) = torch.autograd.grad(compute_loss("gspo", lp, inputs, mask, cfg).loss, lp)
    assert g[2].abs().sum().item() == 0.0
    assert all(g[r].abs().sum().item() > 0.1 for r in (0, 1, 3, 4))


# --- config validation ------------------------------------------------------------------------


def test_config_defaults_are_filled() -> None:
    assert validate_loss_config("ppo", None) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
    }
    assert validate_loss_config("cispo", {}) == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 4.0,
    }
    assert validate_loss_config("ppo", {"clip_high_threshold": 1.28}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.28,
    }
    assert validate_loss_config("dro", {"beta": 1}) == {"beta": 1.0}
    assert validate_loss_config("dro", {"beta": np.float32(0.5)}) == {"beta": 0.5}
    assert validate_loss_config("cross_entropy", None) == {}
    assert validate_loss_config("importance_sampling", {}) == {}


@pytest.mark.parametrize(
    ("loss_fn", "config", "needle"),
    [
        ("stable_reinforce", None, "loss_fn 'stable_reinforce' is not supported by this backend: "
         "Tinker publishes its sampling-side inputs"),
        ("gspo", None, "loss_fn_config['clip_low_threshold'] is required by loss 'gspo'"),
        ("gspo", {"clip_low_threshold": 0.8},
         "loss_fn_config['clip_high_threshold'] is required by loss 'gspo'"),
        ("gspo", {**GSPO_CLIP, "kl_coeff": 0.1}, "keys ['kl_coeff'] are not valid for loss 'gspo'"),
        ("gspo", {"clip_low_threshold": 1.1, "clip_high_threshold": 1.2},
         "clip_low_threshold=1.1"),
        ("sft", None, "loss_fn 'sft' is not supported"),
        ("ppo", {"clip_ratio": 0.2}, "'clip_ratio'"),
        ("cross_entropy", {"clip_low_threshold": 0.9}, "'clip_low_threshold'"),
        ("importance_sampling", {"beta": 0.1}, "'beta'"),
        ("dro", None, "loss_fn_config['beta'] is required by loss 'dro'"),
        ("dro", {"beta": -0.1}, "loss_fn_config['beta'] must be >= 0"),
        ("dro", {"beta": float("nan")}, "loss_fn_config['beta'] must be finite"),
        ("ppo", {"clip_low_threshold": "0.8"}, "loss_fn_config['clip_low_threshold'] must be a"),
        ("ppo", {"clip_high_threshold": True}, "loss_fn_config['clip_high_threshold'] must be a"),
        ("cispo", {"clip_low_threshold": 1.5}, "clip_low_threshold=1.5"),
        ("ppo", {"clip_high_threshold": 0.9}, "clip_high_threshold=0.9"),
    ],
)
def test_bad_config_names_the_key(loss_fn: str, config: dict | None, needle: str) -> None:
    with pytest.raises(LossInputError) as info:
        validate_loss_config(loss_fn, config)
    assert needle in str(info.value)


def test_compute_loss_rejects_bad_config() -> None:
    lp = _t([[-1.0]], grad=True)
    inputs = {"logprobs": _t([[-1.0]]), "advantages": _t([[1.0]])}
    with pytest.raises(LossInputError, match=r"loss_fn_config\['beta'\] is required"):
        compute_loss("dro", lp, inputs, _full_mask(lp), None)


# --- batch input validation -------------------------------------------------------------------


def test_compute_loss_missing_input_names_it() -> None:
    lp = _t([[-1.0, -2.0]], grad=True)
    with pytest.raises(LossInputError) as info:
        compute_loss("ppo", lp, {"logprobs": _t([[-1.0, -1.0]])}, _full_mask(lp), None)
    assert "loss_fn_inputs['advantages'] is required by loss 'ppo'" in str(info.value)


def test_compute_loss_shape_mismatch_names_field_and_shapes() -> None:
    lp = _t([[-1.0, -2.0]], grad=True)
    inputs = {"logprobs": _t([[-1.0, -1.0, -1.0]]), "advantages": _t([[1.0, 1.0]])}
    with pytest.raises(LossInputError) as info:
        compute_loss("importance_sampling", lp, inputs, _full_mask(lp), None)
    message = str(info.value)
    assert "loss_fn_inputs['logprobs']" in message
    assert "(1, 3)" in message and "(1, 2)" in message


@pytest.mark.parametrize("field", ["logprobs", "advantages"])
def test_compute_loss_non_finite_real_value_names_field(field: str) -> None:
    lp = _t([[-1.0, -2.0]], grad=True)
    inputs = {"logprobs": _t([[-1.0, -1.0]]), "advantages": _t([[1.0, 1.0]])}
    inputs[field] = _t([[1.0, float("nan")]])
    with pytest.raises(LossInputError, match=rf"loss_fn_inputs\['{field}'\] must be finite"):
        compute_loss("ppo", lp, inputs, _full_mask(lp), None)


def test_compute_loss_non_finite_weights_names_field() -> None:
    lp = _t([[-1.0]], grad=True)
    with pytest.raises(LossInputError, match=r"loss_fn_inputs\['weights'\] must be finite"):
        compute_loss("cross_entropy", lp, {"weights": _t([[float("inf")]])}, _full_mask(lp), None)


def test_compute_loss_rejects_unknown_input_and_bad_mask() -> None:
    lp = _t([[-1.0]], grad=True)
    inputs = {"logprobs": _t([[-1.0]]), "advantages": _t([[1.0]]), "weights": _t([[1.0]])}
    with pytest.raises(LossInputError, match=r"\['weights'\] are not accepted by loss 'dro'"):
        compute_loss("dro", lp, inputs, _full_mask(lp), {"beta": 0.1})
    with pytest.raises(LossInputError, match="mask must be a bool tensor"):
        compute_loss("cross_entropy", lp, {"weights": _t([[1.0]])}, torch.ones(1, 1), None)
    with pytest.raises(LossInputError, match="target_logprobs must be a float tensor"):
        compute_loss("cross_entropy", lp[0], {"weights": _t([[1.0]])}, _full_mask(lp), None)


def test_compute_loss_accepts_target_tokens_entry_and_float32() -> None:
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float32, requires_grad=True)
    inputs = {"target_tokens": torch.tensor([[7]]), "weights": torch.tensor([[2.0]])}
    res = compute_loss("cross_entropy", lp, inputs, _full_mask(lp), None)
    assert res.loss.dtype == torch.float32
    assert res.loss.item() == pytest.approx(2 * LN2)


# --- per-datum validation ---------------------------------------------------------------------


def _rl_datum(n: int = 3) -> dict[str, np.ndarray]:
    return {
        "target_tokens": np.arange(n, dtype=np.int64),
        "logprobs": np.full(n, -1.0, dtype=np.float32),
        "advantages": np.ones(n, dtype=np.float32),
    }


def test_validate_datum_accepts_well_formed_inputs() -> None:
    validate_datum_inputs("ppo", 3, _rl_datum(), index=0)
    validate_datum_inputs(
        "cross_entropy",
        2,
        {"target_tokens": np.array([5, 6]), "weights": np.array([0.0, 1.0])},
    )


def test_validate_datum_missing_required_names_field_and_index() -> None:
    datum = _rl_datum()
    del datum["advantages"]
    with pytest.raises(LossInputError) as info:
        validate_datum_inputs("cispo", 3, datum, index=4)
    assert str(info.value) == "datum 4: loss_fn_inputs['advantages'] is required by loss 'cispo'"


def test_validate_datum_missing_target_tokens() -> None:
    datum = _rl_datum()
    del datum["target_tokens"]
    with pytest.raises(LossInputError, match=r"loss_fn_inputs\['target_tokens'\] is required"):
        validate_datum_inputs("importance_sampling", 3, datum)


def test_validate_datum_target_length_must_match_model_input() -> None:
    with pytest.raises(LossInputError) as info:
        validate_datum_inputs("ppo", 4, _rl_datum(3), index=2)
    message = str(info.value)
    assert message.startswith("datum 2: loss_fn_inputs['target_tokens'] has length 3")
    assert "model_input has length 4" in message


def test_validate_datum_input_length_mismatch_names_field() -> None:
    datum = _rl_datum(3)
    datum["logprobs"] = np.zeros(2, dtype=np.float32)
    with pytest.raises(LossInputError, match=r"loss_fn_inputs\['logprobs'\] has length 2"):
        validate_datum_inputs("ppo", 3, datum)


@pytest.mark.parametrize(
    ("loss_fn", "field"),
    [("ppo", "advantages"), ("dro", "logprobs"), ("cross_entropy", "weights")],
)
def test_validate_datum_non_finite_names_field_and_position(loss_fn: str, field: str) -> None:
    datum = (
        _rl_datum(3)
        if loss_fn != "cross_entropy"
        else {
            "target_tokens": np.arange(3),
            "weights": np.ones(3),
        }
    )
    datum[field] = np.array([0.0, 0.0, np.inf])
    with pytest.raises(LossInputError) as info:
        validate_datum_inputs(loss_fn, 3, datum, index=1)
    assert f"datum 1: loss_fn_inputs[{field!r}] must be finite; position 2" in str(info.value)


def test_validate_datum_rejects_extra_keys_bad_shapes_and_tokens() -> None:
    datum = _rl_datum()
    datum["weights"] = np.ones(3)
    with pytest.raises(LossInputError, match=r"keys \['weights'\] are not accepted by loss 'dro'"):
        validate_datum_inputs("dro", 3, datum)
    topk = {"target_tokens": np.zeros((3, 2), dtype=np.int64), "weights": np.ones((3, 2))}
    with pytest.raises(LossInputError, match=r"\['target_tokens'\] must be 1-D"):
        validate_datum_inputs("cross_entropy", 3, topk)
    floats = {"target_tokens": np.array([1.0, 2.0]), "weights": np.ones(2)}
    with pytest.raises(LossInputError, match=r"\['target_tokens'\] must hold integers"):
        validate_datum_inputs("cross_entropy", 2, floats)
    negative = {"target_tokens": np.array([1, -1]), "weights": np.ones(2)}
    with pytest.raises(LossInputError, match="non-negative"):
        validate_datum_inputs("cross_entropy", 2, negative)
    with pytest.raises(LossInputError, match="at least one token"):
        validate_datum_inputs("cross_entropy", 0, {"target_tokens": np.array([], dtype=np.int64)})
    with pytest.raises(LossInputError, match="loss_fn 'custom' is not supported"):
        validate_datum_inputs("custom", 3, _rl_datum())


def test_validate_datum_gspo_needs_a_marked_sequence_ratio_mask() -> None:
    datum = _rl_datum(3)
    with pytest.raises(LossInputError) as info:
        validate_datum_inputs("gspo", 3, datum, index=5)
    assert str(info.value) == (
        "datum 5: loss_fn_inputs['sequence_ratio_mask'] is required by loss 'gspo'"
    )
    datum["sequence_ratio_mask"] = np.zeros(3, dtype=np.float32)
    with pytest.raises(LossInputError) as info:
        validate_datum_inputs("gspo", 3, datum, index=2)
    assert str(info.value).startswith(
        "datum 2: loss_fn_inputs['sequence_ratio_mask'] marks no token (all zeros)"
    )
    datum["sequence_ratio_mask"] = np.array([0.0, 1.0, 1.0], dtype=np.float32)
    validate_datum_inputs("gspo", 3, datum, index=2)
    with pytest.raises(LossInputError, match=r"keys \['sequence_ratio_mask'\] are not accepted"):
        validate_datum_inputs("ppo", 3, datum)
    with pytest.raises(LossInputError, match="loss_fn 'stable_reinforce' is not supported"):
        validate_datum_inputs("stable_reinforce", 3, _rl_datum())
