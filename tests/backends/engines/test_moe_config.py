"""A bad mixture-of-experts setup is refused by `load_config`, before any engine starts, naming
the field: routing replay on a backend that cannot replay or on a dense model, experts not
divisible by expert parallelism, an unknown layer type, a megatron layout the engine does not
build for these models."""

import json
import shutil

import pytest

from oneloop.backends.capabilities import TINKER_SERVICE, local_capabilities
from oneloop.backends.model_check import check_model, model_config
from oneloop.errors import CapabilityError, ConfigError
from oneloop.loop.config import load_config
from oneloop.tiny.model import TINY_QWEN3_5, TINY_QWEN3_5_MOE, TINY_QWEN3_MOE, named_tiny_specs

REPLAY = "algo.routing_replay=true"


def test_routing_replay_runs_on_the_local_torch_engines_with_a_moe_model():
    cfg = load_config("demo-cpu", [REPLAY, f"model.base_model={TINY_QWEN3_MOE}"])
    assert cfg.algo.routing_replay
    assert local_capabilities(8).routing_replay and not TINKER_SERVICE.routing_replay
    assert local_capabilities(8, trainer_engine="megatron").routing_replay  # megatron.routing
    load_config("demo-cpu", [REPLAY, f"model.base_model={TINY_QWEN3_MOE}",
                             "backend.local.trainer_engine=megatron"])  # fmt: skip
    # vLLM records the routing (enable_return_routed_experts) unless told not to
    vllm = ["backend.local.trainer_engine=megatron", "backend.local.sampler_engine=vllm"]
    load_config("demo-cpu", [REPLAY, f"model.base_model={TINY_QWEN3_MOE}", *vllm])
    assert local_capabilities(8, trainer_engine="megatron", sampler_engine="vllm").routing_replay
    assert not local_capabilities(
        8, trainer_engine="megatron", sampler_engine="vllm", vllm_routed_experts=False
    ).routing_replay


def test_vllm_routed_experts_follow_the_model_and_a_dense_model_refuses_them():
    from oneloop.backends.config import VllmSettings
    from oneloop.backends.megatron_local.engines.factory import vllm_routed_experts
    from oneloop.tiny.model import build_tiny_model

    moe = build_tiny_model(named_tiny_specs()[TINY_QWEN3_MOE])
    dense = build_tiny_model(named_tiny_specs()["oneloop/tiny-qwen3"])
    assert vllm_routed_experts(VllmSettings(), moe) is True
    assert vllm_routed_experts(VllmSettings(), dense) is False
    assert vllm_routed_experts(VllmSettings(return_routed_experts=False), moe) is False
    with pytest.raises(ConfigError, match=r"local\.vllm\.return_routed_experts: true needs"):
        vllm_routed_experts(VllmSettings(return_routed_experts=True), dense)


def test_vllm_routing_record_keeps_the_fed_positions():
    """vLLM's per-completion routed experts [fed positions, layers, top-k] → R3's record of the
    prompt and every sampled token but the last; a missing or short record is an error."""
    import numpy as np

    from oneloop.backends.megatron_local.engines.vllm.outputs import routing_record
    from oneloop.errors import BackendError

    routed = np.arange(10 * 2 * 3, dtype=np.int32).reshape(10, 2, 3)
    record = routing_record(routed, 9)  # prompt 4 + 6 sampled tokens - 1
    assert record.dtype == np.int16 and np.array_equal(record, routed[:9])
    assert np.array_equal(routing_record(routed[:9], 9), routed[:9])
    with pytest.raises(BackendError, match=r"shape \(8, 2, 3\); expected \[>= 9 positions"):
        routing_record(routed[:8], 9)
    with pytest.raises(BackendError, match="no routed experts"):
        routing_record(None, 9)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["backend.backend=tinker", "model.lora_rank=8"], "not supported by backend 'tinker'"),
        (
            ["backend.local.sampler_engine=vllm", "backend.local.vllm.return_routed_experts=false"],
            "not supported by backend 'local'",
        ),
        ([f"model.base_model={TINY_QWEN3_5}"], "routing replay needs a mixture-of-experts model"),
        (["model.base_model=oneloop/tiny-qwen3"], "is dense"),
    ],
)
def test_routing_replay_is_refused_naming_the_field(overrides, message):
    with pytest.raises(CapabilityError, match=message) as caught:
        load_config("demo-cpu", [REPLAY, *overrides])
    assert str(caught.value).startswith("algo.routing_replay: ")


def test_experts_not_divisible_by_ep_are_refused_naming_the_field():
    base = ["backend.local.trainer_engine=megatron", f"model.base_model={TINY_QWEN3_5_MOE}"]
    assert named_tiny_specs()[TINY_QWEN3_5_MOE].num_experts == 8
    # 8 experts over 4 ranks, carved out of 4 data-parallel replicas
    load_config("demo-cpu", [*base, "backend.local.megatron.ep=4", "backend.local.megatron.dp=4"])
    with pytest.raises(ConfigError, match=r"local\.megatron\.ep=3: .* its 8 experts"):
        load_config("demo-cpu", [*base, "backend.local.megatron.ep=3"])
    with pytest.raises(ConfigError, match=r"local\.megatron\.ep=2: .* dense model"):
        load_config("demo-cpu", ["backend.local.trainer_engine=megatron",
                                 "backend.local.megatron.ep=2"])  # fmt: skip


