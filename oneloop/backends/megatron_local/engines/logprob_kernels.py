"""Triton kernels for the per-row logprob math of `fused_logprobs` (`kernels="triton"`; the
megatron engine's opt-in `speed.triton_logprobs`).

Both passes over the `[rows, vocab]` bf16 logits are memory-bound, one program per row:

- `lse_and_target`: one read of the row, an online log-sum-exp in fp32 (a running maximum and
  the sum rescaled when it grows, one exp per logit), then the target's logit: the row's target
  logprob and log-sum-exp;
- `grad_in_place`: one read and one write of the row: g · (onehot(target) − exp(x − lse)) in
  fp32, stored over the logits in their dtype (the backward's own buffer, as the eager path).

Why: measured on an H200 with the 4-layer Qwen3-30B-A3B width at 64k tokens a micro-batch
(`gpu_mfu.py`, 152k vocab), torch.compile's (Inductor's) kernels for the same math took 19 ms and
36 ms of a 641 ms step, about 1 TB/s of the bandwidth; these should take about a third of that.
Not yet run on a GPU (none was lent after they were written), hence opt-in: the CPU tests run
them under Triton's interpreter (`TRITON_INTERPRET=1`), and `tests/gpu/test_megatron_speed.py`
and `gpu_mfu.py --variants all_mb64k,all_mb64k_triton` are what settles them on the device.
"""

import os

import torch

BLOCK = 4096  # vocabulary columns a program handles per loop step
WARPS = 8


def interpreted() -> bool:
    """Triton's CPU interpreter is on (kernels then run on CPU tensors: tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runnable(tensor: torch.Tensor) -> bool:
    """These kernels can run on `tensor`: a CUDA tensor, or any under the interpreter."""
    return tensor.is_cuda or interpreted()


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def lse_target(logits, targets, lse_out, logprob_out, vocab, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        cols = tl.arange(0, BLOCK)
        high = float("-inf")  # the running maximum and the sum of exp(x - high) so far
        total = 0.0
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
            new_high = tl.maximum(high, tl.max(x, axis=0))
            total = total * tl.exp(high - new_high) + tl.sum(tl.exp(x - new_high), axis=0)
            high = new_high
        lse = high + tl.log(total)
        target = tl.load(base + tl.load(targets + row)).to(tl.float32)
        tl.store(lse_out + row, lse)
        tl.store(logprob_out + row, target - lse)

    @triton.jit
    def grad(logits, targets, lse_in, grad_in, vocab, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        cols = tl.arange(0, BLOCK)
        lse = tl.load(lse_in + row)
        g = tl.load(grad_in + row)
        target = tl.load(targets + row)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            mask = idx < vocab
            x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
            value = (tl.where(idx == target, 1.0, 0.0) - tl.exp(x - lse)) * g
            tl.store(base + idx, value.to(logits.dtype.element_ty), mask=mask)

    return lse_target, grad


_COMPILED: list = []


def _get():
    if not _COMPILED:
        _COMPILED.extend(_kernels())
    return _COMPILED


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits: a [rows, vocab] tensor with unit column stride expected, got "
                         f"shape {tuple(logits.shape)} strides {logits.stride()}")  # fmt: skip
    if targets.shape != logits.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"targets: int64 [rows={logits.size(0)}] expected, got "
                         f"{targets.dtype} {tuple(targets.shape)}")  # fmt: skip


def lse_and_target(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """logits [rows, vocab] (any float dtype), targets int64 [rows] → (target logprob, log-sum-exp),
    both fp32 [rows]."""
    _check(logits, targets)
    rows, vocab = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    logprobs = torch.empty_like(lse)
    if rows:
        kernel, _ = _get()
        kernel[(rows,)](logits, targets, lse, logprobs, vocab, logits.stride(0),
                        BLOCK=BLOCK, num_warps=WARPS)  # fmt: skip
    return logprobs, lse


def grad_in_place(
    logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Overwrite logits [rows, vocab] with grad · (onehot(targets) − softmax) row by row (lse and
    grad fp32 [rows]); returns logits."""
    _check(logits, targets)
    rows, vocab = logits.shape
    for name, value in (("lse", lse), ("grad", grad)):
        if value.shape != (rows,) or value.dtype != torch.float32 or not value.is_contiguous():
            raise ValueError(f"{name}: contiguous fp32 [rows={rows}] expected, got "
                             f"{value.dtype} {tuple(value.shape)}")  # fmt: skip
    if rows:
        _, kernel = _get()
        kernel[(rows,)](logits, targets, lse, grad, vocab, logits.stride(0),
                        BLOCK=BLOCK, num_warps=WARPS)  # fmt: skip
    return logits
