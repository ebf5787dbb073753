"""Gated DeltaNet training kernels (`engines.gdn_kernels`): where flash-linear-attention refuses
its gated backward (Hopper + Triton >= 3.4, < 3.7.1, no tilelang: what the H200 has), the trainer
engines switch to the torch chunked delta rule. CPU: the refusal rule read from fla's own flags
(a stand-in `fla.utils` module: fla is a GPU-only package here), and transformers' switch giving
the same loss and gradients as its dispatcher on a tiny Qwen3.5 hybrid."""

import sys
import types

import pytest
import torch

from oneloop.backends.megatron_local.engines import gdn_kernels
from oneloop.backends.megatron_local.engines.hf import load_causal_lm
from oneloop.tiny.model import TINY_QWEN3_5, build_tiny_model, named_tiny_specs


def _fla_flags(monkeypatch, hopper: bool, above_3_4: bool, above_3_7_1: bool) -> None:
    utils = types.SimpleNamespace(
        IS_NVIDIA_HOPPER=hopper, TRITON_ABOVE_3_4_0=above_3_4, TRITON_ABOVE_3_7_1=above_3_7_1
    )
    fla = types.ModuleType("fla")
    fla.utils = utils
    monkeypatch.setitem(sys.modules, "fla", fla)
    monkeypatch.setitem(sys.modules, "fla.utils", utils)


@pytest.mark.parametrize(
    ("hopper", "above_3_4", "above_3_7_1", "refused"),
    [
        (True, True, False, True),  # the H200 image: Triton 3.6
        (True, True, True, False),  # Triton >= 3.7.1
        (False, True, False, False),  # not Hopper
        (True, False, False, False),  # Triton < 3.4
    ],
)
def test_refusal_follows_fla_flags(monkeypatch, hopper, above_3_4, above_3_7_1, refused):
    pytest.importorskip("triton")
    _fla_flags(monkeypatch, hopper, above_3_4, above_3_7_1)
    monkeypatch.setattr(gdn_kernels.importlib.util, "find_spec", lambda name: None)
    reason = gdn_kernels.fla_backward_refusal()
    assert (reason is not None) == refused
    if refused:
        assert "Hopper" in reason and "3.7.1" in reason


def test_tilelang_lifts_the_refusal(monkeypatch):
    pytest.importorskip("triton")
    _fla_flags(monkeypatch, True, True, False)
    monkeypatch.setattr(gdn_kernels.importlib.util, "find_spec", lambda name: object())
    assert gdn_kernels.fla_backward_refusal() is None


def test_transformers_switch_keeps_loss_and_gradients(monkeypatch):
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    model = load_causal_lm(build_tiny_model(named_tiny_specs()[TINY_QWEN3_5]), "float32")
    tokens = torch.randint(
        0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)
    )

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    dispatched = modeling.torch_chunk_gated_delta_rule
    before, grads_before = loss_and_grads()
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", dispatched)  # restored after
    switched = gdn_kernels.use_torch_delta_rule_in_transformers()
    assert modeling.__name__ in switched
    assert modeling.torch_chunk_gated_delta_rule is dispatched.__wrapped__
    after, grads_after = loss_and_grads()
    assert torch.equal(before, after)
    assert all(torch.equal(a, b) for a, b in zip(grads_before, grads_after, strict=True))


@pytest.mark.parametrize("refused", [True, False])
def test_switch_runs_only_where_fla_refuses(monkeypatch, refused):
    pytest.importorskip("triton")
    _fla_flags(monkeypatch, True, True, not refused)
    monkeypatch.setattr(gdn_kernels.importlib.util, "find_spec", lambda name: None)
    calls = []
    chosen = gdn_kernels.torch_rule_where_refused(lambda: calls.append(1), "torch")
    assert (chosen, calls) == (("torch", [1]) if refused else (None, []))
