"""LoRA adapters for the vllm sampler, the parts CI can run: the adapter bookkeeping of the engine
(`vllm.lora.AdapterTable`), the engine's LoRA settings and config errors, the routing of a LoRA
run to adapters, and the trainer's adapter export on a real Ray actor with the torch engine.
The vLLM side itself runs on the device machine (`tests/gpu/test_vllm_engine.py`).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from oneloop.backends.config import LocalBackendConfig, parse_backend_config
from oneloop.backends.megatron_local.checkpoints import CheckpointMeta
from oneloop.backends.megatron_local.engines.base import LoraSpec
from oneloop.backends.megatron_local.engines.vllm.lora import (
    VLLM_LORA_TARGETS,
    AdapterTable,
    lora_serving,
    vllm_lora_rank,
)
from oneloop.backends.megatron_local.lora_serving import (
    check_adapter_targets,
    check_pool_fits,
    pool_lora_rank,
    serves_adapters,
)
from oneloop.errors import CapabilityError, ConfigError, RequestError
from oneloop.tiny.model import TINY_MODEL_NAME

# -- the engine's books -------------------------------------------------------------------------


def installed(table: AdapterTable, key: str, version: int):
    adapter = table.new(key, version, f"/adapters/{key}/v{version}")
    return adapter, table.install(adapter)


def test_every_key_and_version_gets_its_own_lora_id_and_name():
    """vLLM keys prefix-cache blocks by the LoRA name (older releases: the int id), so neither may
    repeat across versions of one key, or a new adapter would reuse the old one's KV."""
    table = AdapterTable(max_snapshots=4)
    seen = [installed(table, "inflight:run", v)[0] for v in (1, 2, 2)]
    seen += [installed(table, f"snapshot:run:{i}", 3)[0] for i in (1, 2)]
    assert len({a.lora_id for a in seen}) == len(seen) and min(a.lora_id for a in seen) > 0
    assert len({a.name for a in seen}) == len(seen)


def test_snapshots_keep_their_own_adapter_and_version():
    table = AdapterTable(max_snapshots=4)
    first, _ = installed(table, "snapshot:run:1", 1)
    second, _ = installed(table, "snapshot:run:2", 2)
    assert table.acquire("snapshot:run:1") == first and table.version("snapshot:run:1") == 1
    assert table.acquire("snapshot:run:2") == second and table.version("snapshot:run:2") == 2
    assert table.acquire("base") is None and table.version("base") == 0 and table.has("base")


def test_inflight_swap_keeps_the_old_adapter_until_its_requests_end():
    table = AdapterTable(max_snapshots=4)
    old, _ = installed(table, "inflight:run", 1)
    running = [table.acquire("inflight:run") for _ in range(2)]
    new, unload = installed(table, "inflight:run", 2)
    assert unload == [] and table.loaded() == {old.lora_id, new.lora_id}
    assert table.acquire("inflight:run") == new  # new requests take the new adapter
    assert running == [old, old]  # ... and the ones running keep the version they started on
    assert table.release(running[0]) == []
    assert table.release(running[1]) == [old]  # the last one out unloads it
    assert table.loaded() == {new.lora_id}


def test_swap_with_nothing_running_unloads_the_old_adapter_at_once():
    table = AdapterTable(max_snapshots=4)
    old, _ = installed(table, "inflight:run", 1)
    table.release(table.acquire("inflight:run"))
    _, unload = installed(table, "inflight:run", 2)
    assert unload == [old]


def test_an_older_version_finishing_its_load_last_does_not_replace_a_newer_one():
    table = AdapterTable(max_snapshots=4)
    older = table.new("inflight:run", 3, "/a/v3")
    newer, _ = installed(table, "inflight:run", 4)
    assert table.install(older) == [older]
    assert table.acquire("inflight:run") == newer and table.version("inflight:run") == 4


def test_drop_unloads_now_or_after_the_last_request():
    table = AdapterTable(max_snapshots=4)
    idle, _ = installed(table, "snapshot:run:1", 1)
    busy, _ = installed(table, "snapshot:run:2", 2)
    request = table.acquire("snapshot:run:2")
    assert table.drop("snapshot:run:1") == [idle]
    assert table.drop("snapshot:run:2") == []
    assert not table.has("snapshot:run:2")
    with pytest.raises(RequestError, match="no adapter named"):
        table.acquire("snapshot:run:2")
    assert table.release(request) == [busy]
    assert table.drop("base") == [] and table.drop("never-installed") == []


