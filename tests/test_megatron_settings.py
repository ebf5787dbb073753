"""`local.megatron.speed`: the config section that reaches the megatron engine's `MegatronSpeed`.

The engine itself needs megatron-core and a GPU (tests/gpu/test_megatron_speed.py); here: the
config and the engine's switches agree field for field and default for default, and a bad value
is an error naming its dotted path.
"""

import dataclasses

import pytest

from oneloop.backends.config import MegatronSpeedSettings, parse_backend_config
from oneloop.backends.megatron_local.engines.megatron_speed import MegatronSpeed
from oneloop.errors import ConfigError


def test_config_section_and_engine_switches_agree_field_for_field():
    config_fields = set(MegatronSpeedSettings.model_fields)
    engine_fields = {f.name for f in dataclasses.fields(MegatronSpeed)}
    assert config_fields == engine_fields
    assert MegatronSpeed(**MegatronSpeedSettings().model_dump()) == MegatronSpeed()


def test_a_configured_switch_reaches_the_engine_switches():
    config = parse_backend_config(
        {
            "local": {
                "trainer_engine": "megatron",
                "megatron": {"speed": {"fused_rope": True, "attention_backend": "cudnn"}},
            }
        }
    )
    speed = MegatronSpeed(**config.local.megatron.speed.model_dump())
    assert speed.fused_rope and speed.attention_backend == "cudnn"
    assert speed.fused_logprobs  # the others keep their defaults


@pytest.mark.parametrize(
    ("speed", "field"),
    [
        ({"attention_backend": "sdpa"}, "backend.local.megatron.speed.attention_backend"),
        ({"logprob_chunk_rows": 0}, "backend.local.megatron.speed.logprob_chunk_rows"),
        ({"fused_ropes": True}, "backend.local.megatron.speed.fused_ropes"),  # unknown key
    ],
)
def test_a_bad_speed_setting_names_its_dotted_path(speed, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_backend_config({"local": {"megatron": {"speed": speed}}})
