"""CPU check (gloo) of the megatron engine's tensor parallelism before a device run.

    PYTHONPATH=/tmp/msite .venv/bin/python scripts/device/check_megatron_tp_cpu.py [--tp 2]

(megatron-core installed with `pip install --no-deps --target /tmp/msite .w1/megatron_core*.whl`.)
Runs a tiny random Qwen3 in fp32 at TP = 1 (a subprocess: one torch.distributed world per process)
and at TP = `--tp` through `megatron_group` (ranks on gloo), then compares target logprobs, the
loss, the exported HF weights and every parameter's gradient (sharded ones gathered, QK-norm ones
summed over the TP group as the engine's optim_step does), a save/load round trip, an error all
ranks raise alike (group stays usable) and a killed rank (a clear error).

Megatron-core assumes CUDA where a CPU run meets it: `cpu_megatron.cuda_calls_on_cpu` (RoPE moves
its frequencies to `torch.cuda.current_device()`) for every rank (the spawned ranks import this
file as their main module, so the patches below reach them too); the DDP/optimizer allocate on
CUDA — so this check leaves the optimizer out; optim_step is checked by
tests/gpu/test_megatron_tp.py.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import cpu_megatron as cm
import numpy as np
import torch

from oneloop.backends.megatron_local.engines import megatron_tp
from oneloop.backends.megatron_local.engines.megatron_shard import REPLICATED, gather, tp_kind
from oneloop.backends.megatron_local.engines.megatron_trainer import (
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
    from oneloop.backends.megatron_local.losses import LossInputError

    model = cm.tiny_qwen3(work / "model")
    data = cm.random_data(np.random.default_rng(0), (20, 13, 7), cm.ones)
    parallel = MegatronParallel(tp=tp)
    engine, call = cm.make_engine(
        model, LoraSpec(0), group=tp > 1, dtype="float32", device="cpu", parallel=parallel
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
        engine._workers[0][0].kill()
        engine._workers[0][0].join(30)
        try:
            engine.forward_backward(data, "cross_entropy", None, forward_only=True)
            raise AssertionError("a dead rank went unnoticed")
        except RuntimeError as error:
            assert "TP rank 1 exited" in str(error), error
        engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--only", type=int, help=argparse.SUPPRESS)  # one TP size, into --work
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only is not None:
        _run(args.only, args.work)
        return 0
    work = Path(tempfile.mkdtemp(prefix="megatron-tp-cpu-"))
    cm.run_phases(__file__, work, (["--only", str(tp)] for tp in (1, args.tp)))
    one, many = np.load(work / "tp1.npz"), np.load(work / f"tp{args.tp}.npz")
    g1, gn = np.load(work / "grads1.npz"), np.load(work / f"grads{args.tp}.npz")
    names = [k for k in one.files if k not in ("loss", "lp")]
    figures = {
        "loss_tp1": float(one["loss"]),
        f"loss_tp{args.tp}": float(many["loss"]),
        "logprob_abs_diff_max": float(np.abs(one["lp"] - many["lp"]).max()),
        "weights_abs_diff_max": cm.max_abs_diff(one, many, names),
        "grad_rel_diff_max": cm.grad_rel_diff_max(g1, gn),
    }
    print("RESULT megatron_tp_cpu", figures)
    ok = sorted(one.files) == sorted(many.files) and sorted(g1.files) == sorted(gn.files)
    ok = ok and figures["logprob_abs_diff_max"] < 1e-4 and figures["weights_abs_diff_max"] == 0.0
    ok = ok and figures["grad_rel_diff_max"] < 1e-4
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
