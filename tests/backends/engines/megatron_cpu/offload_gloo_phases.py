"""The one phase of the megatron engine's optimizer CPU offload check (test_megatron_offload_gloo).

    .venv/bin/python tests/backends/engines/megatron_cpu/offload_gloo_phases.py --work DIR

One process, one gloo rank. A tiny random Qwen3 in bf16 (megatron-core cannot offload fp32
weights: `megatron.offload`) runs with and without `optimizer_cpu_offload`: two optim_steps with
different AdamParams (lr, betas, eps, weight decay, grad clipping on the second), then loss, grad
norm and the weights are compared; a checkpoint after step 2 is loaded into fresh engines (offload
and not, both directions) whose step 3 must equal the original's; a checkpoint from before any
step resets the moments. The structural checks (every parameter offloaded through a CPU copy,
step 3's AdamParams applied, moments reset, loaded weights equal) are asserted here; the figures
go to DIR/figures.json, whose tolerances test_megatron_offload_gloo.py asserts.

On CPU the "GPU" side is the CPU too: this proves the semantics (Megatron's HybridDeviceOptimizer
path, hyperparameters, state save/load), not the placement — tests/gpu/test_megatron_offload.py
checks that on the device. megatron-core's optimizer and HDO hard-code CUDA; `_cuda_on_cpu` below
(this script only, never product code) runs them on the CPU: tensors allocated for "cuda" are
CPU tensors that report `is_cuda` / a `torch.cuda.*Tensor` type, pinning is a copy, streams and
events are no-ops (`cpu_megatron.cuda_calls_on_cpu`).
"""

import argparse
import copy
import json
import sys
from pathlib import Path

import cpu_megatron as cm
import numpy as np
import torch
from torch.overrides import TorchFunctionMode

ADAMS = [  # a different AdamParams each step; the second clips (grad norm ~100 here)
    dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.0),
    dict(learning_rate=5e-4, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.3, grad_clip_norm=1.0),
    dict(learning_rate=2e-3, beta1=0.85, beta2=0.9, eps=1e-7, weight_decay=0.0, grad_clip_norm=0.5),
]  # fmt: skip

STATE_KEYS = ("main_params", "exp_avg", "exp_avg_sq")


