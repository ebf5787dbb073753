"""CPU check (gloo) of the megatron engine's context parallelism before a device run.

    PYTHONPATH=/tmp/msite .venv/bin/python scripts/device/check_megatron_cp_cpu.py [--cp 2] [--tp 1]

(megatron-core installed with `pip install --no-deps --target /tmp/msite .w1/megatron_core*.whl`.)
Runs a tiny random Qwen3 in float32 at CP = 1 (the one-process engine, in a subprocess: one
torch.distributed world per process) and at CP = `--cp` (× TP = `--tp`) through `megatron_group`
(ranks on gloo), on the same calls: forward_backward with cross_entropy then ppo (accumulating;
ragged datums whose lengths are not multiples of 2·cp, several micro-batches), optim_step,
forward_only, a save/load round trip; then compares losses, metrics, per-token logprobs, the
summed-then-reduced gradients, the grad norm and the weights after the step. Both fused_rope
settings (our RoPE at global positions, and Megatron's CP-sliced RoPE).

CPU shims, here only (the spawned ranks import this file as their main module, so they get them):
- `cpu_megatron.cuda_calls_on_cpu`: `torch.cuda.current_device` → "cpu" (Megatron's RoPE moves its
  frequencies there), and `torch.cuda.current_stream` → a no-op stream (DDP's grad sync fetches it
  to wait on CUDA-graph events);
- Megatron's `get_pos_emb_on_this_cp_rank` builds its chunk index with `pin_memory=True` and
  `.cuda()`: replaced by the same index_select on the tables' device;
- Megatron's optimizer allocates on CUDA (`_dummy_overflow_buf`): the engine keeps Megatron's real
  DDP (its gradient buffers, scaling factor and all-reduce over the DP×CP group, which is what CP
  must get right) with `use_distributed_optimizer=False`, and a torch AdamW over the fp32
  parameters reading DDP's reduced `main_grad` stands in for Megatron's optimizer. The grad norm
  is computed over full replicated gradients, so the optimizer part runs at TP = 1 only.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import cpu_megatron as cm
import numpy as np
import torch

from oneloop.backends.megatron_local.engines.megatron_trainer import (
    NO_CLIP,
    MegatronParallel,
    MegatronTrainerEngine,
)

cm.cuda_calls_on_cpu()


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """Megatron's chunk selection (chunks r and 2cp-1-r) on the tables' own device."""
    cp, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * cp - rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def _patch_rope() -> None:
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank


_patch_rope()  # at import: the spawned ranks run this module's top level, not _run


class _CpuAdam:
    """Stand-in for Megatron's CUDA-only optimizer: torch AdamW on DDP's reduced main_grad."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        self.named = named
        self.optimizer = torch.optim.AdamW([p for _, p in named], lr=0.0, weight_decay=0.0)
        self.param_groups = self.optimizer.param_groups
        self.config = SimpleNamespace(clip_grad=NO_CLIP)
        self.grads: dict[str, np.ndarray] = {}

    def step(self):
        for name, param in self.named:
            param.grad = param.main_grad.detach().clone().to(param.dtype)
            self.grads[name] = param.grad.numpy().copy()
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for _, p in self.named])))
        if self.config.clip_grad < NO_CLIP:
            torch.nn.utils.clip_grad_norm_([p for _, p in self.named], self.config.clip_grad)
        self.optimizer.step()
        return True, norm, None

    def zero_grad(self) -> None:
        for _, param in self.named:
            param.grad = None


def _cpu_optimizer(self):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(
        config=self.config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        module=self.module,
    )
    return ddp, _CpuAdam([(n, p) for n, p in self.module.named_parameters() if p.requires_grad])


def _dump_grads(self, path: str) -> None:
    """The reduced gradients the last optim_step used (rank 0 writes)."""
    if getattr(self, "global_rank", 0) == 0:
        np.savez(path, **self.optimizer.grads)


MegatronTrainerEngine._build_optimizer = _cpu_optimizer
MegatronTrainerEngine._dump_grads = _dump_grads
ADAM = dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
LENGTHS = (37, 13, 7, 1, 22)  # none a multiple of 4 except none; 1 token pads to a whole 2·cp
BUDGET = 64  # max_tokens_per_microbatch: several micro-batches


def _weights(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {"weights": (rng.random(n) > 0.3).astype(np.float32)}


def _ppo(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    _weights(rng, n)  # drawn and dropped: the ppo data's numbers as they always were
    return {
        "logprobs": rng.normal(-4.8, 0.3, n).astype(np.float32),
        "advantages": rng.normal(0.0, 1.0, n).astype(np.float32),
    }


def _data(loss: str):
    if loss == "ppo":
        return cm.random_data(np.random.default_rng(1), LENGTHS, _ppo)
    return cm.random_data(np.random.default_rng(0), LENGTHS, _weights)


def _run(tp: int, cp: int, fused_rope: bool, step: bool, work: Path) -> None:
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.megatron_speed import MegatronSpeed

    model = cm.tiny_qwen3(work / "model")
    parallel = MegatronParallel(tp=tp, cp=cp, use_distributed_optimizer=False)
    kwargs = dict(
        dtype="float32",
        device="cpu",
        parallel=parallel,
        max_tokens_per_microbatch=BUDGET,
        speed=MegatronSpeed(fused_rope=fused_rope),
    )
    engine, call = cm.make_engine(model, LoraSpec(0), group=tp * cp > 1, **kwargs)
    out: dict = {}
    for loss in ("cross_entropy", "ppo"):
        result = engine.forward_backward(_data(loss), loss, None, forward_only=False)
        out[loss] = {
            "loss": result.loss,
            "metrics": result.metrics,
            "per_datum": result.per_datum_loss,
        }
        out[f"{loss}_lp"] = [x.tolist() for x in result.logprobs]
    tag = f"tp{tp}cp{cp}"
    if step:
        out["step"] = engine.optim_step(ADAM)
        call("_dump_grads", str(work / f"grads_{tag}.npz"))
    after = engine.forward_backward(_data("cross_entropy"), "cross_entropy", None, True)
    out["after_loss"], out["after_lp"] = after.loss, [x.tolist() for x in after.logprobs]
    np.savez(work / f"weights_{tag}.npz", **{k: v.numpy() for k, v in engine.hf_weights().items()})
    engine.save_state(work / f"ckpt_{tag}", with_optimizer=True)
    engine.forward_backward(_data("ppo"), "ppo", None, forward_only=False)
    if step:
        engine.optim_step(ADAM)  # moves the weights; load_state must bring them back
    engine.load_state(work / f"ckpt_{tag}", with_optimizer=True)
    again = engine.forward_backward(_data("cross_entropy"), "cross_entropy", None, True)
    out["reloaded_loss"] = again.loss
    (work / f"{tag}.json").write_text(json.dumps(out))
    if hasattr(engine, "close"):
        engine.close()


def _max_gap(a, b) -> float:
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b, strict=True)
    )


