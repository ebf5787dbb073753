"""The `megatron` engine's LoRA adapters split over tensor-parallel ranks (`parallel.lora_shard`,
`megatron.lora.LoraDelta` at TP > 1), on CPU without megatron-core.

The ranks are simulated in one process: each rank's `LoraDelta` is built from the same seed, and
the one communication step (`megatron.lora._join_ranks`) is replaced by what it computes in the
forward pass for one rank's view — identity for column-parallel bases (Megatron's copy-to region),
and for row-parallel bases the sum over ranks is taken after B, which is the same by linearity.
The real collectives run in megatron_cpu/test_megatron_lora_tp_gloo.py (gloo) and
tests/gpu/test_megatron_lora_tp.py.
"""

import numpy as np
import pytest
import torch

from oneloop.backends.megatron_local.engines.base import LoraSpec
from oneloop.backends.megatron_local.engines.megatron import lora as megatron_lora
from oneloop.backends.megatron_local.engines.megatron.layout import DenseShape
from oneloop.backends.megatron_local.engines.megatron.parallel import lora_shard as lshard
from oneloop.backends.megatron_local.engines.megatron.parallel.shard import gather

# 4 query heads in 2 KV groups: at TP = 2 each rank holds one group (2 q heads, 1 k, 1 v).
SHAPE = DenseShape("qwen3", 1, 16, 24, 4, 2, 4, 32, False, False, True, 1e4, 1e-6, 64)
SITES = {  # Megatron linear → (its weight's name for megatron.parallel.shard, HF targets)
    "linear_qkv": (
        "decoder.layers.0.self_attention.linear_qkv.weight",
        ("q_proj", "k_proj", "v_proj"),
    ),
    "linear_proj": ("decoder.layers.0.self_attention.linear_proj.weight", ("o_proj",)),
    "linear_fc1": ("decoder.layers.0.mlp.linear_fc1.weight", ("gate_proj", "up_proj")),
    "linear_fc2": ("decoder.layers.0.mlp.linear_fc2.weight", ("down_proj",)),
    "output_layer": ("output_layer.weight", ("lm_head",)),
}
RANK = 4


def _delta(targets, tp: int, rank: int) -> megatron_lora.LoraDelta:
    """One rank's adapters of a site, B filled with seeded noise (B = 0 would hide the layout)."""
    dims = megatron_lora.target_dims(SHAPE)
    delta = megatron_lora.LoraDelta(
        {t: dims[t] for t in targets},
        RANK,
        megatron_lora.delta_fuser(lshard.local_shape(SHAPE, tp), targets),
        torch.Generator().manual_seed(0),
        torch.device("cpu"),
        megatron_lora.LoraTp(tp, rank),
    )
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for target in targets:
            full = torch.randn(dims[target][1], RANK, generator=noise)
            delta.lora_B[target].copy_(lshard.shard_part(target, "lora_B", full, tp, rank))
    return delta


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_and_gather_round_trip_every_target(tp: int) -> None:
    dims = megatron_lora.target_dims(SHAPE)
    for target, (fan_in, fan_out) in dims.items():
        for part, full in (
            ("lora_A", torch.randn(RANK, fan_in)),
            ("lora_B", torch.randn(fan_out, RANK)),
        ):
            parts = [lshard.shard_part(target, part, full, tp, r) for r in range(tp)]
            assert torch.equal(lshard.gather_part(target, part, parts), full)
            assert lshard.full_shape(target, part, tuple(parts[0].shape), tp) == tuple(full.shape)
            dim = lshard.split_dim(target, part)
            if dim is None or tp == 1:
                assert all(p is full for p in parts)  # replicated: every rank holds all of it
            else:
                assert parts[0].shape[dim] == full.shape[dim] // tp


def test_split_dims_follow_the_base_linears() -> None:
    for target in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"):
        assert (lshard.split_dim(target, "lora_A"), lshard.split_dim(target, "lora_B")) == (None, 0)
    for target in ("o_proj", "down_proj"):
        assert (lshard.split_dim(target, "lora_A"), lshard.split_dim(target, "lora_B")) == (1, None)
    with pytest.raises(ValueError, match="embed_tokens"):
        lshard.split_dim("embed_tokens", "lora_A")
    with pytest.raises(ValueError, match="lora_C"):
        lshard.split_dim("q_proj", "lora_C")
    with pytest.raises(ValueError, match="split 3 ways"):
        lshard.shard_part("q_proj", "lora_B", torch.zeros(16, 4), 3, 0)


