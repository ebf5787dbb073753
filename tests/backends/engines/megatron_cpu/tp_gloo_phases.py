"""The phases of the megatron engine's tensor-parallel check on gloo ranks (test_megatron_tp_gloo).

    .venv/bin/python tests/backends/engines/megatron_cpu/tp_gloo_phases.py --only TP --work DIR

One phase per process (one torch.distributed world each): a tiny random Qwen3 in fp32 at TP = 1
(the one-process engine) or TP > 1 through `megatron.group` (ranks on gloo) writes its target
logprobs, loss, exported HF weights and every parameter's gradient (sharded ones gathered, QK-norm
ones summed over the TP group as the engine's optim_step does) into DIR; the phase itself checks a
save/load round trip, an error all ranks raise alike (group stays usable) and a killed rank (a
clear error). test_megatron_tp_gloo.py compares the phases.

Megatron-core assumes CUDA where a CPU run meets it: `cpu_megatron.cuda_calls_on_cpu` (RoPE moves
its frequencies to `torch.cuda.current_device()`) for every rank (the rank actors import this
file as a module, so the patches below reach them too); the DDP/optimizer allocate on
CUDA — so this check leaves the optimizer out; optim_step is checked by
tests/gpu/test_megatron_tp.py.
"""

import argparse
import sys
from pathlib import Path

import cpu_megatron as cm
import numpy as np
import torch

from oneloop.backends.megatron_local.engines.megatron.parallel import tp as megatron_tp
from oneloop.backends.megatron_local.engines.megatron.parallel.shard import (
    REPLICATED,
    gather,
    tp_kind,
)
from oneloop.backends.megatron_local.engines.megatron.speed import MegatronSpeed
from oneloop.backends.megatron_local.engines.megatron.trainer import (
    MegatronParallel,
    MegatronTrainerEngine,
)

cm.cuda_calls_on_cpu()
MegatronTrainerEngine._build_optimizer = lambda self: (self.module, None)  # CUDA-only in Megatron
MegatronTrainerEngine._optimizers = lambda self: []


def _dump_grads(self, path: str) -> None:
    """Full-layout gradients of every parameter (a collective at TP > 1; rank 0 writes)."""
    tp, rank = getattr(self, "tp", 1), getattr(self, "rank", 0)
    grads = {}
    for name, param in self._params_by_hf_layout().items():
        grad = param.grad.detach().clone()
        if tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
            torch.distributed.all_reduce(grad, group=self._tp_group())
        if tp > 1 and tp_kind(name) != REPLICATED:
            grad = gather(name, cm.all_gather_parts(grad, tp, self._tp_group()))
        grads[name] = grad.numpy()
    if rank == 0:
        np.savez(path, **grads)


MegatronTrainerEngine._dump_grads = _dump_grads
megatron_tp.MegatronTpRank._dump_grads = _dump_grads


def _run(tp: int, work: Path) -> None:
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.errors import LossInputError

    model = cm.tiny_qwen3(work / "model")
    data = cm.random_data(np.random.default_rng(0), (20, 13, 7), cm.ones)
    parallel = MegatronParallel(tp=tp)
    engine, call = cm.make_engine(  # the engine's full default speed switches (check_speed)
        model,
        LoraSpec(0),
        group=tp > 1,
        dtype="float32",
        device="cpu",
        parallel=parallel,
        speed=MegatronSpeed(),
    )
    result = engine.forward_backward(data, "cross_entropy", None, forward_only=False)
    call("_dump_grads", str(work / f"grads{tp}.npz"))
    weights = {k: v.numpy() for k, v in engine.hf_weights().items()}
    np.savez(work / f"tp{tp}.npz", loss=result.loss, lp=np.concatenate(result.logprobs), **weights)
    engine.save_state(work / f"ckpt{tp}", with_optimizer=False)
    engine.load_state(work / f"ckpt{tp}", with_optimizer=False)
    again = engine.forward_backward(data, "cross_entropy", None, forward_only=True)
    assert again.loss == result.loss, (again.loss, result.loss)
    if tp > 1:  # failure handling of the group
        try:
            engine.forward_backward(data, "no_such_loss", None, forward_only=True)
        except LossInputError:  # every rank fails alike: rank 0's error as is, group usable
            pass
        assert engine.forward_backward(data, "cross_entropy", None, True).loss == result.loss
        import ray

        ray.kill(engine._actors[1])  # the rank's actor dies; the next call names it
        try:
            engine.forward_backward(data, "cross_entropy", None, forward_only=True)
            raise AssertionError("a dead rank went unnoticed")
        except RuntimeError as error:
            assert "rank 1 (dp 0, pp 0, cp 0, tp 1) on node" in str(error), error
            assert "died" in str(error), error
        engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", type=int, required=True, help="the TP size of this phase")
    parser.add_argument("--work", type=Path, required=True, help="where the phases meet")
    args = parser.parse_args()
    _run(args.only, args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
