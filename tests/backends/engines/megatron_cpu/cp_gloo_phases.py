"""The phases of the megatron engine's context-parallel check on gloo ranks (test_megatron_cp_gloo).

    .venv/bin/python tests/backends/engines/megatron_cpu/cp_gloo_phases.py \
        --only TP,CP,FUSED_ROPE,STEP --work DIR

One phase per process (one torch.distributed world each): a tiny random Qwen3 in float32 at
CP = 1 (the one-process engine) or CP > 1 (× TP) through `megatron.group` (ranks on gloo) makes the
same calls: forward_backward with cross_entropy then ppo (accumulating; ragged datums whose
lengths are not multiples of 2·cp, several micro-batches), optim_step (STEP = 1), forward_only, a
save/load round trip; it writes losses, metrics, per-token logprobs, the summed-then-reduced
gradients, the grad norm and the weights after the step into DIR, which test_megatron_cp_gloo.py
compares, for both fused_rope settings (our RoPE at global positions, and Megatron's CP-sliced
RoPE).

CPU shims, here only (the rank actors import this file as a module, so they get them):
- `cpu_megatron.cuda_calls_on_cpu`: `torch.cuda.current_device` → "cpu" (Megatron's RoPE moves its
  frequencies there), and `torch.cuda.current_stream` → a no-op stream (DDP's grad sync fetches it
  to wait on CUDA-graph events);
- Megatron's `get_pos_emb_on_this_cp_rank` builds its chunk index with `pin_memory=True` and
  `.cuda()`: replaced by the same index_select on the tables' device (also `cuda_calls_on_cpu`);
- Megatron's optimizer allocates on CUDA (`_dummy_overflow_buf`): the engine keeps Megatron's real
  DDP (its gradient buffers, scaling factor and all-reduce over the DP×CP group, which is what CP
  must get right) with `use_distributed_optimizer=False`, and a torch AdamW over the fp32
  parameters reading DDP's reduced `main_grad` stands in for Megatron's optimizer. The grad norm
  is computed over full replicated gradients, so the optimizer part runs at TP = 1 only.
"""

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import cpu_megatron as cm
import numpy as np
import torch

from oneloop.backends.megatron_local.engines.megatron.trainer import (
    NO_CLIP,
    MegatronParallel,
    MegatronTrainerEngine,
)

cm.cuda_calls_on_cpu()


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

    model = cm.tiny_qwen3(work / "model")
    parallel = MegatronParallel(tp=tp, cp=cp, use_distributed_optimizer=False)
    kwargs = dict(
        dtype="float32",
        device="cpu",
        parallel=parallel,
        max_tokens_per_microbatch=BUDGET,
        speed=cm.check_speed(fused_rope=fused_rope),
    )
    engine, call = cm.make_engine(model, LoraSpec(0), group=tp * cp > 1, **kwargs)
    out: dict = {"lengths": list(LENGTHS)}
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", required=True, help="tp,cp,fused_rope[,step] of this phase")
    parser.add_argument("--work", type=Path, required=True, help="where the phases meet")
    args = parser.parse_args()
    tp, cp, fused, *step = (int(x) for x in args.only.split(","))
    _run(tp, cp, bool(fused), bool(step[0]) if step else tp == 1, args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
