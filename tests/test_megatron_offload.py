"""`local.megatron.optimizer_cpu_offload`: what the megatron engine asks of megatron-core, and what
it refuses, checked without megatron-core (the offloaded optimizer itself:
scripts/device/check_megatron_offload_cpu.py on CPU, tests/gpu/test_megatron_offload.py on GPU).

Regression: the flag used to reach megatron-core alone, whose `optimizer_offload_fraction`
defaults to 0.0, so nothing was offloaded.
"""

import pytest
import torch

from oneloop.backends.capabilities import CapabilityError
from oneloop.backends.config import parse_backend_config
from oneloop.backends.megatron_local.engines.megatron_offload import optimizer_config_fields
from oneloop.backends.megatron_local.engines.megatron_trainer import MegatronParallel


def test_offload_off_asks_nothing_of_megatron():
    assert optimizer_config_fields(False, True, 1, {torch.bfloat16}) == {}
    assert optimizer_config_fields(False, False, 4, {torch.float32}) == {}  # nothing to refuse


def test_offload_moves_every_update_and_the_main_params_to_the_cpu():
    fields = optimizer_config_fields(True, True, 1, {torch.bfloat16})
    assert fields == {
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": 1.0,  # megatron-core's default 0.0 offloads nothing
        "use_precision_aware_optimizer": True,  # else fp32 main shards stay on the GPU
    }


@pytest.mark.parametrize(
    ("use_distributed_optimizer", "world", "trained", "reason"),
    [
        (False, 1, {torch.bfloat16}, "needs local.megatron.use_distributed_optimizer"),
        (True, 2, {torch.bfloat16}, "tp = pp = cp = 1"),
        (True, 1, {torch.float32}, "needs bfloat16 trained weights"),
        (True, 1, {torch.float16}, "needs bfloat16 trained weights"),  # loss scaling: untested
        # LoRA: fp32 adapters on a bf16 model; fp32 norms without the bf16_norms switch
        (True, 1, {torch.bfloat16, torch.float32}, "needs bfloat16 trained weights"),
    ],
)
def test_unproven_offload_setups_are_refused_with_the_reason(
    use_distributed_optimizer, world, trained, reason
):
    with pytest.raises(CapabilityError, match="local.megatron.optimizer_cpu_offload") as error:
        optimizer_config_fields(True, use_distributed_optimizer, world, trained)
    assert reason in str(error.value)


def test_the_config_flag_reaches_the_engine_parallel_settings():
    config = parse_backend_config(
        {"local": {"trainer_engine": "megatron", "megatron": {"optimizer_cpu_offload": True}}}
    )
    parallel = MegatronParallel(**config.local.megatron.model_dump(exclude={"speed"}))
    assert parallel.optimizer_cpu_offload and parallel.use_distributed_optimizer
    world = parallel.tp * parallel.pp * parallel.cp
    fields = optimizer_config_fields(
        True, parallel.use_distributed_optimizer, world, {torch.bfloat16}
    )
    assert fields["optimizer_offload_fraction"] == 1.0
