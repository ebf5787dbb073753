"""The phases of the megatron engine's LoRA check at TP > 1 on gloo ranks (its test:
test_megatron_lora_tp_gloo).

    .venv/bin/python tests/backends/engines/megatron_cpu/lora_tp_gloo_phases.py \
        (--only TP | --probe TP) [--untied] --work DIR

A tiny random Qwen3 (GQA, QK-norm; `--untied` for a separate lm_head) with LoRA on every target
(q/k/v/o, gate/up/down, lm_head) at TP = 1 (`MegatronTrainerEngine`) and TP > 1 (`megatron.group`
→ `megatron.parallel.lora_tp.MegatronLoraTpRank`, ranks on gloo), each phase in its own process
(one torch.distributed world per process). Both start from the same random non-zero adapter
(B != 0, loaded through the LoRA checkpoint path, so A's gradients and the adapters' place in the
fused outputs count from the first step) and run the same calls: forward_backward (cross_entropy,
then importance_sampling, accumulating) → every adapter gradient (split parts gathered) →
optim_step (grad norm) → adapter() → forward_only logprobs → merged hf_weights → save_state with
optimizer → one more step → load_state → the same step again (must repeat it). At TP > 1 also:
loading the TP = 1 checkpoint with its optimizer is refused with the reason (and the group stays
usable), without the optimizer it loads; and a third phase (`--probe`) at TP = 1 does the same
with the TP > 1 checkpoint. test_megatron_lora_tp_gloo.py compares what the phases write.

CPU shims, here only (never in product code): Megatron's DDP and optimizer allocate a few scalars
on "cuda", wait on CUDA streams and check `param.type()` against `torch.cuda.*Tensor`; RoPE moves
its frequencies to `torch.cuda.current_device()`. `cpu_megatron.cuda_calls_on_cpu` with
`allocations`, called below before oneloop is imported, maps those to the CPU for every rank
(the rank actors import this file as a module, so the patches reach them too).
"""

import argparse
import json
import sys
from pathlib import Path

import cpu_megatron as cm
import numpy as np

cm.cuda_calls_on_cpu(allocations=True)

from oneloop.backends.megatron_local.engines.megatron.parallel import lora_shard as lshard  # noqa: E402
from oneloop.backends.megatron_local.engines.megatron.trainer import (  # noqa: E402
    MegatronTrainerEngine,
)

RANK = 4
ADAM = dict(
    learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=0.0
)
LOSSES = ("cross_entropy", "importance_sampling")


def _dump_lora_grads(self, path: str) -> None:
    """Full adapter gradients (split parts all-gathered; a collective at TP > 1); rank 0 writes."""
    grads = {}
    for name, (delta, target) in self.lora.by_hf.items():
        for part, params in ((lshard.LORA_A, delta.lora_A), (lshard.LORA_B, delta.lora_B)):
            grad = params[target].main_grad.detach().clone()
            if delta.tp.size > 1 and lshard.split_dim(target, part) is not None:
                shards = cm.all_gather_parts(grad, delta.tp.size, delta.tp.group)
                grad = lshard.gather_part(target, part, shards)
            grads[f"{name}.{part}"] = grad.float().numpy()
    if getattr(self, "rank", 0) == 0:
        np.savez(path, **grads)


MegatronTrainerEngine._dump_lora_grads = _dump_lora_grads


def _start_adapter(work: Path, model: Path) -> Path:
    """A random non-zero adapter of every target (PEFT directory + engine state at step 0),
    built by the TP = 1 engine's own export so the names and shapes are the engine's."""
    from oneloop.backends.megatron_local.engines.base import LoraAdapter

    names = json.loads((work / "names.json").read_text())
    rng = np.random.default_rng(7)
    tensors = {k: (rng.standard_normal(shape) * 0.05).astype(np.float32) for k, shape in names}
    targets = sorted({k.split(".")[-3] for k, _ in names})
    out = work / "start"
    LoraAdapter(RANK, 32, tuple(targets), tensors).write_peft(out, str(model))
    (out / "engine.json").write_text('{"steps": 0}')
    return out


