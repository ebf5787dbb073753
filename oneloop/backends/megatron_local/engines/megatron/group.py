"""Multi-rank `megatron` trainer: dp · pp · cp · tp ranks as Ray actors, driven as one engine.

A trainer of more than one rank is a group of Ray actors (`MegatronRankActor`), one per rank, one
GPU each on GPU, created in one Ray placement group (`rank_bundles`: TP/CP blocks packed on one
node, DP and PP allowed to span nodes). Rank 0's node address and a free port on it form the
torch.distributed world (NCCL on GPU, gloo on CPU); every rank joins Megatron's parallel state with
those sizes, placed in Megatron's rank order (`parallel.pp_plan.rank_coords`); `rank_engine_class`
picks the class each rank runs (`parallel.tp.MegatronTpRank` for TP and DP, `parallel.lora_tp.
MegatronLoraTpRank` for LoRA at TP, `parallel.pp.MegatronPpRank` for pipeline stages,
`parallel.cp_rank.MegatronCpRank` for context parallelism; MoE and the hybrids at tp > 1 run the
PP rank class as one stage).

`MegatronRayGroup` keeps the single-engine contract of `engines.base.TrainerEngine` for the trainer
actor that holds it (the actor itself holds no GPU: the ranks do): every call goes to every rank
at once and rank 0's result comes back (tensors on the host). Every wait is bounded by
`timeout_s` (also the process group's collective timeout). A failure every rank raises alike (a
bad loss config) is re-raised as is and the group stays usable; a dead rank, a silent one or one
that fails alone is an error (`BackendError`) naming the rank, its coordinates, node and pid and
the exit reason; the group then stops its actors and refuses further calls until it is rebuilt (a
new trainer from the last checkpoint: the run's `--resume`).

Weights come back to the host: `sampler_weights` as numpy (the object-store path), `hf_weights` as
host tensors (`hf_weights_on_host`), so CUDA IPC / NCCL weight sync from the trainer actor is
refused with the reason (`actors.TrainerActor.export_sampler_weights`).
"""

import pickle
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from oneloop.backends.megatron_local.engines.base import (
    DatumArrays,
    ForwardResult,
    LoraAdapter,
    LoraSpec,
    TrainerEngine,
)
from oneloop.backends.megatron_local.engines.megatron.layout import MOE_ATTENTION_TYPES, DenseShape
from oneloop.backends.megatron_local.engines.megatron.parallel.pp_plan import (
    check_pp,
    group_size,
    rank_coords,
)
from oneloop.backends.megatron_local.engines.megatron.parallel.shard import check_tp
from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel
from oneloop.backends.megatron_local.ports import free_port
from oneloop.errors import BackendError, CapabilityError