def _compare(work: Path, tag: str) -> dict:
    one, many = (json.loads((work / f"{t}.json").read_text()) for t in ("tp1cp1", tag))
    figures: dict = {}
    for loss in ("cross_entropy", "ppo"):
        figures[loss] = {
            "loss_cp1": one[loss]["loss"],
            f"loss_{tag}": many[loss]["loss"],
            "loss_abs_diff": abs(one[loss]["loss"] - many[loss]["loss"]),
            "per_datum_abs_diff_max": _max_gap([one[loss]["per_datum"]], [many[loss]["per_datum"]]),
            "metrics_cp1": one[loss]["metrics"],
            f"metrics_{tag}": many[loss]["metrics"],
            "logprob_abs_diff_max": _max_gap(one[f"{loss}_lp"], many[f"{loss}_lp"]),
            "lengths_ok": [len(x) for x in many[f"{loss}_lp"]] == list(LENGTHS),
        }
    figures["forward_only_after_step"] = {
        "loss_abs_diff": abs(one["after_loss"] - many["after_loss"]),
        "logprob_abs_diff_max": _max_gap(one["after_lp"], many["after_lp"]),
    }
    figures["reload_loss_abs_diff"] = abs(many["reloaded_loss"] - many["after_loss"])
    w1, wn = np.load(work / "weights_tp1cp1.npz"), np.load(work / f"weights_{tag}.npz")
    if "step" in many:
        g1, gn = np.load(work / "grads_tp1cp1.npz"), np.load(work / f"grads_{tag}.npz")
        figures["optim_step"] = {
            "grad_norm_cp1": one["step"]["grad_norm:mean"],
            f"grad_norm_{tag}": many["step"]["grad_norm:mean"],
            "grad_rel_diff_max": cm.grad_rel_diff_max(g1, gn),
            "weights_abs_diff_max": cm.max_abs_diff(w1, wn, w1.files),
        }
    else:  # TP > 1: no optimizer stand-in; weights unchanged, exported in the same HF layout
        figures["weights_abs_diff_max"] = cm.max_abs_diff(w1, wn, w1.files)
    return figures


def _ok(figures: dict) -> bool:
    ok = all(
        figures[loss]["lengths_ok"]
        and figures[loss]["logprob_abs_diff_max"] < 1e-4
        and figures[loss]["per_datum_abs_diff_max"] < 1e-3
        and figures[loss]["loss_abs_diff"] < 1e-3
        for loss in ("cross_entropy", "ppo")
    )
    ppo = figures["ppo"]
    many = next(v for k, v in ppo.items() if k.startswith("metrics_tp"))
    ok = ok and many["clipped_tokens:sum"] == ppo["metrics_cp1"]["clipped_tokens:sum"]
    ok = ok and figures["forward_only_after_step"]["logprob_abs_diff_max"] < 1e-4
    ok = ok and figures["reload_loss_abs_diff"] < 1e-5
    if "optim_step" in figures:
        step = figures["optim_step"]
        norms = [v for k, v in step.items() if k.startswith("grad_norm")]
        ok = ok and abs(norms[0] - norms[1]) / norms[0] < 1e-5
        ok = ok and step["grad_rel_diff_max"] < 1e-4 and step["weights_abs_diff_max"] < 1e-5
    else:
        ok = ok and figures["weights_abs_diff_max"] == 0.0
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--only", help=argparse.SUPPRESS)  # "tp,cp,fused_rope[,step]" → --work
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only is not None:
        tp, cp, fused, *step = (int(x) for x in args.only.split(","))
        _run(tp, cp, bool(fused), bool(step[0]) if step else tp == 1, args.work)
        return 0
    all_ok = True
    for fused in (0, 1):
        work = Path(tempfile.mkdtemp(prefix="megatron-cp-cpu-"))
        step = int(args.tp == 1)  # the stand-in optimizer: TP = 1
        sizes = ((1, 1), (args.tp, args.cp))
        cm.run_phases(__file__, work, (["--only", f"{t},{c},{fused},{step}"] for t, c in sizes))
        figures = _compare(work, f"tp{args.tp}cp{args.cp}")
        ok = _ok(figures)
        all_ok = all_ok and ok
        print(f"RESULT megatron_cp_cpu fused_rope={bool(fused)}", json.dumps(figures, indent=1))
        print("OK" if ok else "MISMATCH")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
