"""`linear_logprobs` against the engines' reference path `token_logprobs(hidden @ W.T, targets)`:
same values and the same gradients for hidden and weight, under a non-trivial upstream gradient."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oneloop.backends.megatron_local.engines import fused_logprobs
from oneloop.backends.megatron_local.engines.fused_logprobs import (
    linear_logprobs,
    megatron_logprobs_processor,
)
from oneloop.backends.megatron_local.engines.hf import token_logprobs


def _case(dtype: torch.dtype, tokens: int = 37, width: int = 16, vocab: int = 101):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=gen).to(dtype)
    weight = (torch.randn(vocab, width, generator=gen) / width**0.5).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    upstream = torch.randn(tokens, generator=gen)
    return hidden, weight, targets, upstream


def _grads(fn, hidden, weight, targets, upstream):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp = fn(h, w, targets)
    (lp * upstream).sum().backward()
    return lp.detach(), h.grad, w.grad


def _reference(h, w, t):
    return token_logprobs(h @ w.t(), t)


@pytest.mark.parametrize(("chunk_rows", "block_rows"), [(1, None), (8, None), (64, None), (8, 5)])
def test_fp32_equals_reference(chunk_rows: int, block_rows: int | None) -> None:
    """block_rows=5: GEMMs in row blocks (what a [tokens, vocab] past 2**31 elements takes)."""
    case = _case(torch.float32)
    ref = _grads(_reference, *case)
    got = _grads(
        lambda h, w, t: linear_logprobs(h, w, t, chunk_rows=chunk_rows, block_rows=block_rows),
        *case,
    )
    for r, g in zip(ref, got, strict=True):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_bf16_equals_reference_within_bf16() -> None:
    case = _case(torch.bfloat16)
    ref = _grads(_reference, *case)
    got = _grads(lambda h, w, t: linear_logprobs(h, w, t, chunk_rows=8), *case)
    # Logprobs: the same bf16 logits reduced in fp32, so equal to fp32 rounding.
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    for r, g in zip(ref[1:], got[1:], strict=True):  # gradients: one bf16 rounding apart
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2)


def test_inductor_kernels_equal_eager() -> None:
    case = _case(torch.float32, tokens=19, vocab=53)
    eager = _grads(lambda h, w, t: linear_logprobs(h, w, t, chunk_rows=8), *case)
    compiled = _grads(
        lambda h, w, t: linear_logprobs(h, w, t, chunk_rows=8, kernels="inductor"), *case
    )
    for e, c in zip(eager, compiled, strict=True):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


def test_inductor_gradient_is_one_kernel_writing_over_the_logits() -> None:
    """The compiled per-chunk gradient stores into the chunk it reads (no chunk-sized buffer, no
    copy back): one generated kernel whose call allocates nothing, and the chunk holds the
    gradient afterwards."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 300, generator=gen).to(torch.bfloat16)
    lse = torch.logsumexp(logits.float(), dim=-1)
    grad, targets = torch.randn(12, generator=gen), torch.randint(0, 300, (12,), generator=gen)
    before, eager = logits.clone(), logits.clone()
    fused_logprobs.chunk_grad_into(eager, lse, grad, targets)  # the same function, uncompiled
    compiled = torch.compile(fused_logprobs.chunk_grad_into, dynamic=True)
    _, (code,) = run_and_get_code(compiled, logits, lse, grad, targets)
    call = code[code.index("def call(") :]
    assert "empty_strided" not in call, call
    assert len(re.findall(r"cpp_fused_\w+\(", call)) == 1, call
    torch.testing.assert_close(logits.float(), eager.float(), rtol=1e-2, atol=1e-2)  # bf16 ulps
    assert not torch.equal(logits, before)  # the chunk now holds its gradient


# Run in a child process under Triton's CPU interpreter (TRITON_INTERPRET must be set before
# Triton compiles anything, and this process may already have).
_COMPILED_VS_EAGER = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.backends.engines.test_fused_logprobs import _case, _grads
from oneloop.backends.megatron_local.engines.fused_logprobs import linear_logprobs
out = {}
for name, dtype, vocab in (("fp32", torch.float32, 53), ("bf16_blocks", torch.bfloat16, 9000)):
    case = _case(dtype, tokens=19, vocab=vocab)
    eager = _grads(lambda h, w, t: linear_logprobs(h, w, t, chunk_rows=8), *case)
    compiled = _grads(lambda h, w, t: linear_logprobs(h, w, t, kernels="triton"), *case)
    out[name] = [
        [str(c.dtype).removeprefix("torch."), (c.float() - e.float()).abs().max().item(),
         e.float().abs().max().item()]
        for e, c in zip(eager, compiled, strict=True)
    ]
print(json.dumps(out))
"""


def test_triton_kernels_equal_eager() -> None:
    """The Triton kernels (kernels="triton") against the eager chunks, fp32 and bf16; the bf16 case
    has a vocabulary of 9,000 (three kernel blocks, the last one partly masked)."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _COMPILED_VS_EAGER, str(root)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=root)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    dtypes = ("float32", "bfloat16")
    for dtype, (logprobs, grad_hidden, grad_weight) in zip(dtypes, out.values(), strict=True):
        assert logprobs[0] == "float32" and logprobs[1] <= 1e-5 * max(1.0, logprobs[2]), out
        for got in (grad_hidden, grad_weight):
            assert got[0] == dtype
            # fp32: summation order only; bf16: the gradient rows round to bf16 either way
            assert got[1] <= (1e-5 if dtype == "float32" else 1e-2) * max(1.0, got[2]), out


def test_triton_refuses_cpu_tensors_and_unknown_kernels(monkeypatch) -> None:
    hidden, weight, targets, _ = _case(torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would take CPU tensors
    with pytest.raises(ValueError, match="CUDA tensors expected"):
        linear_logprobs(hidden, weight, targets, kernels="triton")
    with pytest.raises(ValueError, match="expected one of eager, inductor, triton"):
        linear_logprobs(hidden, weight, targets, kernels="cuda")  # type: ignore[arg-type]


def test_forward_only_under_no_grad() -> None:
    hidden, weight, targets, _ = _case(torch.float32)
    with torch.no_grad():
        lp = linear_logprobs(hidden, weight, targets)
    torch.testing.assert_close(lp, _reference(hidden, weight, targets), rtol=1e-5, atol=1e-5)


def test_megatron_processor_layout() -> None:
    """The output_processor gets hidden [s, b, h] and returns logprobs [b, s]; untied models
    pass output_weight=None and the processor uses the output layer's weight."""
    hidden, weight, _, _ = _case(torch.float32, tokens=12)
    seq_first = hidden.view(4, 3, -1)  # [s=4, b=3, h]
    targets = torch.randint(0, weight.size(0), (3, 4))  # [b, s]
    layer = torch.nn.Linear(weight.size(1), weight.size(0), bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
        got = megatron_logprobs_processor(targets)(
            hidden_states=seq_first, output_layer=layer, output_weight=None, labels=None
        )
    want = _reference(seq_first.transpose(0, 1), weight, targets)
    assert got.shape == (3, 4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise() -> None:
    hidden, weight, targets, _ = _case(torch.float32)
    with pytest.raises(ValueError, match="hidden"):
        linear_logprobs(hidden[:, :3], weight, targets)
    with pytest.raises(ValueError, match="targets"):
        linear_logprobs(hidden, weight, targets[:-1])
