"""The phases of the megatron engine's pipeline-parallel check on gloo ranks (its test:
test_megatron_pp_gloo).

    .venv/bin/python tests/backends/engines/megatron_cpu/pp_gloo_phases.py \
        --only (1|pp2|tp2pp2|pp2dp2)-(tied|untied) --work DIR

One phase per process (one torch.distributed world each): a tiny random Qwen3 (4 layers; tied or
untied embeddings) through the one-process engine ("1") or through `megatron.group` at PP = 2,
TP = 2 × PP = 2 and PP = 2 × DP = 2 (two pipelines, each its share of the datums, unequal
micro-batch counts), the same calls in each: forward_backward over 5 data in 3 token-budget
micro-batches of different shapes (cross_entropy with per-token weights), optim_step (grad norm),
hf_weights, save_state with the optimizer, a second forward_backward + optim_step, load_state of
the checkpoint and the same second step again (the resumed weights must equal the uninterrupted
ones), and forward_only; the groups then get infinite loss weights (refused before the schedule on
every rank) and huge finite ones: the step on the overflowing gradients is refused on every rank
and the group keeps working. The one-process engine also loads the PP = 2 checkpoint (weights only,
any tp/pp; so "pp2" runs first), and the TP × PP group must refuse the PP = 2 checkpoint's
optimizer state (sizes differ). Each phase writes its figures into DIR; test_megatron_pp_gloo.py
compares every group's with the one-process engine's.

Megatron-core assumes CUDA in places a CPU run meets; `cpu_megatron.cuda_calls_on_cpu` with
`allocations` (this script only, every rank: the rank actors import this file as a
module) makes them CPU no-ops: RoPE and the p2p shape buffers use `torch.cuda.current_device()`,
the DDP grad sync asks for the current CUDA stream, GPTModel moves the tied output-layer copy with
`.cuda()`, the schedule, optimizer and grad-norm code allocate with `device="cuda"`, and the
optimizer checks `param.type()` for `torch.cuda.*Tensor` names.
"""

import argparse
import sys
from pathlib import Path

import cpu_megatron as cm
import numpy as np
import torch

cm.cuda_calls_on_cpu(allocations=True)

ADAM = {
    "learning_rate": 1e-3,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.01,
    "grad_clip_norm": 0.0,
}
BUDGET = 40  # lengths 20,13 | 7,17 | 9 → three micro-batches of shapes [2,20], [2,17], [1,9]
SIZES = {"1": (1, 1, 1), "pp2": (1, 2, 1), "tp2pp2": (2, 2, 1), "pp2dp2": (1, 2, 2)}


def _weights(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {"weights": rng.uniform(0.0, 1.0, n).astype(np.float32)}


def _data(seed: int):
    return cm.random_data(np.random.default_rng(seed), (20, 13, 7, 17, 9), _weights)


def _flat(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}/{k}": v.detach().float().cpu().numpy().copy() for k, v in weights.items()}


def _run(name: str, tied: bool, work: Path) -> None:
    from oneloop.backends.megatron_local.engines.base import DatumArrays, LoraSpec
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel
    from oneloop.errors import LossInputError

    tp, pp, dp = SIZES[name]
    tag = f"{name}-{'tied' if tied else 'untied'}"
    model = cm.tiny_qwen3(work / f"model-{'tied' if tied else 'untied'}", layers=4, tied=tied)
    kwargs = dict(
        dtype="float32",
        device="cpu",
        parallel=MegatronParallel(tp=tp, pp=pp, dp=dp),
        max_tokens_per_microbatch=BUDGET,
    )
    engine, _ = cm.make_engine(model, LoraSpec(0), group=name != "1", **kwargs)
    first, second = _data(1), _data(2)
    out: dict[str, np.ndarray] = {}
    r1 = engine.forward_backward(first, "cross_entropy", None, forward_only=False)
    out["loss1"], out["per_datum1"] = np.float64(r1.loss), np.array(r1.per_datum_loss)
    out["lp1"] = np.concatenate(r1.logprobs)
    assert [len(x) for x in r1.logprobs] == [len(d.tokens) for d in first]
    out["grad_norm1"] = np.float64(engine.optim_step(ADAM)["grad_norm:mean"])
    out.update(_flat(engine.hf_weights(), "w1"))
    ckpt = work / f"ckpt-{tag}"
    engine.save_state(ckpt, with_optimizer=True)
    engine.forward_backward(second, "cross_entropy", None, forward_only=False)
    out["grad_norm2"] = np.float64(engine.optim_step(ADAM)["grad_norm:mean"])
    out.update(_flat(engine.hf_weights(), "w2"))
    if name == "tp2pp2":  # the PP = 2 checkpoint's optimizer shards are refused at tp = 2
        try:
            engine.load_state(work / f"ckpt-pp2-{tag.split('-')[1]}", with_optimizer=True)
            raise AssertionError("an optimizer state saved at tp=1 pp=2 was loaded at tp=2")
        except ValueError as error:
            assert "tp=1 pp=2" in str(error), error
            print("refused as expected:", str(error).split(": ", 1)[1])
    engine.load_state(ckpt, with_optimizer=True)
    fo = engine.forward_backward(first, "cross_entropy", None, forward_only=True)
    out["fo_loss"], out["fo_lp"] = np.float64(fo.loss), np.concatenate(fo.logprobs)
    engine.forward_backward(second, "cross_entropy", None, forward_only=False)
    engine.optim_step(ADAM)
    out.update(_flat(engine.hf_weights(), "w2resumed"))
    if name == "1":  # weights saved by the PP = 2 group load into the one-process engine
        engine.load_state(work / f"ckpt-pp2-{tag.split('-')[1]}", with_optimizer=False)
        cross = engine.forward_backward(first, "cross_entropy", None, forward_only=True)
        out["cross_loss"] = np.float64(cross.loss)
    else:  # non-finite gradients: every rank refuses the step alike, the group stays usable
        infinite = [DatumArrays(d.tokens, d.targets, {"weights": d.inputs["weights"] * np.inf})
                    for d in first]  # fmt: skip
        try:  # refused by every rank before the schedule (the last stage alone would hang it)
            engine.forward_backward(infinite, "cross_entropy", None, forward_only=False)
            raise AssertionError("infinite loss weights were accepted")
        except LossInputError as error:
            print("refused as expected:", error)
        huge = [
            DatumArrays(d.tokens, d.targets, {"weights": np.full_like(d.inputs["weights"], 3e38)})
            for d in first
        ]  # finite inputs, overflowing gradients
        before = engine.forward_backward(first, "cross_entropy", None, forward_only=True)
        out["before_refusal_loss"] = np.float64(before.loss)
        engine.forward_backward(huge, "cross_entropy", None, forward_only=False)
        try:
            engine.optim_step(ADAM)
            raise AssertionError("a step on non-finite gradients was taken")
        except RuntimeError as error:
            assert "non-finite" in str(error), error
            print("refused as expected:", error)
        again = engine.forward_backward(first, "cross_entropy", None, forward_only=True)
        out["after_refusal_loss"] = np.float64(again.loss)
        engine.forward_backward(second, "cross_entropy", None, forward_only=False)
        engine.optim_step(ADAM)  # grads were zeroed: a normal step again
        engine.close()
    np.savez(work / f"{tag}.npz", **out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", required=True, help="this phase: <size>-<tied|untied>")
    parser.add_argument("--work", type=Path, required=True, help="where the phases meet")
    args = parser.parse_args()
    name, kind = args.only.split("-")
    _run(name, kind == "tied", args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