def test_ranks_start_from_the_parts_of_the_tp1_adapter() -> None:
    """Same seed, any TP size: each rank's A and B are its parts of the TP = 1 init; split
    parameters carry Megatron's tensor-parallel marks (grad norm counts them on every rank),
    replicated ones none (counted once)."""
    for targets in (t for _, t in SITES.values()):
        whole = megatron_lora.LoraDelta(
            {t: megatron_lora.target_dims(SHAPE)[t] for t in targets},
            RANK,
            megatron_lora.delta_fuser(SHAPE, targets),
            torch.Generator().manual_seed(5),
            torch.device("cpu"),
        )
        for rank in range(2):
            part = megatron_lora.LoraDelta(
                {t: megatron_lora.target_dims(SHAPE)[t] for t in targets},
                RANK,
                megatron_lora.delta_fuser(lshard.local_shape(SHAPE, 2), targets),
                torch.Generator().manual_seed(5),
                torch.device("cpu"),
                megatron_lora.LoraTp(2, rank),
            )
            for target in targets:
                for name, full, local in (
                    ("lora_A", whole.lora_A[target], part.lora_A[target]),
                    ("lora_B", whole.lora_B[target], part.lora_B[target]),
                ):
                    expected = lshard.shard_part(target, name, full.detach(), 2, rank)
                    assert torch.equal(local.detach(), expected)
                    split = lshard.split_dim(target, name)
                    assert getattr(local, "tensor_model_parallel", False) == (split is not None)
                    if split is not None:
                        assert (local.partition_dim, local.partition_stride) == (split, 1)


@pytest.mark.parametrize("tp", [2])
def test_rank_deltas_joined_like_the_base_equal_the_tp1_delta(tp: int, monkeypatch) -> None:
    """Column-parallel sites: each rank's fused delta is exactly its block of the TP = 1 fused
    delta in Megatron's split (per KV group for qkv, gate block + up block for fc1), so
    `parallel.shard.gather` of the rank outputs rebuilds it. Row-parallel sites: the ranks' partial
    deltas sum to it (the all-reduce the engine does on h = A·x)."""
    x_full = torch.randn(5, 2, max(SHAPE.hidden, SHAPE.ffn, SHAPE.heads * SHAPE.head_dim))
    for site, (weight_name, targets) in SITES.items():
        fan_in = megatron_lora.target_dims(SHAPE)[targets[0]][0]
        x = x_full[..., :fan_in]
        with torch.no_grad():
            expected = _delta(targets, 1, 0)(x)
        monkeypatch.setattr(megatron_lora, "_join_ranks", lambda hidden, row, tp: hidden)
        outputs = []
        for rank in range(tp):
            delta = _delta(targets, tp, rank)
            x_rank = x
            if delta.row:  # the rank reads its columns of the input, as its base shard does
                x_rank = torch.chunk(x, tp, dim=-1)[rank]
            with torch.no_grad():
                outputs.append(delta(x_rank))
        monkeypatch.undo()
        if delta.row:
            got = torch.stack(outputs).sum(0)
        else:
            got = gather(weight_name, [o.movedim(-1, 0) for o in outputs]).movedim(0, -1)
        assert got.shape == expected.shape, site
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert expected.abs().max() > 1e-2


def test_load_adapter_copies_each_ranks_part_and_checks_full_shapes() -> None:
    targets = SITES["linear_qkv"][1] + SITES["linear_proj"][1]
    qkv, proj = _delta(targets[:3], 2, 1), _delta(targets[3:], 2, 1)
    by_hf = {f"model.layers.0.self_attn.{t}": (qkv, t) for t in targets[:3]}
    by_hf["model.layers.0.self_attn.o_proj"] = (proj, "o_proj")
    lora = megatron_lora.MegatronLora(LoraSpec(RANK), "", by_hf, megatron_lora.LoraTp(2, 1))
    dims = megatron_lora.target_dims(SHAPE)
    rng = np.random.default_rng(0)
    tensors = {}
    for name, (_, target) in by_hf.items():
        fan_in, fan_out = dims[target]
        prefix = f"{megatron_lora.PEFT_PREFIX}{name}"
        tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((RANK, fan_in), np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((fan_out, RANK), np.float32)
    from oneloop.backends.megatron_local.engines.base import LoraAdapter

    lora.load_adapter(LoraAdapter(RANK, 32, tuple(sorted(targets)), tensors))
    for name, (delta, target) in by_hf.items():
        for part, params in (("lora_A", delta.lora_A), ("lora_B", delta.lora_B)):
            full = torch.from_numpy(tensors[f"{megatron_lora.PEFT_PREFIX}{name}.{part}.weight"])
            assert torch.equal(params[target].detach(), lshard.shard_part(target, part, full, 2, 1))
    key = f"{megatron_lora.PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight"
    half = dict(tensors)
    half[key] = tensors[key][: len(tensors[key]) // 2]  # one rank's part is not an adapter
    with pytest.raises(ValueError, match="q_proj.lora_B: adapter has"):
        lora.load_adapter(LoraAdapter(RANK, 32, tuple(sorted(targets)), half))