def test_snapshots_over_the_limit_are_evicted_and_fail_clearly():
    table = AdapterTable(max_snapshots=2)
    oldest, _ = installed(table, "snapshot:run:1", 1)
    request = table.acquire("snapshot:run:1")
    installed(table, "snapshot:run:2", 2)
    installed(table, "inflight:run", 3)  # inflight adapters do not count as snapshots
    _, unload = installed(table, "snapshot:run:3", 4)
    assert unload == [] and "snapshot:run:1" in table.evicted  # still running: kept loaded
    with pytest.raises(RequestError, match="evicted to keep at most 2 snapshots"):
        table.acquire("snapshot:run:1")
    assert table.release(request) == [oldest]
    assert table.has("inflight:run") and table.has("snapshot:run:2")


def test_the_base_model_takes_no_adapter():
    with pytest.raises(RequestError, match="base model"):
        AdapterTable(max_snapshots=1).new("base", 1, "/x")


# -- engine settings and config ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "served"), [(1, 1), (2, 8), (8, 8), (32, 32), (33, 64), (300, 320)]
)
def test_a_run_rank_rounds_up_to_a_rank_vllm_accepts(rank, served):
    assert vllm_lora_rank(rank) == served


def test_a_rank_above_vllms_largest_is_refused_by_name():
    with pytest.raises(CapabilityError, match="lora rank=600 exceeds the largest LoRA rank"):
        vllm_lora_rank(600)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"max_lora_rank": 24}, "backend.local.vllm.max_lora_rank"),
        ({"max_loras": 0}, "backend.local.vllm.max_loras"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "backend.local.vllm"),
        ({"max_lora": 4}, "backend.local.vllm.max_lora"),  # unknown keys are refused
    ],
)
def test_lora_config_errors_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_backend_config({"local": {"sampler_engine": "vllm", "vllm": override}})


def test_engine_lora_arguments_default_to_every_snapshot_in_host_memory():
    local = LocalBackendConfig(sampler_engine="vllm", max_snapshots=5)
    lora = lora_serving(32, local.vllm.max_loras, local.vllm.max_cpu_loras, local.max_snapshots)
    assert lora is not None
    assert lora.engine_args() == dict(
        enable_lora=True, max_lora_rank=32, max_loras=4, max_cpu_loras=7
    )
    assert lora_serving(0, 4, None, 5) is None  # capacity 0: LoRA off
    with pytest.raises(CapabilityError, match="max_lora_rank=24"):
        lora_serving(24, 4, None, 5)


def test_the_first_client_of_a_model_sets_the_engines_lora_capacity():
    assert pool_lora_rank("vllm", None, 20) == 32
    assert pool_lora_rank("vllm", None, 0) == 0  # full fine-tuning: LoRA off
    assert pool_lora_rank("vllm", None, None) == 0  # sampling only: LoRA off
    assert pool_lora_rank("vllm", 128, None) == 128  # configured: always on
    assert pool_lora_rank("torch", 128, 8) == 0  # the torch sampler takes merged weights


def test_a_client_that_does_not_fit_the_started_engine_is_refused():
    check_pool_fits("vllm", "m", 32, 32)
    check_pool_fits("vllm", "m", 32, None)
    check_pool_fits("vllm", "m", 0, 0)
    check_pool_fits("torch", "m", 0, 64)
    with pytest.raises(CapabilityError, match="started without LoRA.*max_lora_rank >= 8"):
        check_pool_fits("vllm", "m", 0, 8)
    with pytest.raises(CapabilityError, match="max_lora_rank=32 by an earlier client"):
        check_pool_fits("vllm", "m", 32, 64)
    with pytest.raises(CapabilityError, match="full fine-tuning"):
        check_pool_fits("vllm", "m", 32, 0)


def test_only_lora_runs_on_vllm_publish_adapters():
    assert serves_adapters("vllm", 8)
    assert not serves_adapters("vllm", 0)  # full fine-tuning: merged weights (unchanged)
    assert not serves_adapters("torch", 8)  # the torch sampler keeps the merged path


