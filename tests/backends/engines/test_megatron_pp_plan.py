"""Rank placement, stage layer split, stage weight maps and the group-size checks of the megatron
engine's pipeline parallelism (`megatron.parallel.pp_plan`; no megatron-core needed)."""

import pytest
import torch

from oneloop.backends.megatron_local.engines.megatron.layout import (
    DenseShape,
    hf_to_megatron,
    megatron_param_names,
)
from oneloop.backends.megatron_local.engines.megatron.parallel.pp_plan import (
    RankCoords,
    check_gpus_per_trainer,
    check_pp,
    global_parts,
    group_size,
    rank_coords,
    resolve_dp,
    stage_layers,
    stage_parts,
)


def test_rank_coords_follow_megatrons_order() -> None:
    # tp varies fastest, then cp, then the pipeline stage (order tp-cp-ep-dp-pp, dp = 1)
    coords = [rank_coords(r, 2, 2, 1) for r in range(4)]
    assert coords == [
        RankCoords(0, 0, 0), RankCoords(1, 0, 0), RankCoords(0, 0, 1), RankCoords(1, 0, 1)
    ]  # fmt: skip
    assert rank_coords(5, 2, 2, 2) == RankCoords(tp_rank=1, cp_rank=0, pp_rank=1)
    assert rank_coords(3, 1, 4, 1) == RankCoords(0, 0, 3)
    assert {rank_coords(r, 2, 3, 2) for r in range(12)} == {
        RankCoords(t, c, p) for t in range(2) for c in range(2) for p in range(3)
    }
    with pytest.raises(ValueError, match="outside"):
        rank_coords(4, 2, 2, 1)
    assert group_size(2, 3, 2) == 12
    # dp between cp and the stage: rank = tp + tp·(cp + cp·(dp + dp·pp))
    assert [rank_coords(r, 2, 1, 1, dp=2) for r in range(4)] == [
        RankCoords(0, 0, 0, 0), RankCoords(1, 0, 0, 0),
        RankCoords(0, 0, 0, 1), RankCoords(1, 0, 0, 1),
    ]  # fmt: skip
    assert rank_coords(13, 2, 2, 2, dp=2) == RankCoords(tp_rank=1, cp_rank=0, pp_rank=1, dp_rank=1)
    assert group_size(2, 2, 2, 2) == 16


def test_dp_is_given_or_derived_from_the_trainer_gpus() -> None:
    assert resolve_dp(None, 8, 2, 1, 1) == 4
    assert resolve_dp(None, 0, 2, 1, 1) == 1  # CPU: no GPUs given
    assert resolve_dp(3, 8, 2, 1, 1) == 3
    with pytest.raises(ValueError, match="local.megatron.dp"):
        resolve_dp(None, 6, 4, 1, 1)
    check_gpus_per_trainer(4, 2, 1, 1, dp=2)
    with pytest.raises(ValueError, match=r"dp=2 .* local.gpus_per_trainer=4"):
        check_gpus_per_trainer(2, 2, 1, 1, dp=2)


def test_rank_bundles_pack_one_node_when_the_group_fits() -> None:
    from oneloop.backends.megatron_local.engines.megatron.group import rank_bundles
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel

    parallel = MegatronParallel(tp=2, dp=2)
    bundles, strategy = rank_bundles(parallel, nodes=[{"GPU": 8.0, "CPU": 64.0}])
    assert bundles == [{"GPU": 1.0, "CPU": 1.0}] * 4 and strategy == "STRICT_PACK"
    _, strategy = rank_bundles(parallel, nodes=[{"GPU": 2.0, "CPU": 64.0}] * 2)
    assert strategy == "PACK"  # DP replicas span nodes; each TP block stays on one
    _, strategy = rank_bundles(parallel)  # cluster unknown
    assert strategy == "PACK"
    bundles, strategy = rank_bundles(parallel, gpus_per_rank=0, strategy="SPREAD")
    assert bundles == [{"CPU": 1.0}] * 4 and strategy == "SPREAD"
    with pytest.raises(ValueError, match="local.megatron.placement_strategy"):
        rank_bundles(parallel, strategy="TIGHT")


def test_stage_layers_split_evenly_and_refuse_remainders() -> None:
    assert [stage_layers(28, 4, s) for s in range(4)] == [
        range(0, 7), range(7, 14), range(14, 21), range(21, 28)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="num_hidden_layers=28"):
        check_pp(28, 3)
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        check_pp(2, 4)