def test_an_unknown_layer_type_is_refused_naming_it(tmp_path):
    source = model_config({}, TINY_QWEN3_5_MOE)
    assert source is not None and source["layer_types"][-1] == "full_attention"
    directory = tmp_path / "model"
    directory.mkdir()
    bad = {**source, "layer_types": [*source["layer_types"][:-1], "sliding_mamba"]}
    (directory / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CapabilityError, match=r"layer_types\[3\]='sliding_mamba'"):
        load_config("demo-cpu", [REPLAY, f"model.base_model={directory}"])
    with pytest.raises(CapabilityError, match="layer_types"):
        check_model(bad, base_model="m")
    shutil.rmtree(directory)


def test_size_counts_the_hybrid_layers_fixed_state_per_sequence(tmp_path, capsys):
    """Qwen3.6-35B-A3B's width (transformers' Qwen3_5MoeConfig defaults): 30 Gated DeltaNet
    layers keep a state per sequence that shrinks the sequences an engine holds."""
    from transformers import Qwen3_5MoeConfig

    from oneloop.diagnostics.size import main

    Qwen3_5MoeConfig().save_pretrained(tmp_path)
    args = [str(tmp_path), "--gpu-memory-gib", "141", "--mean-trajectory-tokens", "2000",
            "--max-staleness", "3", "--groups-per-step", "16", "--samples-per-group", "16",
            "--engines", "4", "--tp", "2", "--json"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    # per GPU at TP 2: 30 layers * (16 value heads * 128 * 128 + 3 conv taps * 4096 ch) * 2 B
    state = 30 * (16 * 128 * 128 + 3 * 4096) * 2
    assert any(f"= {state:,} B" in line for line in report["arithmetic"])
    per_sequence = 2000 * report["kv_bytes_per_token_per_gpu"] + state
    assert report["system_cap"] == 4 * (report["kv_budget_bytes_per_gpu"] // per_sequence)
    assert report["system_cap"] < 4 * (report["kv_tokens_per_engine"] // 2000)


def test_vllm_model_args_serve_hybrids_text_only_with_triton_gdn_prefill(tmp_path):
    """What vLLM 0.26 needed on the device for Qwen3.5 / 3.6: a multimodal checkpoint served
    text-only, and Triton's GDN prefill where FlashInfer is missing (as on this machine)."""
    import importlib.util

    from transformers import Qwen3_5MoeConfig

    from oneloop.backends.megatron_local.engines.factory import vllm_model_args
    from oneloop.tiny.model import build_tiny_model

    assert importlib.util.find_spec("flashinfer") is None  # the CPU venv has no FlashInfer
    triton = {"additional_config": {"gdn_prefill_backend": "triton"}}
    hybrid = build_tiny_model(named_tiny_specs()[TINY_QWEN3_5_MOE])  # text-only checkpoint
    assert vllm_model_args(hybrid) == triton
    Qwen3_5MoeConfig().save_pretrained(tmp_path)  # Qwen3.6-35B-A3B's config: vision + text
    assert vllm_model_args(tmp_path) == {"language_model_only": True, **triton}
    assert vllm_model_args(build_tiny_model(named_tiny_specs()[TINY_QWEN3_MOE])) == {}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["backend.local.megatron.tp=4"], r"local\.megatron\.tp=4 must divide .*linear_num_k"),
        (
            ["backend.local.megatron.cp=2", "backend.local.megatron.tp=2"],
            r"cp=2 with the MoE .*tp=2",
        ),
        (["backend.local.megatron.pp=3"], r"local\.megatron\.pp=3 must divide .*=4"),
        (["backend.local.megatron.ep=2"], r"local\.megatron\.ep=2 .* tp · cp · dp = 1 ranks"),
        (["model.lora_rank=8"], r"model\.lora_rank=8 with the MoE model"),
    ],
)
def test_the_megatron_layout_of_a_moe_model_is_refused_before_any_engine(overrides, message):
    """What the megatron engine would refuse when it builds a MoE / hybrid model is refused by
    `load_config`, naming the field; pipeline stages × replicas × EP load, and so do TP × EP and
    CP × EP."""
    base = ["backend.local.trainer_engine=megatron", f"model.base_model={TINY_QWEN3_5_MOE}"]
    staged = ["backend.local.megatron.pp=2", "backend.local.megatron.dp=2"]
    load_config("demo-cpu", [*base, *staged, "backend.local.megatron.ep=2"])
    load_config("demo-cpu", [*base, "backend.local.megatron.tp=2", "backend.local.megatron.ep=2"])
    load_config("demo-cpu", [*base, "backend.local.megatron.cp=2", "backend.local.megatron.ep=2"])
    with pytest.raises(CapabilityError, match=message):
        load_config("demo-cpu", [*base, *overrides])
