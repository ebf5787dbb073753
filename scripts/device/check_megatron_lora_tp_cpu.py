"""CPU check (gloo, float32) of the megatron engine's LoRA at tensor-parallel size > 1.

    PYTHONPATH=/tmp/msite .venv/bin/python scripts/device/check_megatron_lora_tp_cpu.py [--tp 2]

(megatron-core installed with `pip install --no-deps --target /tmp/msite .w1/megatron_core*.whl`.)
A tiny random Qwen3 (GQA, QK-norm; `--untied` for a separate lm_head) with LoRA on every target
(q/k/v/o, gate/up/down, lm_head) at TP = 1 (`MegatronTrainerEngine`) and TP = `--tp`
(`megatron_group` → `megatron_lora_tp.MegatronLoraTpRank`, ranks on gloo), each in its own
subprocess (one torch.distributed world per process). Both start from the same random non-zero
adapter (B != 0, loaded through the LoRA checkpoint path, so A's gradients and the adapters' place
in the fused outputs count from the first step) and run the same calls:
forward_backward (cross_entropy, then importance_sampling, accumulating) → every adapter
gradient (split parts gathered) → optim_step (grad norm) → adapter() → forward_only logprobs →
merged hf_weights → save_state with optimizer → one more step → load_state → the same step again
(must repeat it). At TP > 1 also: loading the TP = 1 checkpoint with its optimizer is refused with
the reason (and the group stays usable), without the optimizer it loads; and a third process at
TP = 1 does the same with the TP > 1 checkpoint.

CPU shims, here only (never in product code): Megatron's DDP and optimizer allocate a few scalars
on "cuda", wait on CUDA streams and check `param.type()` against `torch.cuda.*Tensor`; RoPE moves
its frequencies to `torch.cuda.current_device()`. `cpu_megatron.cuda_calls_on_cpu` with
`allocations`, called below before oneloop is imported, maps those to the CPU for every rank
(spawned ranks import this file as their main module, so the patches reach them too).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import cpu_megatron as cm
import numpy as np

cm.cuda_calls_on_cpu(allocations=True)

from oneloop.backends.megatron_local.engines import megatron_lora_shard as lshard  # noqa: E402
from oneloop.backends.megatron_local.engines.megatron_trainer import (  # noqa: E402
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
    from oneloop.backends.megatron_local.engines.megatron_trainer import MegatronParallel

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
    engine = MegatronTrainerEngine(model, LoraSpec(RANK, seed=3), dtype="float32", device="cpu")
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


def _compare(work: Path, tp: int) -> tuple[dict, bool]:
    one, many = np.load(work / "tp1.npz"), np.load(work / f"tp{tp}.npz")
    g1, gn = np.load(work / "grads1.npz"), np.load(work / f"grads{tp}.npz")
    i1, i_n = np.load(work / "init1.npz"), np.load(work / f"init{tp}.npz")
    probe = np.load(work / "probe1.npz")

    def gap(prefix: str) -> float:
        return cm.prefix_abs_diff_max(one, many, prefix)

    figures: dict = {
        "init_adapter_abs_diff_max": cm.max_abs_diff(i1, i_n, i1.files),
        "grad_rel_diff_max": cm.grad_rel_diff_max(g1, gn),
        "grad_norm_tp1": float(one["grad_norm"]),
        f"grad_norm_tp{tp}": float(many["grad_norm"]),
        "adapter_after_step_abs_diff_max": gap("adapter/"),
        "logprob_after_step_abs_diff_max": gap("lp_after_step"),
        "merged_hf_abs_diff_max": gap("hf/"),
        "checkpoint_files_tp1": json.loads((work / "files1.json").read_text()),
        f"checkpoint_files_tp{tp}": json.loads((work / f"files{tp}.json").read_text()),
        f"resume_restore_abs_diff_max_tp{tp}": float(many["resume_restore_abs_diff_max"]),
        f"resume_step_abs_diff_max_tp{tp}": float(many["resume_step_abs_diff_max"]),
        "resume_step_abs_diff_max_tp1": float(one["resume_step_abs_diff_max"]),
        "tp1_ckpt_adapter_abs_diff_max": float(many["tp1_ckpt_adapter_abs_diff_max"]),
        "tp_mismatch_refusal": str(many["mismatch_refused"]),
        f"tp{tp}_ckpt_adapter_at_tp1_abs_diff_max": float(probe["adapter_abs_diff_max"]),
        "tp_mismatch_refusal_at_tp1": str(probe["mismatch_refused"]),
    }
    for loss in LOSSES:
        figures[f"{loss}_loss_tp1"] = float(one[f"loss_{loss}"])
        figures[f"{loss}_loss_tp{tp}"] = float(many[f"loss_{loss}"])
        figures[f"{loss}_logprob_abs_diff_max"] = gap(f"lp_{loss}")
    files_1 = set(figures["checkpoint_files_tp1"]) - {"optimizer.pt"}
    files_n = {f for f in figures[f"checkpoint_files_tp{tp}"] if not f.startswith("optimizer.")}
    checks = {
        "init": figures["init_adapter_abs_diff_max"] == 0.0,
        "loss": all(
            abs(figures[f"{x}_loss_tp1"] - figures[f"{x}_loss_tp{tp}"])
            < 1e-4 * abs(figures[f"{x}_loss_tp1"])
            for x in LOSSES
        ),
        "logprobs": all(figures[f"{x}_logprob_abs_diff_max"] < 1e-4 for x in LOSSES),
        "grads": figures["grad_rel_diff_max"] < 1e-4,
        "grad_norm": abs(figures["grad_norm_tp1"] - figures[f"grad_norm_tp{tp}"])
        < 1e-5 * figures["grad_norm_tp1"],
        "adapter": figures["adapter_after_step_abs_diff_max"] < 1e-5,
        "after_step": figures["logprob_after_step_abs_diff_max"] < 1e-4,
        "merged": figures["merged_hf_abs_diff_max"] < 1e-5,
        "ckpt_layout": files_1 == files_n
        and {f"optimizer.tp{tp}.rank{r}.pt" for r in range(tp)}
        <= set(figures[f"checkpoint_files_tp{tp}"]),
        "resume": figures[f"resume_restore_abs_diff_max_tp{tp}"] == 0.0
        and figures[f"resume_step_abs_diff_max_tp{tp}"] < 1e-6
        and figures["resume_step_abs_diff_max_tp1"] < 1e-6,
        "cross_tp_adapter_load": figures["tp1_ckpt_adapter_abs_diff_max"] == 0.0,
        "mismatch_refused": "saved at local.megatron tp=1 " in figures["tp_mismatch_refusal"],
        "tpn_ckpt_at_tp1": figures[f"tp{tp}_ckpt_adapter_at_tp1_abs_diff_max"] == 0.0,
        "mismatch_refused_at_tp1": f"saved at local.megatron tp={tp} "
        in figures["tp_mismatch_refusal_at_tp1"],
    }
    figures["checks_failed"] = [k for k, ok in checks.items() if not ok]
    return figures, all(checks.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--untied", action="store_true", help="separate lm_head weights")
    parser.add_argument("--only", type=int, help=argparse.SUPPRESS)  # one TP size, into --work
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--probe", type=int, help=argparse.SUPPRESS)  # TP = 1 loads ckpt{probe}
    args = parser.parse_args()
    if args.only is not None:
        _run(args.only, args.work, tied=not args.untied)
        return 0
    if args.probe is not None:
        _probe_tp1(args.work, args.probe, tied=not args.untied)
        return 0
    work = Path(tempfile.mkdtemp(prefix="megatron-lora-tp-cpu-"))
    tied = [] if not args.untied else ["--untied"]
    phases = (["--only", "1"], ["--only", str(args.tp)], ["--probe", str(args.tp)])
    cm.run_phases(__file__, work, ([*phase, *tied] for phase in phases))
    figures, ok = _compare(work, args.tp)
    print("RESULT megatron_lora_tp_cpu", json.dumps(figures, indent=1))
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
