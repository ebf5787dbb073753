"""A `vllm` sampler engine with tensor parallelism (`local.vllm.tp = 2`) on two GPUs: weights
reach every worker, in flight, and the engine then computes the new model (issue 18).

Device only, two GPUs (`pytest -m gpu tests/gpu/test_vllm_tp.py`; skipped on fewer). The weight
path at tp > 1 is the Hugging Face one (the object store's: each worker's `load_weights` takes its
shard); `SyncRecord.workers` must count both ranks. Model and tolerances: those of
`tests/gpu/test_vllm_engine.py` (bf16 vLLM vs bf16 transformers).
"""

import pytest
import torch

pytest.importorskip("vllm")
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

from oneloop.backends.config import LocalBackendConfig  # noqa: E402
from oneloop.backends.megatron_local.engines.factory import make_sampler_engine  # noqa: E402
from tests.gpu.test_vllm_engine import (  # noqa: E402
    MEAN_ABS_TOLERANCE,
    PERTURBED_TOLERANCE,
    compare_to_hf,
    hf_model,  # noqa: F401 (fixture)
    hf_state,
    model_dir,  # noqa: F401 (fixture)
    perturb_,
    run_in_flight_sync,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tp_engine(model_dir):  # noqa: F811
    settings = {"tp": 2, "gpu_memory_utilization": 0.35, "max_model_len": 2048}
    local = LocalBackendConfig(
        sampler_engine="vllm", dtype="bfloat16", vllm={**settings, "enforce_eager": True}
    )
    engine = make_sampler_engine(local, model_dir)
    yield engine
    engine.close()


def test_weights_reach_both_workers_in_flight(tp_engine, hf_model) -> None:  # noqa: F811
    assert tp_engine.engine_kwargs["tensor_parallel_size"] == 2
    key = "inflight:policy"
    tp_engine.set_weights(key, hf_state(hf_model), version=1)
    assert tp_engine.sync_history[-1].workers == 2 and tp_engine.sync_history[-1].path == "hf"
    before = compare_to_hf(tp_engine, hf_model, key, "vllm_tp2_vs_hf_v1")
    perturb_(hf_model, seed=7)
    record = run_in_flight_sync(tp_engine, key, 2, hf_state(hf_model))
    assert record["workers"] == 2
    after = compare_to_hf(tp_engine, hf_model, key, "vllm_tp2_vs_hf_v2_after_sync")
    assert before["mean_abs"] <= MEAN_ABS_TOLERANCE and after["mean_abs"] <= PERTURBED_TOLERANCE
