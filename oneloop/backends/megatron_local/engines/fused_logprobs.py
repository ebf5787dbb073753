"""Target logprobs straight from the last hidden states, without fp32 full-vocabulary logits.

`hf.token_logprobs(logits, targets)` casts the `[tokens, vocab]` logits to fp32 and lets autograd
keep that copy plus the log-softmax temporaries: at 16k tokens × 152k vocab that is 10 GB fp32 per
tensor and ~100 bytes of memory traffic per logit over forward and backward, which is why the
megatron engine could only run two 4k sequences per micro-batch. `linear_logprobs` computes the
same values with one custom autograd function:

- forward: one bf16 matmul for the logits (the same GEMM the output layer runs), then per chunk of
  rows the fp32 log-sum-exp and the target logit; only the bf16 logits and the per-token
  log-sum-exp are kept for backward;
- backward: per chunk, d logp / d logits = g · (onehot(target) − softmax) in fp32, cast to the
  logits dtype and written over the saved logits, then the two matmuls of the output layer
  (hidden and weight gradients) over all rows at once.

`kernels` picks how the per-row math runs: `eager` (torch ops per chunk of rows, in place where
it can), `inductor` (the per-chunk math as two torch.compile kernels: the forward reads the bf16
logits, the gradient reads them and stores its result in their place) or `triton`
(`logprob_kernels`: two hand-written Triton kernels over all rows at once, ~6 bytes per logit, no
fp32 temporaries). Values equal `token_logprobs(hidden @ weight.T, targets)`: the same logits,
fp32 reductions; gradients equal autograd's through that path up to fp32 summation order.
"""

from collections.abc import Callable
from typing import Literal

import torch

from oneloop.backends.megatron_local.engines import logprob_kernels

CHUNK_ROWS = 2048  # 2048 × 152k vocab: a 1.2 GB fp32 chunk (eager) and < 2**31 elements per kernel
# GEMMs whose [rows, vocab] operand would pass 2**31 elements run in row blocks (16k tokens × 152k
# vocab is 2.5e9): the same per-row results; the weight gradient then sums the blocks in fp32.
GEMM_MAX_ELEMENTS = 2**31 - 1
LogprobKernels = Literal["eager", "inductor", "triton"]
KERNELS: tuple[str, ...] = ("eager", "inductor", "triton")


def _chunk_forward(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logprob, log-sum-exp) per row of a `[rows, vocab]` chunk, in fp32."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - lse, lse


def _chunk_grad(
    logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """g · (onehot(target) − softmax) per row, in the logits dtype (`chunk_grad_into`'s math)."""
    x = logits.float()
    prob = torch.exp(x - lse.unsqueeze(-1))
    vocab = torch.arange(x.size(-1), device=x.device)
    onehot = (vocab.unsqueeze(0) == targets.unsqueeze(-1)).to(torch.float32)
    return ((onehot - prob) * grad.unsqueeze(-1)).to(logits.dtype)


def chunk_grad_into(
    logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor
) -> None:
    """`_chunk_grad` written over the chunk itself. Compiled, Inductor makes this one kernel that
    reads each logit and stores its gradient in its place: returning the gradient instead would
    cost a new chunk-sized buffer and a copy of it into the logits."""
    logits.copy_(_chunk_grad(logits, lse, grad, targets))


def _chunk_grad_eager(
    logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor
) -> None:
    """Same as `chunk_grad_into`, computed in place on one fp32 copy of the chunk."""
    x = logits.float()
    x.sub_(lse.unsqueeze(-1)).exp_().mul_(-grad.unsqueeze(-1))
    x.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1))
    logits.copy_(x)


_COMPILED: dict[str, Callable] = {}