def _weights(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {"weights": (rng.random(n) > 0.2).astype(np.float32)}


def _sampled(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    _weights(rng, n)  # drawn and dropped: these data's numbers as they always were
    return {
        "logprobs": rng.normal(-5.0, 0.5, n).astype(np.float32),
        "advantages": rng.normal(0.0, 1.0, n).astype(np.float32),
    }


def _batch(seed: int, loss: str):
    inputs = _sampled if loss == "importance_sampling" else _weights
    return cm.random_data(np.random.default_rng(seed), (20, 13, 7, 17), inputs)


def _run(tp: int, work: Path, tied: bool) -> None:
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel

    model = cm.tiny_qwen3(work / "model", tied=tied)
    spec, parallel = LoraSpec(RANK, seed=3), MegatronParallel(tp=tp)
    engine, call = cm.make_engine(
        model, spec, group=tp > 1, dtype="float32", device="cpu", parallel=parallel
    )
    init = engine.adapter()
    np.savez(work / f"init{tp}.npz", **init.tensors)
    if tp == 1:
        names = [(k, list(v.shape)) for k, v in sorted(init.tensors.items())]
        (work / "names.json").write_text(json.dumps(names))
    engine.load_state(_start_adapter(work, model), with_optimizer=False)
    out: dict[str, np.ndarray] = {}
    for loss in LOSSES:
        result = engine.forward_backward(_batch(1, loss), loss, None, forward_only=False)
        out[f"loss_{loss}"] = np.float64(result.loss)
        out[f"lp_{loss}"] = np.concatenate(result.logprobs)
    call("_dump_lora_grads", str(work / f"grads{tp}.npz"))
    out["grad_norm"] = np.float64(engine.optim_step(ADAM)["grad_norm:mean"])
    adapter = engine.adapter()
    out.update({f"adapter/{k}": v for k, v in adapter.tensors.items()})
    after = engine.forward_backward(_batch(1, "cross_entropy"), "cross_entropy", None, True)
    out["lp_after_step"] = np.concatenate(after.logprobs)
    out.update({f"hf/{k}": v.float().numpy() for k, v in engine.hf_weights().items()})
    ckpt = work / f"ckpt{tp}"
    engine.save_state(ckpt, with_optimizer=True)
    (work / f"files{tp}.json").write_text(json.dumps(sorted(p.name for p in ckpt.iterdir())))
    data = _batch(2, "cross_entropy")
    engine.forward_backward(data, "cross_entropy", None, forward_only=False)
    engine.optim_step(ADAM)
    stepped = engine.adapter().tensors
    engine.load_state(ckpt, with_optimizer=True)
    restored = engine.adapter().tensors
    out["resume_restore_abs_diff_max"] = np.float64(
        max(np.abs(restored[k] - v).max() for k, v in adapter.tensors.items())
    )
    engine.forward_backward(data, "cross_entropy", None, forward_only=False)
    engine.optim_step(ADAM)
    again = engine.adapter().tensors
    out["resume_step_abs_diff_max"] = np.float64(
        max(np.abs(again[k] - v).max() for k, v in stepped.items())
    )
    if tp > 1:
        try:
            engine.load_state(work / "ckpt1", with_optimizer=True)
            out["mismatch_refused"] = np.str_("not refused")
        except ValueError as error:
            out["mismatch_refused"] = np.str_(str(error))
        engine.load_state(work / "ckpt1", with_optimizer=False)  # the adapter loads at any TP
        loaded = engine.adapter().tensors
        saved = np.load(work / "tp1.npz")
        out["tp1_ckpt_adapter_abs_diff_max"] = np.float64(
            max(np.abs(loaded[k] - saved[f"adapter/{k}"]).max() for k in loaded)
        )
        engine.close()
    np.savez(work / f"tp{tp}.npz", **out)


def _probe_tp1(work: Path, tp: int, tied: bool) -> None:
    """TP = 1 loading the TP = `tp` checkpoint: optimizer refused, adapter loaded whole."""
    from oneloop.backends.megatron_local.engines.base import LoraSpec

    model = cm.tiny_qwen3(work / "model", tied=tied)
    engine = MegatronTrainerEngine(
        model, LoraSpec(RANK, seed=3), dtype="float32", device="cpu", speed=cm.check_speed()
    )
    out: dict[str, np.ndarray] = {}
    try:
        engine.load_state(work / f"ckpt{tp}", with_optimizer=True)
        out["mismatch_refused"] = np.str_("not refused")
    except ValueError as error:
        out["mismatch_refused"] = np.str_(str(error))
    engine.load_state(work / f"ckpt{tp}", with_optimizer=False)
    saved = np.load(work / f"tp{tp}.npz")
    out["adapter_abs_diff_max"] = np.float64(
        max(np.abs(v - saved[f"adapter/{k}"]).max() for k, v in engine.adapter().tensors.items())
    )
    np.savez(work / "probe1.npz", **out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--untied", action="store_true", help="separate lm_head weights")
    parser.add_argument("--only", type=int, help="run the calls at this TP size")
    parser.add_argument("--probe", type=int, help="TP = 1 loads the checkpoint saved at this TP")
    parser.add_argument("--work", type=Path, required=True, help="where the phases meet")
    args = parser.parse_args()
    if args.probe is not None:
        _probe_tp1(args.work, args.probe, tied=not args.untied)
    else:
        _run(args.only, args.work, tied=not args.untied)
    return 0


if __name__ == "__main__":
    sys.exit(main())