DEFAULT_TIMEOUT_S = 600.0
ERROR_GRACE_S = 30.0  # after one rank's error, how long the others get to fail alike
STRATEGIES = ("auto", "STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
# A call's pickled arguments of at most this many bytes travel inside each rank's task message
# (under Ray's 100 KiB inline limit, `max_direct_call_object_size`); a `ray.put` costs round trips
# to the node's object store on both sides (~5 ms a call on 2 loaded CPU cores, the largest part of
# the group's fixed cost per step). Larger arguments are put once, shared by every rank (Ray would
# put each rank's inline copy separately).
INLINE_ARGS_BYTES = 64 * 1024


def rank_bundles(
    parallel: MegatronParallel,
    *,
    gpus_per_rank: float = 1.0,
    cpus_per_rank: float = 1.0,
    nodes: list[dict[str, float]] | None = None,
    strategy: str = "auto",
) -> tuple[list[dict[str, float]], str]:
    """The placement-group bundles (one per rank, in global-rank order) and the Ray strategy of a
    megatron trainer with `parallel`'s sizes (dp · pp · cp · tp ranks; EP adds none).

    Each bundle is `{"GPU": gpus_per_rank, "CPU": cpus_per_rank}` (a zero entry left out; a CPU
    run has `gpus_per_rank=0`). `strategy` "auto": STRICT_PACK when the whole group fits one of
    `nodes` (each node's resource totals, e.g. `ray.nodes()[i]["Resources"]`), else PACK — Ray
    fills nodes in bundle order, and Megatron's order puts each TP/EP/CP block on consecutive
    ranks, so blocks stay on one node while DP replicas and PP stages span nodes (the group
    checks that after placement); `nodes=None` (unknown cluster) gives PACK. Any other value of
    `STRATEGIES` is used as given (`local.megatron.placement_strategy`). Pure: no Ray call.
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"local.megatron.placement_strategy={strategy!r}: expected one of "
            f"{', '.join(STRATEGIES)}"
        )
    # EP adds no ranks: Megatron carves the expert-parallel groups out of dp · cp.
    world = group_size(parallel.tp, parallel.pp, parallel.cp, parallel.dp)
    one = {k: float(v) for k, v in (("GPU", gpus_per_rank), ("CPU", cpus_per_rank)) if v > 0}
    bundles = [dict(one) for _ in range(world)]
    if strategy != "auto":
        return bundles, strategy
    need = {k: v * world for k, v in one.items()}
    fits = nodes is not None and any(
        all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes
    )
    return bundles, "STRICT_PACK" if fits else "PACK"


def rank_engine_class(parallel: MegatronParallel, lora_rank: int = 0, moe: bool = False) -> type:
    """The engine class every rank of a group with these sizes runs (one place to extend); `moe`:
    a MoE or hybrid model (at tp > 1 its sequence-parallel layers need the PP rank's grad
    reductions and micro-batch handling, which also serve one stage)."""
    if parallel.cp > 1:  # tp × cp; refuses pp > 1 with the reason (parallel.cp_rank.check_cp)
        from oneloop.backends.megatron_local.engines.megatron.parallel.cp_rank import MegatronCpRank

        return MegatronCpRank
    if parallel.pp > 1 or (moe and parallel.tp > 1):
        from oneloop.backends.megatron_local.engines.megatron.parallel.pp import MegatronPpRank

        return MegatronPpRank
    if lora_rank > 0:  # TP only: LoRA with pp or cp > 1 is refused by MegatronRayGroup
        from oneloop.backends.megatron_local.engines.megatron.parallel.lora_tp import (
            MegatronLoraTpRank,
        )

        return MegatronLoraTpRank
    from oneloop.backends.megatron_local.engines.megatron.parallel.tp import MegatronTpRank

    return MegatronTpRank


def _on_host(value: Any) -> Any:
    """Tensors of a result moved to the host (a CUDA tensor cannot leave the rank's process)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_host(v) for k, v in value.items()}
    return value


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class MegatronRankActor:
    """One rank of a `MegatronRayGroup` (see the module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.engine: Any = None

    def where(self) -> tuple[str, str, int]:
        """(node id, node IP, pid) of this rank."""
        import os

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def world_address(self) -> str:
        """tcp://<this node's IP>:<a free port> (rank 0 hosts the world)."""
        host = ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_port(host)}"

    def build(
        self,
        world: int,
        address: str,
        build: dict,
        timeout_s: float,
        setup: Callable | None,
        moe: bool,
    ) -> bool:
        """Join the world as this rank and build its engine (every rank at once)."""
        if setup is not None:
            setup()
        device = build["device"]
        if device.startswith("cuda"):
            torch.cuda.set_device(0)  # Ray shows this actor its one GPU
        torch.distributed.init_process_group(
            "nccl" if device.startswith("cuda") else "gloo",
            init_method=address,
            world_size=world,
            rank=self.rank,
            timeout=timedelta(seconds=timeout_s),
        )
        engine_class = rank_engine_class(build["parallel"], build["lora"].rank, moe)
        self.engine = engine_class(**build, rank=self.rank)
        return True

    def call(self, method: str, args: bytes) -> Any:
        """Run `method` on this rank's engine with the pickled `args`; rank 0 returns the result,
        the others None."""
        result = getattr(self.engine, method)(*pickle.loads(args))
        return _on_host(result) if self.rank == 0 else None

    def attribute(self, name: str) -> Any:
        return getattr(self.engine, name)


def _stop(actors: list, placement_group: Any) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 — already gone, or Ray shut down
            pass
    if placement_group is not None:
        try:
            ray.util.remove_placement_group(placement_group)
        except Exception:  # noqa: BLE001 — Ray shut down
            pass


class MegatronRayGroup(TrainerEngine):
    """See the module docstring. Same contract as `MegatronTrainerEngine` (LoRA at TP only).

    `gpus_per_rank` / `cpus_per_rank` / `placement_strategy`: the placement group (`rank_bundles`);
    `setup`: a picklable callable each rank actor runs before anything else (None in the product;
    the CPU checks install their CUDA-on-CPU shims with it)."""

    def __init__(
        self,
        model_path: Path,
        lora: LoraSpec,
        *,
        parallel: MegatronParallel,
        device: str = "cuda",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        gpus_per_rank: float | None = None,
        cpus_per_rank: float = 1.0,
        placement_strategy: str = "auto",
        setup: Callable | None = None,
        **engine_kwargs: Any,
    ) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from transformers import AutoConfig

        if lora.rank > 0 and (parallel.pp > 1 or parallel.cp > 1):
            raise CapabilityError(
                f"LoRA rank {lora.rank} with local.megatron pp={parallel.pp} cp={parallel.cp}: the "
                "megatron engine's LoRA adapters are tensor-parallel only; use pp=1, cp=1 for LoRA"
            )
        shape = DenseShape.from_hf(AutoConfig.from_pretrained(str(model_path)))
        moe = shape.model_type in MOE_ATTENTION_TYPES or shape.hybrid
        check_tp(shape, parallel.tp)
        check_pp(shape.layers, parallel.pp)
        world = group_size(parallel.tp, parallel.pp, parallel.cp, parallel.dp)
        self.parallel, self.world, self.timeout_s = parallel, world, timeout_s
        self.sizes = (
            f"local.megatron dp={parallel.dp} × pp={parallel.pp} × cp={parallel.cp} × "
            f"tp={parallel.tp}"
        )
        self._broken: str | None = None
        gpus = float(device.startswith("cuda")) if gpus_per_rank is None else gpus_per_rank
        if not ray.is_initialized():
            raise RuntimeError(
                f"megatron group ({self.sizes}): its ranks are Ray actors; ray.init first"
            )
        held = _held_gpus()
        if gpus > 0 and held > 0:  # the ranks would wait for GPUs their driver sits on
            raise CapabilityError(
                f"{self.sizes}: the process driving the group holds {held:g} GPUs of its own; "
                "its rank actors hold the GPUs (start the trainer actor with "
                "num_gpus=engines.factory.trainer_actor_gpus(local), i.e. 0)"
            )
        total = ray.cluster_resources()
        if gpus * world > total.get("GPU", 0.0):
            raise CapabilityError(
                f"{self.sizes} runs {world} ranks, {gpus:g} GPU each (local.gpus_per_trainer="
                f"{gpus * world:g}); the Ray cluster has {total.get('GPU', 0.0):g} GPUs"
            )
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        bundles, strategy = rank_bundles(
            parallel,
            gpus_per_rank=gpus,
            cpus_per_rank=cpus_per_rank,
            nodes=nodes,
            strategy=placement_strategy,
        )
        self.strategy = strategy
        self._pg = placement_group(bundles, strategy=strategy)
        self._actors: list = []
        self._finalizer = weakref.finalize(self, _stop, self._actors, self._pg)
        if not self._pg.wait(timeout_seconds=int(max(1, timeout_s))):
            self.close()
            raise RuntimeError(
                f"megatron group ({self.sizes}): Ray could not reserve {len(bundles)} × "
                f"{bundles[0]} ({strategy}) within {timeout_s:.0f} s; the cluster has {nodes}"
            )
        for rank in range(world):
            schedule = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            self._actors.append(
                MegatronRankActor.options(
                    num_cpus=cpus_per_rank,
                    num_gpus=gpus,
                    scheduling_strategy=schedule,
                    name=None,
                ).remote(rank)
            )
        build = dict(model_path=model_path, lora=lora, parallel=parallel, device=device)
        build.update(engine_kwargs)
        try:
            self.where: list[tuple[str, str, int]] = self._gather(
                [a.where.remote() for a in self._actors], "start"
            )
            self._check_blocks()
            address = ray.get(self._actors[0].world_address.remote(), timeout=timeout_s)
            args = (world, address, build, timeout_s, setup, moe)
            self._gather([a.build.remote(*args) for a in self._actors], "build")
        except BaseException:  # a rank that failed to build: no half-built group stays up
            self.close()
            raise

    # -- where ranks are -------------------------------------------------------------------------

    def rank_name(self, rank: int) -> str:
        """`rank 3 (dp 1, pp 0, cp 0, tp 1) on node 10.0.0.2 (abcd1234), pid 4242`."""
        p = self.parallel
        c = rank_coords(rank, p.tp, p.pp, p.cp, p.dp)
        coords = f"dp {c.dp_rank}, pp {c.pp_rank}, cp {c.cp_rank}, tp {c.tp_rank}"
        where = getattr(self, "where", None)
        if not where:
            return f"rank {rank} ({coords})"
        node, ip, pid = where[rank]
        return f"rank {rank} ({coords}) on node {ip} ({node[:8]}), pid {pid}"

    def node_ids(self) -> list[str]:
        """Ray node id of every rank, in rank order."""
        return [node for node, _ip, _pid in self.where]

    def _check_blocks(self) -> None:
        """Each TP × CP block (consecutive ranks in Megatron's order) must share one node."""
        block = self.parallel.tp * self.parallel.cp
        for start in range(0, self.world, block):
            nodes = {self.where[r][0] for r in range(start, start + block)}
            if len(nodes) > 1:
                self.close()
                raise RuntimeError(
                    f"megatron group ({self.sizes}, placement {self.strategy}): ranks "
                    f"{start}..{start + block - 1} form one TP × CP block but landed on "
                    f"{len(nodes)} nodes; give each node room for whole blocks or set "
                    "local.megatron.placement_strategy=STRICT_PACK"
                )

    # -- the call protocol -----------------------------------------------------------------------

    def _gather(self, refs: list, method: str) -> list:
        """Every rank's answer to `method` (bounded); on a dead, silent or lone failing rank the
        group is marked broken, its actors stopped, and the error names the ranks."""
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        index = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in ready:
                rank = index[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as error:  # dead: fail now
                    self._fail(method, {rank: f"died: {_reason(error)}"})
                except Exception as error:  # noqa: BLE001 — judged below
                    errors[rank] = error
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        silent = {index[ref]: f"no answer within {self.timeout_s:.0f} s" for ref in pending}
        if errors and len(errors) == len(refs):  # every rank failed alike: the group stays usable
            cause = getattr(errors[0], "cause", None)  # rank 0's own exception, as it raised it
            raise cause if isinstance(cause, Exception) else errors[0]
        if errors or silent:
            failed = {r: f"failed: {_reason(e)}" for r, e in errors.items()}
            self._fail(method, {**failed, **silent})
        return [results[rank] for rank in range(len(refs))]

    def _fail(self, method: str, reasons: dict[int, str]) -> None:
        report = "\n".join(
            f"{self.rank_name(rank)} during {method}: {reasons[rank]}" for rank in sorted(reasons)
        )
        self._broken = report
        self.close()
        raise BackendError(
            f"megatron group ({self.sizes}) failed; it refuses further calls until rebuilt from "
            f"the last checkpoint (the run's --resume):\n{report}"
        )

    def call(self, method: str, *args: Any) -> Any:
        """Run engine method `method` on every rank; rank 0's result."""
        if self._broken is not None:
            raise BackendError(
                f"megatron group ({self.sizes}) is broken by an earlier failure; rebuild it from "
                f"the last checkpoint (the run's --resume):\n{self._broken}"
            )
        # Pickled once here (the C pickler: Ray's own pickles each rank's copy again, slower), then
        # small: a copy inside each rank's task message; large: one object-store copy for all.
        payload = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        shared = payload if len(payload) <= INLINE_ARGS_BYTES else ray.put(payload)
        return self._gather([a.call.remote(method, shared) for a in self._actors], method)[0]

    def close(self) -> None:
        """Stop the rank actors and free the placement group (also done when collected)."""
        self._finalizer()

    # -- TrainerEngine ---------------------------------------------------------------------------

    def forward_backward(
        self,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        forward_only: bool,
    ) -> ForwardResult:
        return self.call("forward_backward", data, loss_fn, loss_fn_config, forward_only)

    def optim_step(self, adam_params: dict[str, float]) -> dict[str, float]:
        return self.call("optim_step", adam_params)

    hf_weights_on_host = True  # not CUDA tensors of this process: no CUDA IPC / NCCL export

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Full HF weights as host tensors (gathered from every rank)."""
        return self.call("hf_weights")

    def sampler_weights(self) -> dict[str, np.ndarray]:
        return self.call("sampler_weights")

    def adapter(self) -> LoraAdapter:
        """The full LoRA adapter (gathered from every rank; LoRA runs only)."""
        return self.call("adapter")

    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        self.call("save_state", directory, with_optimizer)

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        self.call("load_state", directory, with_optimizer)

    @property
    def steps(self) -> int:
        return ray.get(self._actors[0].attribute.remote("steps"), timeout=self.timeout_s)


def _held_gpus() -> float:
    """GPUs Ray assigned to this process (0 in a driver: it is not a worker)."""
    try:
        return float(ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0))
    except AssertionError:  # "only available when the process is a worker"
        return 0.0


def _reason(error: BaseException) -> str:
    """A rank's failure in a few lines: the cause's message, or Ray's account of the death."""
    cause = getattr(error, "cause", None)
    text = repr(cause) if isinstance(cause, BaseException) else str(error)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-6:])[:800]