def _chunk_kernels(kernels: str) -> tuple[Callable, Callable]:
    """The per-chunk forward and in-place gradient functions of `eager` or `inductor`."""
    if kernels == "eager":
        return _chunk_forward, _chunk_grad_eager
    if not _COMPILED:
        _COMPILED["forward"] = torch.compile(_chunk_forward, dynamic=True)
        _COMPILED["grad"] = torch.compile(chunk_grad_into, dynamic=True)
    return _COMPILED["forward"], _COMPILED["grad"]


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, block_rows, kernels):  # type: ignore[override]
        rows = hidden.size(0)
        blocks = -(-rows // block_rows)
        block_rows = -(-rows // blocks)  # equal blocks: 16k rows go as 2 × 8k, not 14k + 2k
        if rows <= block_rows:
            logits = hidden @ weight.t()
        else:
            logits = hidden.new_empty(rows, weight.size(0))
            for start in range(0, rows, block_rows):
                part = slice(start, start + block_rows)
                torch.matmul(hidden[part], weight.t(), out=logits[part])
        if kernels == "triton":
            logprobs, lse = logprob_kernels.lse_and_target(logits, targets)
        else:
            forward_fn, _ = _chunk_kernels(kernels)
            logprobs = torch.empty(rows, dtype=torch.float32, device=hidden.device)
            lse = torch.empty(rows, dtype=torch.float32, device=hidden.device)
            for start in range(0, rows, chunk_rows):
                part = slice(start, start + chunk_rows)
                logprobs[part], lse[part] = forward_fn(logits[part], targets[part])
        ctx.save_for_backward(hidden, weight, targets, logits, lse)
        ctx.chunk_rows, ctx.block_rows, ctx.kernels = chunk_rows, block_rows, kernels
        return logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs):  # type: ignore[override]
        hidden, weight, targets, logits, lse = ctx.saved_tensors
        grad_logprobs = grad_logprobs.float().contiguous()
        # The saved logits are this function's own buffer: overwrite them with their gradient.
        if ctx.kernels == "triton":
            logprob_kernels.grad_in_place(logits, lse, grad_logprobs, targets)
        else:
            _, grad_into = _chunk_kernels(ctx.kernels)
            for start in range(0, logits.size(0), ctx.chunk_rows):
                part = slice(start, start + ctx.chunk_rows)
                grad_into(logits[part], lse[part], grad_logprobs[part], targets[part])
        rows, block = logits.size(0), ctx.block_rows
        grad_hidden = grad_weight = None
        if rows <= block:
            if ctx.needs_input_grad[0]:
                grad_hidden = logits @ weight
            if ctx.needs_input_grad[1]:
                grad_weight = logits.t() @ hidden
            return grad_hidden, grad_weight, None, None, None, None
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.empty_like(hidden)
            for start in range(0, rows, block):
                part = slice(start, start + block)
                torch.matmul(logits[part], weight, out=grad_hidden[part])
        if ctx.needs_input_grad[1]:
            total = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for start in range(0, rows, block):
                part = slice(start, start + block)
                total += logits[part].t() @ hidden[part]
            grad_weight = total.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_rows: int = CHUNK_ROWS,
    kernels: LogprobKernels = "eager",
    block_rows: int | None = None,
) -> torch.Tensor:
    """log softmax(hidden @ weight.T)[target] per row: hidden [tokens, h], weight [vocab, h],
    targets [tokens] (int64) → fp32 [tokens]. See the module docstring; `block_rows` (default:
    the most rows under GEMM_MAX_ELEMENTS) bounds the rows of one GEMM."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(
            f"linear_logprobs: hidden [tokens, h] and weight [vocab, h] expected, got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [tokens={hidden.size(0)}]")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if block_rows is None:
        block_rows = max(1, GEMM_MAX_ELEMENTS // weight.size(0))
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels {kernels!r}: expected one of {', '.join(KERNELS)}")
    if kernels == "triton" and not logprob_kernels.runnable(hidden):
        raise ValueError(
            "linear_logprobs(kernels='triton') runs Triton kernels: CUDA tensors expected (or "
            f"TRITON_INTERPRET=1), got {hidden.device}"
        )
    return _LinearLogprobs.apply(
        hidden, weight, targets.long().contiguous(), chunk_rows, block_rows, kernels
    )


def megatron_logprobs_processor(
    targets: torch.Tensor, *, chunk_rows: int = CHUNK_ROWS, kernels: LogprobKernels = "eager"
) -> Callable[..., torch.Tensor]:
    """An `output_processor` for megatron-core's `GPTModel.forward`: it receives the final hidden
    states [s, b, h] and the output layer, and returns target logprobs [b, s] (fp32) for
    `targets` [b, s] instead of the model's logits (tensor parallel size 1 only)."""

    def process(*, hidden_states, output_layer, output_weight, **_unused) -> torch.Tensor:
        weight = output_weight if output_weight is not None else output_layer.weight
        seq, batch, width = hidden_states.shape
        flat = hidden_states.transpose(0, 1).reshape(batch * seq, width)
        logprobs = linear_logprobs(
            flat, weight, targets.reshape(-1), chunk_rows=chunk_rows, kernels=kernels
        )
        return logprobs.view(batch, seq)

    return process
