"""`local.megatron.optimizer_cpu_offload`: what the megatron engine asks of megatron-core, and what
it refuses, checked without megatron-core (the offloaded optimizer itself:
megatron_cpu/test_megatron_offload_gloo.py on CPU, tests/gpu/test_megatron_offload.py on GPU).

Regression: the flag used to reach megatron-core alone, whose `optimizer_offload_fraction`
defaults to 0.0, so nothing was offloaded.
"""

import io

import pytest
import torch

from oneloop.backends.config import parse_backend_config
from oneloop.backends.megatron_local.engines.megatron.offload import (
    native_state,
    optimizer_config_fields,
    portable_state,
    steps_per_group,
)
from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel
from oneloop.errors import CapabilityError


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
    from oneloop.backends.megatron_local.engines.factory import megatron_parallel

    parallel = megatron_parallel(config.local)
    assert isinstance(parallel, MegatronParallel) and parallel.dp == 1
    assert parallel.optimizer_cpu_offload and parallel.use_distributed_optimizer
    world = parallel.tp * parallel.pp * parallel.cp
    fields = optimizer_config_fields(
        True, parallel.use_distributed_optimizer, world, {torch.bfloat16}
    )
    assert fields["optimizer_offload_fraction"] == 1.0


# -- one checkpoint form for torch's AdamW and TE's FusedAdam (megatron-core's pick by what imports)


def _trained_adamw(steps: int, **kwargs) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(6, 4))
    opt = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kwargs)
    for _ in range(steps):
        param.grad = torch.randn_like(param)
        opt.step()
    return param, opt


def test_torch_adamw_state_resumes_exactly_through_the_portable_form():
    param, opt = _trained_adamw(3)
    buffer = io.BytesIO()  # through a file, as a checkpoint: no tensor shared with `opt`
    torch.save(portable_state(opt.state_dict(), steps_per_group(opt)), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    clone = torch.nn.Parameter(param.detach().clone())
    fresh = torch.optim.AdamW([clone], lr=0.5, weight_decay=0.0)  # hyperparameters come back
    fresh.load_state_dict(native_state(saved, fresh.param_groups, steps_per_group(fresh)))
    assert fresh.param_groups[0]["lr"] == 1e-2 and fresh.param_groups[0]["weight_decay"] == 0.1
    assert fresh.param_groups[0]["decoupled_weight_decay"]  # the live AdamW's own key is kept
    grad = torch.randn_like(param)
    param.grad, clone.grad = grad, grad.clone()
    opt.step()
    fresh.step()
    assert torch.equal(param, clone)
    assert float(fresh.state[clone]["step"]) == 4.0


def _fused_adam_form(step: int) -> dict:
    """A state_dict shaped as TE's FusedAdam writes it: moments per parameter, one step per group
    (its own keys, e.g. bias_correction, beside the hyperparameters)."""
    moments = {"exp_avg": torch.full((2,), 0.5), "exp_avg_sq": torch.full((2,), 0.25)}
    group = {"lr": 3e-4, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0}
    return {
        "state": {0: dict(moments), 1: dict(moments)},
        "param_groups": [{**group, "bias_correction": True, "step": step, "params": [0, 1]}],
    }


def test_a_group_step_becomes_each_parameters_step_and_back():
    portable = portable_state(_fused_adam_form(7), group_steps=True)
    assert "step" not in portable["param_groups"][0]
    assert [float(portable["state"][i]["step"]) for i in (0, 1)] == [7.0, 7.0]
    live = [{"lr": 0.0, "bias_correction": True, "step": 99, "params": ["p0", "p1"]}]
    native = native_state(portable, live, group_steps=True)
    assert native["param_groups"][0]["step"] == 7  # the saved count, not the live one
    assert native["param_groups"][0]["lr"] == 3e-4 and native["param_groups"][0]["bias_correction"]
    assert all("step" not in native["state"][i] for i in (0, 1))


def test_a_fused_adam_checkpoint_resumes_in_torch_adamw_with_its_step_count():
    portable = portable_state(_fused_adam_form(5), group_steps=True)
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW(params)
    opt.load_state_dict(native_state(portable, opt.param_groups, steps_per_group(opt)))
    assert [float(opt.state[p]["step"]) for p in params] == [5.0, 5.0]
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)
    for p in params:
        p.grad = torch.ones(2)
    opt.step()  # bias correction of step 6, not of a fresh start
    assert float(opt.state[params[0]]["step"]) == 6.0


def test_unequal_steps_in_one_group_and_other_group_counts_are_refused():
    portable = portable_state(_fused_adam_form(5), group_steps=True)
    portable["state"][1]["step"] = torch.tensor(4.0)
    live = [{"lr": 0.0, "params": ["p0", "p1"]}]
    with pytest.raises(ValueError, match=r"one param group holds the step counts \[4\.0, 5\.0\]"):
        native_state(portable, live, group_steps=True)
    with pytest.raises(ValueError, match="holds 1 param groups, this optimizer 2"):
        native_state(portable, live * 2, group_steps=False)
