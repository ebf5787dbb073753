"""`local.megatron.speed`: the config section that reaches the megatron engine's `MegatronSpeed`,
and the layer spec (TransformerEngine's or the local one) that `use_te` picks from it.

The engine itself needs megatron-core and a GPU (tests/gpu/test_megatron_speed.py); here: the
config and the engine's switches agree field for field and default for default, and a bad value
is an error naming its dotted path.
"""

import dataclasses
import re
from dataclasses import replace

import pytest

from oneloop.backends.config import MegatronSpeedSettings, parse_backend_config
from oneloop.backends.megatron_local.engines.megatron.speed import MegatronSpeed, use_te
from oneloop.errors import CapabilityError, ConfigError


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
    assert speed.fused_rope is True and speed.attention_backend == "cudnn"
    assert speed.fused_logprobs  # the others keep their defaults


def test_fused_rope_auto_applies_where_the_sdpa_attention_can_rotate():
    """`fused_rope: auto` (the default): on for the local spec's full-dimension, unscaled RoPE;
    off on the TE spec, the Gated DeltaNet hybrids (partial rotary) and a scaled RoPE; true and
    false as set."""
    from oneloop.backends.megatron_local.engines.megatron.speed import fused_rope_on

    auto = MegatronSpeed()
    assert auto.fused_rope == "auto" and MegatronSpeed.off().fused_rope is False
    plain = dict(te=False, hybrid=False, rotary_percent=1.0, rope_scaling=None)
    assert fused_rope_on(auto, **plain)
    for off in (dict(te=True), dict(hybrid=True, rotary_percent=0.25), dict(rope_scaling=8.0)):
        assert not fused_rope_on(auto, **{**plain, **off}), off
    assert not fused_rope_on(MegatronSpeed(fused_rope=False), **plain)
    assert fused_rope_on(MegatronSpeed(fused_rope=True), **plain)
    with pytest.raises(ValueError, match="fused_rope 'yes': expected true, false or 'auto'"):
        MegatronSpeed(fused_rope="yes")


@pytest.mark.parametrize(
    ("speed", "field"),
    [
        ({"attention_backend": "sdpa"}, "backend.local.megatron.speed.attention_backend"),
        ({"logprob_chunk_rows": 0}, "backend.local.megatron.speed.logprob_chunk_rows"),
        ({"fused_ropes": True}, "backend.local.megatron.speed.fused_ropes"),  # unknown key
        ({"fused_rope": "sometimes"}, "backend.local.megatron.speed.fused_rope"),
    ],
)
def test_a_bad_speed_setting_names_its_dotted_path(speed, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_backend_config({"local": {"megatron": {"speed": speed}}})


# -- layer spec: TransformerEngine's or the local one ----------------------------------------------

SDPA_ONLY = {"attention_backend": "flash", "fused_rope": True}


@pytest.mark.parametrize(
    ("spec", "te_importable", "lora_rank", "cp", "expected"),
    [
        ("auto", True, 0, 1, True),
        ("auto", False, 0, 1, False),  # no TE here: the local spec
        ("auto", True, 8, 1, False),  # LoRA: the local spec
        ("auto", True, 0, 2, False),  # CP: our SDPA attention
        ("te", True, 0, 1, True),
        ("local", True, 0, 1, False),
        ("local", False, 8, 2, False),
    ],
)
def test_the_layer_spec_follows_the_setting_and_what_the_run_allows(
    spec, te_importable, lora_rank, cp, expected
):
    speed = MegatronSpeed(layer_spec=spec)
    assert use_te(speed, te_importable=te_importable, lora_rank=lora_rank, cp=cp) is expected


@pytest.mark.parametrize(
    ("te_importable", "lora_rank", "cp", "reason"),
    [
        (False, 0, 1, "TransformerEngine is not importable"),
        (True, 8, 1, "LoRA runs on the local spec"),
        (True, 0, 2, "context parallelism runs on our SDPA attention"),
    ],
)
def test_te_where_it_cannot_be_used_is_refused_with_the_reason(
    te_importable, lora_rank, cp, reason
):
    with pytest.raises(CapabilityError, match=r"local\.megatron\.speed\.layer_spec='te'") as error:
        use_te(
            MegatronSpeed(layer_spec="te"), te_importable=te_importable, lora_rank=lora_rank, cp=cp
        )
    assert reason in str(error.value)


@pytest.mark.parametrize(("field", "value"), SDPA_ONLY.items())
@pytest.mark.parametrize("spec", ["auto", "te"])
def test_sdpa_only_switches_on_the_te_spec_are_refused_not_ignored(field, value, spec):
    speed = MegatronSpeed(layer_spec=spec, **{field: value})
    with pytest.raises(CapabilityError, match=rf"local\.megatron\.speed\.{field} applies"):
        use_te(speed, te_importable=True, lora_rank=0, cp=1)
    # the same switch on the local spec (chosen, or TE absent) is honoured
    assert not use_te(replace(speed, layer_spec="local"), te_importable=True, lora_rank=0, cp=1)
    assert not use_te(replace(speed, layer_spec="auto"), te_importable=False, lora_rank=0, cp=1)


def test_the_baseline_is_the_local_spec_and_a_bad_spec_names_its_path():
    assert MegatronSpeed.off().layer_spec == "local"
    assert MegatronSpeed().layer_spec == "auto"
    with pytest.raises(ValueError, match="layer_spec 'transformer_engine'"):
        MegatronSpeed(layer_spec="transformer_engine")
    path = r"backend\.local\.megatron\.speed\.layer_spec"
    with pytest.raises(ConfigError, match=path):
        parse_backend_config({"local": {"megatron": {"speed": {"layer_spec": "TE"}}}})


def test_triton_logprobs_needs_the_compiled_fused_path():
    """triton_logprobs replaces compile_logprobs' kernels: with either of those off it would do
    nothing, so it is refused naming both."""
    assert not MegatronSpeed().triton_logprobs  # opt-in until measured on the device
    MegatronSpeed(triton_logprobs=True)
    for off in ({"compile_logprobs": False}, {"fused_logprobs": False}):
        with pytest.raises(ValueError, match="needs fused_logprobs and compile_logprobs on"):
            MegatronSpeed(triton_logprobs=True, **off)


@pytest.mark.parametrize(
    ("local", "message"),
    [
        ({"megatron": {"tp": 2}}, "local.megatron.tp configures the megatron engine, but "
         "trainer_engine='torch'"),
        ({"megatron": {"speed": {"layer_spec": "te"}}}, "local.megatron.speed.layer_spec "
         "configures the megatron engine"),
        ({"vllm": {"max_model_len": 8192}}, "local.vllm.max_model_len configures the vllm engine, "
         "but sampler_engine='torch'"),
    ],
)  # fmt: skip
def test_engine_settings_without_their_engine_are_refused_not_ignored(local, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_backend_config({"local": local})
    engines = {"trainer_engine": "megatron", "sampler_engine": "vllm"}
    parse_backend_config({"local": {**local, **engines}})  # with the engine: accepted
    parse_backend_config({"local": {"megatron": {}, "vllm": {}}})  # defaults alone: nothing to read
