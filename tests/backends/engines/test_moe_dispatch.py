"""`megatron.moe_dispatch` (the `gather_dispatch` speed switch) against megatron-core's own
`permute` / `unpermute`: the same rows in the same expert order, the same probabilities, the same
restored tokens and the same input gradient (fp64, exact), on routings from a real top-k."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.moe.moe_utils import permute, unpermute  # noqa: E402

from oneloop.backends.megatron_local.engines.megatron import moe_dispatch  # noqa: E402


def _routing(tokens: int, experts: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randn(tokens, experts, generator=gen).topk(k, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.rand(tokens, experts, generator=gen, dtype=torch.float64) * routing_map
    hidden = torch.randn(tokens, 6, generator=gen, dtype=torch.float64)
    return routing_map, probs, hidden


@pytest.mark.parametrize(("tokens", "experts", "k"), [(37, 8, 3), (5, 4, 4), (64, 32, 1)])
def test_gathers_equal_megatron_permutations(tokens: int, experts: int, k: int) -> None:
    routing_map, probs, hidden = _routing(tokens, experts, k, seed=tokens)
    ours_in, theirs_in = (hidden.clone().requires_grad_(True) for _ in range(2))
    theirs, theirs_probs, sorted_indices, _, _ = permute(
        theirs_in, routing_map, probs=probs, num_out_tokens=tokens * k
    )
    order, token_of, rows_of = moe_dispatch.expert_order(routing_map, k)
    ours = moe_dispatch.to_experts(ours_in, token_of, rows_of)
    assert torch.equal(ours, theirs)
    assert torch.equal(token_of.squeeze(1), sorted_indices)
    assert torch.equal(probs.T.reshape(-1)[order], theirs_probs)
    # each token's k rows, and only its own
    assert torch.equal(token_of.squeeze(1)[rows_of], torch.arange(tokens)[:, None].expand(-1, k))
    scale = torch.randn(tokens * k, 1, dtype=torch.float64)  # an expert's work on each row
    restored_theirs = unpermute(theirs * scale, sorted_indices, restore_shape=hidden.shape)
    restored_ours = moe_dispatch.from_experts(ours * scale, token_of, rows_of)
    torch.testing.assert_close(restored_ours, restored_theirs, rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(hidden)
    (restored_ours * upstream).sum().backward()
    (restored_theirs * upstream).sum().backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-12, atol=1e-12)


def test_refused_where_the_config_rules_it_out() -> None:
    """Each megatron-core setting the gathers cannot serve is named (`use_gather_dispatch` raises
    with it, naming the switch to turn off)."""
    from types import SimpleNamespace

    base = dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=None,
                moe_router_padding_for_quantization=False, moe_permute_fusion=False)  # fmt: skip
    assert moe_dispatch.why_not(SimpleNamespace(**base)) is None
    for field, value, words in (
        ("moe_token_dispatcher_type", "allgather", "all-to-all"),
        ("moe_expert_capacity_factor", 1.0, "dropless"),
        ("moe_router_padding_for_quantization", True, "unpadded"),
        ("moe_permute_fusion", True, "fused permutation"),
    ):
        assert words in moe_dispatch.why_not(SimpleNamespace(**{**base, field: value}))


def test_grouped_experts_weighted_swiglu_kernels_equal_eager() -> None:
    """Under `swiglu_fusion` the grouped experts' SiLU(gate)·up·probability is megatron-core's
    weighted SwiGLU (its own forward and backward): the same output and gradients (tokens, routing
    probabilities, weights) as the plain torch expression, an expert with no token included. Run
    with torch.compile in eager stance: the math, without an Inductor build on CI's CPUs."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from oneloop.backends.megatron_local.engines.megatron.grouped_experts import experts_class

    results = []
    for fused in (False, True):
        config = TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=1, ffn_hidden_size=16,
            moe_ffn_hidden_size=4, num_moe_experts=3, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=fused,
            use_cpu_initialization=True, params_dtype=torch.float32,
        )  # fmt: skip
        torch.manual_seed(0)
        experts = experts_class()(3, config)
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randn(10, 8, generator=gen, dtype=torch.float32).requires_grad_(True)
        probs = torch.rand(10, generator=gen, dtype=torch.float32).requires_grad_(True)
        with torch.compiler.set_stance("force_eager"):
            out, _ = experts(tokens, torch.tensor([3, 0, 7]), probs)
            (out * torch.randn(out.shape, generator=gen, dtype=torch.float32)).sum().backward()
        results.append([out, tokens.grad, probs.grad, experts.grouped_fc1.grad,
                        experts.grouped_fc2.grad])  # fmt: skip
    for plain, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