def test_lora_on_lm_head_is_refused_for_vllm():
    check_adapter_targets(train_mlp=True, train_attn=True, train_unembed=False)
    with pytest.raises(CapabilityError, match="train_unembed=False"):
        check_adapter_targets(train_mlp=True, train_attn=True, train_unembed=True)


# -- through the service and real Ray actors -----------------------------------------------------


@pytest.fixture(scope="module")
def vllm_service(tmp_path_factory, tiny_model_path):
    """A local service configured for the vllm sampler (its actors never start here)."""
    from oneloop.backends import BackendConfig, connect

    service = connect(
        BackendConfig(
            backend="local",
            run_dir=tmp_path_factory.mktemp("vllm-lora-runs"),
            local={"sampler_engine": "vllm", "torch_threads": 1, "vllm": {"max_lora_rank": 8}},
        )
    )
    yield service
    service.close()


def test_service_refuses_unservable_clients_before_any_actor_starts(vllm_service):
    with pytest.raises(CapabilityError, match="train_unembed=False"):
        vllm_service.create_lora_training_client(TINY_MODEL_NAME, rank=8)
    with pytest.raises(CapabilityError, match="full fine-tuning"):
        vllm_service.create_lora_training_client(TINY_MODEL_NAME, rank=0)
    assert vllm_service.live_trainers == 0 and vllm_service._samplers == {}


@pytest.mark.timeout(300)
def test_trainer_exports_a_peft_adapter_equal_to_its_merged_weights(tmp_path, tiny_model_path):
    """The adapter the trainer writes for vLLM, applied to the base model by peft, gives the
    same logits as the merged weights the torch sampler gets (one optim step in, so B != 0)."""
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from oneloop.backends.megatron_local.actors import ADAPTER_DIR, TrainerActor
    from oneloop.backends.megatron_local.engines.base import DatumArrays

    local = LocalBackendConfig(sampler_engine="vllm", torch_threads=1)
    lora = LoraSpec(rank=8, seed=0, train_unembed=False)
    actor = TrainerActor.remote(local, str(tiny_model_path), lora)
    tokens = np.arange(5, 40, dtype=np.int64)
    datum = DatumArrays(tokens[:-1], tokens[1:], {"weights": np.ones(len(tokens) - 1, np.float32)})
    ray.get(actor.forward_backward.remote([datum], "cross_entropy", None, False), timeout=120)
    adam = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                grad_clip_norm=0.0)  # fmt: skip
    ray.get(actor.optim_step.remote(adam), timeout=120)

    version, payload = ray.get(actor.export_adapter.remote(str(tmp_path / "adapters")), timeout=120)
    assert version == 1 and payload.rank == 8 and payload.nbytes > 0
    assert Path(payload.path) == tmp_path / "adapters" / "v000001"
    config = json.loads((Path(payload.path) / "adapter_config.json").read_text())
    assert config["r"] == 8 and set(config["target_modules"]) <= VLLM_LORA_TARGETS

    # sampler checkpoints of such runs carry the adapter as well (for create_sampling_client)
    checkpoint = tmp_path / "ckpt"
    meta = CheckpointMeta(
        kind="sampler_weights", name="ckpt", run_id="run-test", base_model="tiny",
        model_dir=str(tiny_model_path), lora_rank=8, train_mlp=True, train_attn=True,
        train_unembed=False, sync_version=0,
    )
    assert ray.get(actor.save_sampler_weights.remote(str(checkpoint), meta), timeout=120) == 2
    assert CheckpointMeta.read(checkpoint) == meta.with_version(2)
    assert (checkpoint / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    merged = load_file(str(checkpoint / "model.safetensors"))
    ray.kill(actor)

    ids = torch.from_numpy(tokens)[None]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(base, payload.path).eval()
        with_adapter = peft_model(ids).logits
        with peft_model.disable_adapter():
            without = peft_model(ids).logits
        reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
        reference.load_state_dict({k: torch.from_numpy(v) for k, v in merged.items()})
        expected = reference.eval()(ids).logits
    assert not torch.allclose(with_adapter, without, atol=1e-4)  # the step moved the adapter
    torch.testing.assert_close(with_adapter, expected, rtol=1e-4, atol=1e-4)