def test_gpus_per_trainer_must_equal_the_group_size() -> None:
    check_gpus_per_trainer(4, 2, 2, 1)
    check_gpus_per_trainer(0.5, 1, 1, 1)  # one rank: any share (colocated with a sampler)
    check_gpus_per_trainer(0, 1, 4, 1, trainer_engine="torch")
    with pytest.raises(ValueError, match=r"local.gpus_per_trainer=4\b"):
        check_gpus_per_trainer(2, 2, 2, 1)
    with pytest.raises(ValueError, match="local.gpus_per_trainer=2"):
        check_gpus_per_trainer(0, 1, 2, 1)


def _shape(tied: bool) -> DenseShape:
    return DenseShape("qwen3", 4, 8, 12, 2, 1, 4, 16, tied, False, True, 1e4, 1e-6, 32)


def _full_mega(shape: DenseShape) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    hf = {
        "model.embed_tokens.weight": torch.randn(16, 8),
        "model.norm.weight": torch.randn(8),
        "lm_head.weight": torch.randn(16, 8),
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        for name, size in (
            ("input_layernorm.weight", (8,)),
            ("post_attention_layernorm.weight", (8,)),
            ("self_attn.q_proj.weight", (8, 8)),
            ("self_attn.k_proj.weight", (4, 8)),
            ("self_attn.v_proj.weight", (4, 8)),
            ("self_attn.o_proj.weight", (8, 8)),
            ("self_attn.q_norm.weight", (4,)),
            ("self_attn.k_norm.weight", (4,)),
            ("mlp.gate_proj.weight", (12, 8)),
            ("mlp.up_proj.weight", (12, 8)),
            ("mlp.down_proj.weight", (8, 12)),
        ):
            hf[p + name] = torch.randn(*size)
    return hf_to_megatron(shape, hf)


@pytest.mark.parametrize("tied", [True, False])
def test_stage_parts_give_each_stage_its_layers_and_round_trip(tied: bool) -> None:
    shape = _shape(tied)
    mega = _full_mega(shape)
    pp = 2
    stages = []
    for s in range(pp):
        layers = stage_layers(shape.layers, pp, s)
        first, last = s == 0, s == pp - 1
        local = stage_parts(mega, layers, first, last, tied)
        names = set(local)
        assert ("embedding.word_embeddings.weight" in names) == first
        assert ("decoder.final_layernorm.weight" in names) == last
        assert ("output_layer.weight" in names) == last  # tied: the last stage's copy
        assert {n.split(".")[2] for n in names if n.startswith("decoder.layers.")} == {"0", "1"}
        if tied and last:
            assert local["output_layer.weight"] is mega["embedding.word_embeddings.weight"]
        # stage 1's local layer 0 is global layer 2
        if s == 1:
            torch.testing.assert_close(
                local["decoder.layers.0.mlp.linear_fc1.weight"],
                mega["decoder.layers.2.mlp.linear_fc1.weight"],
            )
        stages.append(global_parts(local, layers, first, tied))
    merged = {k: v for part in stages for k, v in part.items()}
    assert sorted(merged) == sorted(megatron_param_names(shape)) == sorted(mega)
    for name, tensor in mega.items():
        assert merged[name] is tensor


def test_group_refuses_lora_and_uneven_stages_before_starting_ranks(tmp_path) -> None:
    from transformers import Qwen3Config

    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.megatron.group import (
        MegatronRayGroup,
        rank_engine_class,
    )
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel
    from oneloop.errors import CapabilityError

    Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8,
    ).save_pretrained(tmp_path)  # fmt: skip
    with pytest.raises(CapabilityError, match="pp=2"):
        MegatronRayGroup(tmp_path, LoraSpec(4), parallel=MegatronParallel(pp=2))
    with pytest.raises(ValueError, match="num_hidden_layers=4"):
        MegatronRayGroup(tmp_path, LoraSpec(0), parallel=MegatronParallel(pp=3), device="cpu")
    assert rank_engine_class(MegatronParallel(tp=2, pp=2)).__name__ == "MegatronPpRank"
    assert rank_engine_class(MegatronParallel(tp=2)).__name__ == "MegatronTpRank"
    # MoE under TP (sequence parallel): the PP rank class's reductions, as one stage
    assert rank_engine_class(MegatronParallel(tp=2), moe=True).__name__ == "MegatronPpRank"
    assert rank_engine_class(MegatronParallel(dp=2, ep=2), moe=True).__name__ == "MegatronTpRank"


def test_factory_checks_gpus_per_trainer_before_building(tmp_path) -> None:
    from oneloop.backends.config import LocalBackendConfig
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.factory import make_trainer_engine

    local = LocalBackendConfig(trainer_engine="megatron", gpus_per_trainer=1, megatron={"pp": 2})
    with pytest.raises(ValueError, match="local.gpus_per_trainer=2"):
        make_trainer_engine(local, tmp_path, LoraSpec(0))
