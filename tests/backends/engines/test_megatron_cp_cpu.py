"""Context-parallel layout and attention of the megatron engine (`parallel.cp`, pure torch).

The CP ranks are simulated in one process: each rank's shard of q (its two chunks) attends over the
full K/V, and the merged outputs and the summed gradients must equal plain causal SDPA on the full
sequence. The differentiable all-gather runs for real on two gloo ranks (this file run as a
script is that subprocess). The engine itself (megatron-core) is checked by
tests/backends/engines/megatron_cpu/test_megatron_cp_gloo.py and tests/gpu/test_megatron_cp.py.
"""

import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

from oneloop.backends.megatron_local.engines.base import LoraSpec
from oneloop.backends.megatron_local.engines.megatron.parallel.cp import (
    cp_attention,
    gather_rows,
    gather_sequence,
    merge_shards,
    padded_length,
    rank_positions,
    split_for_rank,
)
from oneloop.backends.megatron_local.engines.megatron.parallel.cp_rank import check_cp
from oneloop.backends.megatron_local.engines.megatron.speed import MegatronSpeed
from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel
from oneloop.errors import CapabilityError


def test_padded_length_rounds_up_to_whole_chunks() -> None:
    assert [padded_length(n, 2) for n in (1, 3, 4, 5, 8, 9)] == [4, 4, 4, 8, 8, 12]
    assert padded_length(7, 1) == 8  # cp = 1 still pads to 2 chunks (never used there)
    with pytest.raises(ValueError, match="length >= 1"):
        padded_length(0, 2)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_rank_positions_are_megatrons_zigzag_chunks(cp: int) -> None:
    seq = 2 * cp * 5
    table = torch.arange(seq)
    seen = []
    for rank in range(cp):
        mine = rank_positions(seq, cp, rank)
        # megatron-core 0.19 get_pos_emb_on_this_cp_rank: view as 2cp chunks, take r and 2cp-1-r
        megatron = table.view(2 * cp, -1)[[rank, 2 * cp - 1 - rank]].reshape(-1)
        assert torch.equal(mine, megatron)
        seen.append(mine)
    assert torch.equal(torch.sort(torch.cat(seen)).values, table)  # each position exactly once
    with pytest.raises(ValueError, match="multiple of 2"):
        rank_positions(seq + 1, cp, 0)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_split_then_merge_is_identity(cp: int) -> None:
    x = torch.randn(3, 2 * cp * 4, 5)
    shards = [split_for_rank(x, cp, rank, dim=1) for rank in range(cp)]
    assert all(s.shape == (3, 8, 5) for s in shards)
    assert torch.equal(merge_shards(shards, dim=1), x)


def _full_and_sharded(cp: int, seq: int, heads: int = 4, kv_heads: int = 2):
    """Causal SDPA on the full sequence vs the CP ranks' outputs merged; gradients of both."""
    torch.manual_seed(cp)
    q = torch.randn(2, heads, seq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, heads, seq, 8, dtype=torch.float64)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (full * weight).sum().backward()
    expected = (full.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    q.grad = k.grad = v.grad = None
    outs = []
    for rank in range(cp):  # each rank's loss part; K/V grads add up as the all-gather's backward
        out = cp_attention(split_for_rank(q, cp, rank, dim=2), k, v, cp, rank)
        (out * split_for_rank(weight, cp, rank, dim=2)).sum().backward()
        outs.append(out.detach())
    return expected, (merge_shards(outs, dim=2), q.grad, k.grad, v.grad)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_cp_attention_equals_full_causal_attention_with_gqa(cp: int) -> None:
    expected, got = _full_and_sharded(cp, seq=2 * cp * 6)
    for name, a, b in zip(("out", "dq", "dk", "dv"), expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10, msg=name)


def test_padding_after_the_sequence_leaves_real_positions_unchanged() -> None:
    cp, n = 2, 11
    seq = padded_length(n, cp)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, seq, 8, dtype=torch.float64) for _ in range(3))
    k[:, :, n:], v[:, :, n:] = 1e3, -1e3  # junk padding must never reach a real query
    reference = F.scaled_dot_product_attention(
        q[:, :, :n], k[:, :, :n], v[:, :, :n], is_causal=True
    )
    shards = [cp_attention(split_for_rank(q, cp, r, dim=2), k, v, cp, r) for r in range(cp)]
    torch.testing.assert_close(merge_shards(shards, dim=2)[:, :, :n], reference)


def test_cp_attention_rejects_mismatched_shapes() -> None:
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="2·cp·chunk"):
        cp_attention(q, torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), cp=2, rank=0)
    with pytest.raises(ValueError, match="two equal chunks"):
        cp_attention(q[:, :, :5], torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), 2, 0)


def test_check_cp_refuses_what_is_not_supported() -> None:
    speed = MegatronSpeed()
    check_cp(MegatronParallel(tp=2, cp=2), LoraSpec(0), speed)  # tp × cp is supported
    with pytest.raises(CapabilityError, match="LoRA rank 8 with local.megatron.cp=2"):
        check_cp(MegatronParallel(cp=2), LoraSpec(8), speed)
    with pytest.raises(CapabilityError, match="pp=2"):
        check_cp(MegatronParallel(cp=2, pp=2), LoraSpec(0), speed)
    with pytest.raises(CapabilityError, match="cudnn"):
        check_cp(MegatronParallel(cp=2), LoraSpec(0), MegatronSpeed(attention_backend="cudnn"))


# -- the differentiable all-gather on two real gloo ranks ------------------------------------------

CP = 2
SEQ = 12


def _gather_rank(rank: int, address: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=address, world_size=CP, rank=rank, timeout=timedelta(seconds=240)
    )
    group = torch.distributed.new_group(list(range(CP)))
    full = torch.arange(SEQ * 3, dtype=torch.float64).view(SEQ, 3)
    mine = split_for_rank(full, CP, rank, dim=0).clone().requires_grad_(True)
    gathered = gather_sequence(mine, group)
    assert torch.equal(gathered, full), "all-gather lost the global order"
    weights = [
        torch.randn(SEQ, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
        for r in range(CP)
    ]
    (gathered * weights[rank]).sum().backward()  # each rank's loss part
    expected = split_for_rank(sum(weights), CP, rank, dim=0)  # d(sum of parts)/d(my shard)
    assert torch.equal(mine.grad, expected), "backward is not the sum over ranks of my part"
    rows = gather_rows(mine.detach().T.contiguous(), group)
    assert torch.equal(rows, full.T)
    torch.distributed.destroy_process_group()


def test_gather_sequence_on_two_gloo_ranks() -> None:
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GATHER OK" in done.stdout


if __name__ == "__main__":
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_gather_rank, args=(f"tcp://127.0.0.1:{port}",), nprocs=CP, join=True)
    print("GATHER OK")
