"""Multi-GPU `megatron` trainer: one engine object driving tp · pp · cp ranks, one per GPU.

The trainer actor keeps the single-process engine contract: it holds this object, which is global
rank 0 (on GPU 0 of the actor's GPUs) and starts ranks 1..N-1 as spawned worker processes on the
actor's other GPUs (Ray's CUDA_VISIBLE_DEVICES is inherited, so the actor must hold N = tp · pp ·
cp GPUs: `local.gpus_per_trainer = N`). All ranks join one torch.distributed world (NCCL on GPU,
gloo on CPU) and Megatron's parallel state with those sizes, placed in Megatron's rank order
(`parallel.pp_plan.rank_coords`). Every rank is told the full `MegatronParallel` and its global
rank; `rank_engine_class` picks the class each rank runs (`parallel.tp.MegatronTpRank` for TP
only, `parallel.lora_tp.MegatronLoraTpRank` for LoRA at TP, `parallel.pp.MegatronPpRank` for
pipeline stages).

Each call is sent first to every worker (method name + picklable numpy args over a pipe), then run
on rank 0; the workers run the same call (Megatron's collectives pair them up) and answer ok or
their traceback; rank 0 returns its own result. Bounded waits: joining the world and every
collective time out after `timeout_s` (the process group's timeout), a worker's answer is awaited
at most `timeout_s` while its process is watched. A failure every rank raises alike (a bad loss
config) is re-raised as is and the group stays usable; a dead, silent or lone failing rank is an
error naming the rank and its exit code or traceback, after which the group refuses further calls.
"""

import multiprocessing as mp
import time
import traceback
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oneloop.backends.megatron_local.engines.base import (
    DatumArrays,
    ForwardResult,
    LoraAdapter,
    LoraSpec,
    TrainerEngine,
)
from oneloop.backends.megatron_local.engines.megatron.layout import DenseShape
from oneloop.backends.megatron_local.engines.megatron.parallel.pp_plan import check_pp, group_size
from oneloop.backends.megatron_local.engines.megatron.parallel.shard import check_tp
from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel
from oneloop.backends.megatron_local.ports import free_port
from oneloop.errors import CapabilityError

DEFAULT_TIMEOUT_S = 600.0
_POLL_S = 0.5


def rank_engine_class(parallel: MegatronParallel, lora_rank: int = 0) -> type:
    """The engine class every rank of a group with these sizes runs (one place to extend)."""
    if parallel.cp > 1:  # tp × cp; refuses pp > 1 with the reason (parallel.cp_rank.check_cp)
        from oneloop.backends.megatron_local.engines.megatron.parallel.cp_rank import MegatronCpRank

        return MegatronCpRank
    if parallel.pp > 1:
        from oneloop.backends.megatron_local.engines.megatron.parallel.pp import MegatronPpRank

        return MegatronPpRank
    if lora_rank > 0:  # TP only: LoRA with pp or cp > 1 is refused by MegatronGroupEngine
        from oneloop.backends.megatron_local.engines.megatron.parallel.lora_tp import (
            MegatronLoraTpRank,
        )

        return MegatronLoraTpRank
    from oneloop.backends.megatron_local.engines.megatron.parallel.tp import MegatronTpRank

    return MegatronTpRank


def _join_world(rank: int, world: int, address: str, device: str, timeout_s: float) -> str:
    """Join the group's world (size `world`) as `rank`; returns this rank's device string."""
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    torch.distributed.init_process_group(
        backend,
        init_method=address,
        world_size=world,
        rank=rank,
        timeout=timedelta(seconds=timeout_s),
    )
    return f"cuda:{rank}" if device.startswith("cuda") else "cpu"


def _worker_main(rank: int, world: int, address: str, build: dict, timeout_s: float, conn) -> None:
    """Rank `rank` (>= 1): build the engine, then run rank 0's calls until told to close."""
    try:
        device = _join_world(rank, world, address, build["device"], timeout_s)
        engine_class = rank_engine_class(build["parallel"], build["lora"].rank)
        engine = engine_class(**{**build, "device": device}, rank=rank)
    except BaseException:  # noqa: BLE001 — reported to rank 0, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # rank 0's process is gone
            break
        if message[0] == "close":
            break
        method, args = message
        try:
            getattr(engine, method)(*args)
            conn.send(("ok", None))
        except Exception:  # noqa: BLE001 — reported to rank 0, which raises it
            conn.send(("error", traceback.format_exc()))
    torch.distributed.destroy_process_group()


def _stop_workers(workers: list[tuple[Any, Any]], timeout_s: float) -> None:
    for _process, conn in workers:
        try:
            conn.send(("close", None))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + timeout_s
    for process, conn in workers:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(5.0)
        conn.close()