class _CudaOnCpu(TorchFunctionMode):
    """Storages allocated for a CUDA device are CPU storages remembered here; tensors on them
    report `is_cuda` and a `torch.cuda.*` type (what HDO and the distributed optimizer test).

    They are held, not only their addresses: a freed one's address, reused by a plain CPU tensor
    (HDO's CPU copy of a parameter), made that tensor report `is_cuda`, and now and then HDO kept
    part of the update "on the GPU", which the engine refuses (the check failed at random)."""

    def __init__(self) -> None:
        super().__init__()
        self.device_storages: dict[int, torch.UntypedStorage] = {}
        self.is_cuda = torch.Tensor.is_cuda

    def _on_device(self, t) -> bool:
        return (
            isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.device_storages
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if getattr(func, "__self__", None) is self.is_cuda:  # the is_cuda getter
            return self._on_device(args[0])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return "torch.cuda." + name.removeprefix("torch.") if self._on_device(args[0]) else name
        if func is torch.Tensor.pin_memory:
            return args[0].clone()
        kwargs.pop("pin_memory", None)
        to_device = func is torch.Tensor.cuda
        if to_device:
            func, args = torch.Tensor.clone, args[:1]
        if "device" in kwargs and _cuda(kwargs["device"]):
            kwargs["device"], to_device = "cpu", True
        if func is torch.Tensor.to:
            args = list(args)
            for i, arg in enumerate(args[1:], 1):
                if _cuda(arg):
                    args[i], to_device = "cpu", True
        out = func(*args, **kwargs)
        if to_device and isinstance(out, torch.Tensor):
            out = out.clone() if out is args[0] else out
            storage = out.untyped_storage()
            self.device_storages[storage.data_ptr()] = storage
        return out


def _cuda(device) -> bool:
    if isinstance(device, bool) or not isinstance(device, str | int | torch.device):
        return False
    return isinstance(device, int) or torch.device(device).type == "cuda"


def _cuda_on_cpu() -> None:
    cm.cuda_calls_on_cpu(device=0)  # an index: `_CudaOnCpu` takes it for a CUDA device
    _CudaOnCpu().__enter__()


def _run(work: Path) -> None:
    _cuda_on_cpu()
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.megatron import offload as megatron_offload
    from oneloop.backends.megatron_local.engines.megatron.trainer import (
        MegatronParallel,
        MegatronTrainerEngine,
    )

    model = cm.tiny_qwen3(work / "model")
    data = cm.random_data(np.random.default_rng(0), (20, 13, 7), cm.ones)

    def engine(offload: bool) -> MegatronTrainerEngine:
        parallel = MegatronParallel(optimizer_cpu_offload=offload)
        return MegatronTrainerEngine(
            model,
            LoraSpec(0),
            dtype="bfloat16",
            device="cpu",
            parallel=parallel,
            speed=cm.check_speed(),
        )

    def step(e: MegatronTrainerEngine, adam: dict) -> tuple[float, float]:
        loss = e.forward_backward(data, "cross_entropy", None, forward_only=False).loss
        return float(loss), float(e.optim_step(adam)["grad_norm:mean"])

    def weights(e: MegatronTrainerEngine) -> dict[str, np.ndarray]:
        return {k: v.float().numpy() for k, v in e.hf_weights().items()}

    def max_diff(a: dict, b: dict) -> float:
        return cm.max_abs_diff(a, b, a)

    runs = {}
    for offload in (False, True):
        e = engine(offload)
        if offload:  # the offloaded engine: state on the "CPU" side, only CPU AdamW
            hdos = megatron_offload.hybrid_optimizers(e.optimizer)
            assert hdos and all(h.gpu_optimizer is None for h in hdos), "not all offloaded"
            assert all(h.offload_fraction == 1.0 for h in hdos)
            copies = [
                h.param_to_inner_param[p] is not p for h in hdos for p in h.param_to_inner_param
            ]
            assert copies and all(copies), "a param is updated in place, not through a CPU copy"
            e.save_state(work / "ckpt-step0", with_optimizer=True)  # before any step
        before = weights(e)
        steps = [step(e, ADAMS[0])]
        after1 = weights(e)
        steps.append(step(e, ADAMS[1]))
        after2 = weights(e)
        # One layout, offload or not; deep-copied (on CPU `.cpu()` returns the live tensors).
        state2 = copy.deepcopy(megatron_offload.checkpoint_state(e.optimizer))
        e.save_state(work / f"ckpt-{offload}", with_optimizer=True)
        steps.append(step(e, ADAMS[2]))
        runs[offload] = dict(
            steps=steps,
            before=before,
            after2=after2,
            after3=weights(e),
            state2=state2,
            after1=after1,
        )
        if offload:
            groups = [g for h in hdos for s in h.sub_optimizers for g in s.param_groups]
            applied = {(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in groups}
            assert applied == {(2e-3, (0.85, 0.9), 1e-7, 0.0)}, applied  # step 3's AdamParams
            tensors = megatron_offload.state_tensors(e.optimizer)
            kinds = sorted({k.split(".", 2)[2] for k in tensors})
            print("offloaded state tensors:", len(tensors), kinds)
            e.load_state(work / "ckpt-step0", with_optimizer=True)
            assert not any(s.state for h in hdos for s in h.sub_optimizers), "moments not reset"
            assert max_diff(weights(e), before) == 0.0
            # Step 1 again from the loaded weights (CPU fp32 copies refreshed, moments reset).
            step(e, ADAMS[0])
            restart_diff = max_diff(weights(e), runs[False]["after1"])
        del e

    resumed = {}
    for saved in (False, True):
        for offload in (False, True):
            e = engine(offload)
            e.load_state(work / f"ckpt-{saved}", with_optimizer=True)
            assert max_diff(weights(e), runs[saved]["after2"]) == 0.0
            loss, norm = step(e, ADAMS[2])
            resumed[(saved, offload)] = dict(
                loss=loss, grad_norm=norm, after3=weights(e),
                weights_abs_diff_max=max_diff(weights(e), runs[saved]["after3"]),
            )  # fmt: skip
            del e

    plain, off = runs[False], runs[True]
    moved = max_diff(plain["after2"], plain["before"])

    def state_diff(key: str) -> float:
        pairs = zip(plain["state2"], off["state2"], strict=True)
        if key == "main_params":
            tensors = [t for a, b in pairs for t in zip(a[key], b[key], strict=True)]
        else:
            tensors = [
                (a["optimizer"]["state"][i][key], b["optimizer"]["state"][i][key])
                for a, b in pairs
                for i in a["optimizer"]["state"]
            ]
        return max(float((x.float().cpu() - y.float().cpu()).abs().max()) for x, y in tensors)

    figures = {
        "loss_steps_plain": [s[0] for s in plain["steps"]],
        "loss_steps_offload": [s[0] for s in off["steps"]],
        "grad_norm_steps_plain": [s[1] for s in plain["steps"]],
        "grad_norm_steps_offload": [s[1] for s in off["steps"]],
        "weights_moved_by_2_steps_max": moved,
        "weights_abs_diff_max_after_2_steps": max_diff(plain["after2"], off["after2"]),
        "weights_abs_diff_max_after_3_steps": max_diff(plain["after3"], off["after3"]),
        "offload_restart_from_step0_ckpt_step1_weights_abs_diff_max_vs_plain": restart_diff,
        **{f"{k}_fp32_abs_diff_max_after_2_steps": state_diff(k) for k in STATE_KEYS},
        **{
            f"resume_{'offload' if s else 'plain'}_ckpt_into_{'offload' if o else 'plain'}"
            "_step3_weights_abs_diff_max": r["weights_abs_diff_max"]
            for (s, o), r in resumed.items()
        },
    }
    (work / "figures.json").write_text(json.dumps(figures, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, required=True, help="the model and figures.json")
    _run(parser.parse_args().work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
