"""`local.megatron.recompute` reaches the engine as megatron-core's full, uniform recompute (one
layer per checkpoint); a value it does not know is refused naming the field. What recompute
computes (the same results, each layer run again in the backward, R3 replayed there) is checked
on gloo ranks: test_megatron_moe_gloo.py, test_megatron_hybrid_gloo.py."""

import pytest

from oneloop.backends.config import parse_backend_config
from oneloop.backends.megatron_local.engines.factory import megatron_parallel
from oneloop.backends.megatron_local.engines.megatron.speed import recompute_fields
from oneloop.errors import ConfigError


def test_recompute_reaches_the_transformer_config() -> None:
    local = {"trainer_engine": "megatron", "megatron": {"recompute": "full"}}
    parallel = megatron_parallel(parse_backend_config({"local": local}).local)
    assert parallel.recompute == "full"
    assert recompute_fields(parallel.recompute) == {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    }
    default = megatron_parallel(parse_backend_config({"local": {}}).local)
    assert default.recompute == "none" and recompute_fields(default.recompute) == {}


def test_an_unknown_recompute_is_refused_naming_the_field() -> None:
    local = {"trainer_engine": "megatron", "megatron": {"recompute": "selective"}}
    with pytest.raises(ConfigError, match=r"local\.megatron\.recompute"):
        parse_backend_config({"local": local})
    with pytest.raises(ValueError, match=r"recompute='partial'"):
        recompute_fields("partial")