class MegatronGroupEngine(TrainerEngine):
    """See the module docstring. Same contract as `MegatronTrainerEngine` (LoRA at TP only)."""

    label = "TP"  # names ranks in errors: "TP" for a TP-only group, "model-parallel" otherwise

    def __init__(
        self,
        model_path: Path,
        lora: LoraSpec,
        *,
        parallel: MegatronParallel,
        device: str = "cuda",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **engine_kwargs: Any,
    ) -> None:
        if lora.rank > 0 and (parallel.pp > 1 or parallel.cp > 1):
            raise CapabilityError(
                f"LoRA rank {lora.rank} with local.megatron pp={parallel.pp} cp={parallel.cp}: the "
                "megatron engine's LoRA adapters are tensor-parallel only; use pp=1, cp=1 for LoRA"
            )
        tp, world = parallel.tp, group_size(parallel.tp, parallel.pp, parallel.cp)
        from transformers import AutoConfig

        shape = DenseShape.from_hf(AutoConfig.from_pretrained(str(model_path)))
        check_tp(shape, tp)
        check_pp(shape.layers, parallel.pp)
        sizes = f"local.megatron tp={tp} × pp={parallel.pp} × cp={parallel.cp}"
        if device.startswith("cuda") and torch.cuda.device_count() < world:
            raise CapabilityError(
                f"{sizes} needs {world} GPUs in the trainer actor (set "
                f"local.gpus_per_trainer={world}); it sees {torch.cuda.device_count()}"
            )
        self.tp, self.world, self.timeout_s = tp, world, timeout_s
        if world != tp:
            self.label = "model-parallel"
        self._broken: str | None = None
        address = f"tcp://127.0.0.1:{free_port()}"
        build = dict(model_path=model_path, lora=lora, parallel=parallel, device=device)
        build.update(engine_kwargs)
        context = mp.get_context("spawn")
        self._workers: list[tuple[Any, Any]] = []
        for rank in range(1, world):
            parent, child = context.Pipe()
            process = context.Process(
                target=_worker_main,
                args=(rank, world, address, build, timeout_s, child),
                name=f"megatron-rank{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self._workers.append((process, parent))
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers, 30.0)
        try:
            local = _join_world(0, world, address, device, timeout_s)
            engine_class = rank_engine_class(parallel, lora.rank)
            self.local = engine_class(**{**build, "device": local}, rank=0)
        except BaseException as error:
            reasons = [f"rank {r}: {kind} {detail}" for r, kind, detail in self._answers(5.0)]
            self.close()
            raise RuntimeError(
                f"megatron group ({sizes}) failed to start: rank 0: {error!r}; {reasons}"
            ) from error
        answers = self._answers()
        if any(kind != "ready" for _, kind, _ in answers):
            self.close()
            self._fail("build", answers, "ready")

    # -- the call protocol -----------------------------------------------------------------------

    def _answers(self, wait_s: float | None = None) -> list[tuple[int, str, str | None]]:
        """(rank, kind, detail) per worker: kind is its answer ("ok", "ready", "error") or "dead"
        (exited, or silent for `wait_s`, default `timeout_s`, while alive)."""
        wait = self.timeout_s if wait_s is None else wait_s
        answers = []
        for rank, (process, conn) in enumerate(self._workers, start=1):
            deadline = time.monotonic() + wait
            answer = None
            while answer is None:
                if conn.poll(_POLL_S):
                    try:
                        answer = conn.recv()
                    except EOFError:
                        answer = ("dead", f"exited with code {process.exitcode}")
                elif not process.is_alive():
                    answer = ("dead", f"exited with code {process.exitcode}")
                elif time.monotonic() > deadline:
                    answer = ("dead", f"no answer within {wait:.0f} s")
            answers.append((rank, answer[0], answer[1]))
        return answers

    def _fail(self, method: str, answers: list[tuple[int, str, str | None]], expect: str) -> None:
        """Mark the group broken and raise, naming every rank that did not answer `expect`."""
        report = "\n".join(
            f"{self.label} rank {rank} during {method}: {detail}"
            for rank, kind, detail in answers
            if kind != expect
        )
        self._broken = report
        raise RuntimeError(f"megatron {self.label} group failed:\n{report}")

    def _call(self, method: str, *args: Any) -> Any:
        if self._broken is not None:
            raise RuntimeError(
                f"megatron {self.label} group is broken by an earlier failure:\n{self._broken}"
            )
        for rank, (process, conn) in enumerate(self._workers, start=1):
            if not process.is_alive():
                self._broken = f"{self.label} rank {rank} exited with code {process.exitcode}"
                raise RuntimeError(f"megatron {self.label} group failed: {self._broken}")
            conn.send((method, args))
        try:
            result = getattr(self.local, method)(*args)
        except Exception:
            answers = self._answers()
            if any(kind != "error" for _, kind, _ in answers):
                self._fail(method, answers, "error")  # ranks disagree: the group is out of step
            raise  # every rank failed alike (e.g. a bad loss config): the group stays usable
        answers = self._answers()
        if any(kind != "ok" for _, kind, _ in answers):
            self._fail(method, answers, "ok")
        return result

    def close(self) -> None:
        """Stop the worker ranks (also done when this object is collected)."""
        self._finalizer()

    # -- TrainerEngine ---------------------------------------------------------------------------

    def forward_backward(
        self,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardResult:
        return self._call("forward_backward", data, loss_fn, loss_fn_config, forward_only)

    def optim_step(self, adam_params: dict[str, float]) -> dict[str, float]:
        return self._call("optim_step", adam_params)

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Full HF weights on rank 0's GPU (gathered from every rank)."""
        return self._call("hf_weights")

    def sampler_weights(self) -> dict[str, np.ndarray]:
        return self._call("sampler_weights")

    def adapter(self) -> LoraAdapter:
        """The full LoRA adapter (gathered from every rank; LoRA runs only)."""
        return self._call("adapter")

    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        self._call("save_state", directory, with_optimizer)

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        self._call("load_state", directory, with_optimizer)

    @property
    def steps(self) -> int:
        return self.local.steps
