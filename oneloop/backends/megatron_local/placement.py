"""Placement plan: which trainer rank and which sampler engine goes to which node and GPU.

A pure planner (no Ray needed): `plan_placement(local, cluster)` takes the local backend config and
a cluster (nodes with GPU and CPU counts: read from a live Ray, `live_cluster()`, or described in a
YAML/JSON file, `read_cluster_file()`) and returns a `PlacementPlan`: every rank and engine with
its node and GPU, and the Ray placement-group bundles and strategy of every group. A layout that
does not fit raises `PlacementError` naming what is short. `oneloop train --plan` prints it; the
runtime places sampler engines on the nodes it names (`sampler_options`).

The rule (the trainer's is `engines/megatron/group.py`'s `rank_bundles`, checked equal by
`tests/backends/local/test_placement.py`; the planner does not import that module, which pulls in
torch and megatron-core, so `--plan` stays light):

- Trainer of more than one rank: dp · pp · cp · tp rank actors, ep dividing dp · cp (`dp`
  unset: from `local.gpus_per_trainer`), one placement group of one bundle per rank
  `{GPU: 1, CPU: 1}`, strategy STRICT_PACK when the whole group fits one node, else PACK (or
  `local.megatron.placement_strategy`). Ranks are in Megatron's order (tp fastest, then cp, ep,
  dp, pp), so each run of tp · cp · ep consecutive ranks is a *block* whose collectives run
  every layer: it must stay on one node; blocks (DP replicas, PP stages) may span nodes. A
  trainer of one rank is the trainer actor itself (no placement group) on `gpus_per_trainer`.
- Sampler engines: `local.samplers_per_model` per base model; a vLLM engine holds `local.vllm.tp`
  GPUs on one node (its workers' all-reduces, like TP above): one placement group of one bundle,
  strategy STRICT_PACK. A torch engine holds `local.gpus_per_sampler` of one GPU (CUDA), or
  nothing (CPU: placed by node affinity; one CPU of the node in the plan's accounting).
- Order: the trainer first (blocks first fit over nodes in order, lowest free GPUs first), then
  the engines first fit on what is left, so on a cluster of whole GPUs the trainer takes the
  first nodes and the engines the rest; colocated fractions (0.5 + 0.5) put each engine on a
  trainer GPU's other half. CPU engines are spread (the node with the most free CPUs first), so
  two engines use two nodes.
GPU indices are positions within a node (Ray hands out the actual devices); the nodes are the
plan's commitment: on a live cluster of several nodes each sampler engine is pinned to its node
(`sampler_actor_options`: the `ray.io/node-id` label of its bundle, or node affinity), and the
trainer's placement group, created after the engines, takes the nodes left free.
"""

import math
from dataclasses import dataclass, field
from typing import Any

from oneloop.backends.config import LocalBackendConfig
from oneloop.backends.megatron_local.clusters import (
    ClusterNode,
    PlacementError,
    live_cluster,
    read_cluster_file,
)

__all__ = ["ClusterNode", "PlacementError", "live_cluster", "plan_placement", "read_cluster_file"]

NODE_ID_LABEL = "ray.io/node-id"  # Ray's built-in node label (bundle_label_selector)
CPU_PER_CPU_RANK = 1.0  # a rank or engine without a GPU holds one CPU in the plan
EPS = 1e-9  # float slack when fractions of a GPU are summed (0.5 + 0.5)


@dataclass(frozen=True)
class Seat:
    """One rank (trainer) or worker (sampler engine): where it runs and how much GPU it holds."""

    role: str
    node: str
    gpu: int | None  # position on the node; None = CPU only
    share: float  # fraction of that GPU (1.0 = whole)


@dataclass(frozen=True)
class GroupPlan:
    """One placement group: bundles (Ray resource dicts), strategy, each bundle's node, seats."""

    name: str
    strategy: str
    bundles: tuple[dict[str, float], ...]
    bundle_nodes: tuple[str, ...]
    seats: tuple[Seat, ...]


@dataclass(frozen=True)
class TrainerShape:
    """The trainer's rank layout and the GPU share of each rank (0 = CPU)."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    share: float = 1.0
    cpus: float = 0.0  # CPUs each rank's bundle holds (a rank-actor group: 1, `rank_bundles`)
    strategy: str = "auto"  # `local.megatron.placement_strategy`

    @property
    def unit(self) -> int:
        """Ranks that must share a node: tp · lcm(cp, ep), the TP/CP block and the EP group
        (Megatron carves each expert-parallel group out of ep consecutive dp · cp positions, so
        its all-to-all runs inside this block)."""
        return self.tp * math.lcm(self.cp, self.ep)

    @property
    def ranks(self) -> int:
        """dp · pp · cp · tp: EP adds no ranks (it divides dp · cp)."""
        return self.dp * self.pp * self.cp * self.tp


@dataclass(frozen=True)
class SamplerShape:
    """Sampler engines: how many, GPUs each (tensor parallel), GPU share of each (0 = CPU)."""

    engines: int = 1
    tp: int = 1
    share: float = 0.0
    engine: str = "torch"


@dataclass(frozen=True)
class PlacementPlan:
    nodes: tuple[ClusterNode, ...]
    trainer_shape: TrainerShape
    sampler_shape: SamplerShape
    trainer: GroupPlan
    samplers: tuple[GroupPlan, ...]
    node_ids: dict[str, str | None] = field(default_factory=dict)

    def node_roles(self) -> dict[str, str]:
        """Per node: `train`, `sample`, `train+sample` or `idle`."""
        used: dict[str, set[str]] = {n.name: set() for n in self.nodes}
        for seat in self.trainer.seats:
            used[seat.node].add("train")
        for group in self.samplers:
            for seat in group.seats:
                used[seat.node].add("sample")
        order = ("train", "sample")
        return {k: "+".join(r for r in order if r in v) or "idle" for k, v in used.items()}

    def to_dict(self) -> dict[str, Any]:
        def group(g: GroupPlan) -> dict[str, Any]:
            return {
                "name": g.name,
                "strategy": g.strategy,
                "bundles": [dict(b) for b in g.bundles],
                "bundle_nodes": list(g.bundle_nodes),
                "seats": [vars(s) for s in g.seats],
            }

        return {
            "nodes": [vars(n) for n in self.nodes],
            "roles": self.node_roles(),
            "trainer": group(self.trainer),
            "samplers": [group(g) for g in self.samplers],
        }

    def format(self) -> str:
        """The plan as text: a per-node summary, then every group's bundles and seats."""
        t, s = self.trainer_shape, self.sampler_shape
        gpus = sum(n.gpus for n in self.nodes)
        out = [
            f"cluster: {len(self.nodes)} nodes, {gpus} GPUs",
            f"trainer: {t.ranks} ranks = dp {t.dp} x pp {t.pp} x cp {t.cp} x tp {t.tp} (ep "
            f"{t.ep} within dp x cp); packed units of tp*lcm(cp,ep) = {t.unit} rank(s) on one "
            "node; "
            + (f"{_num(t.share)} GPU per rank" if t.share else "CPU"),
            f"samplers: {s.engines} {s.engine} engine(s) x tp {s.tp}; "
            + (f"{_num(s.share)} GPU per worker" if s.share else "CPU"),
            "",
            "nodes:",
        ]
        roles = self.node_roles()
        width = max(len(n.name) for n in self.nodes) + 1
        for node in self.nodes:
            seats = [x for x in self._all_seats() if x.node == node.name]
            train = sum(1 for x in seats if x.role.startswith("trainer"))
            engines = sorted(
                {x.role.split(" worker")[0] for x in seats if x.role.startswith("sampler")}
            )
            parts = [f"{train} trainer rank(s)"] if train else []
            if engines:
                parts.append(f"{len(engines)} sampler engine(s): {_span(engines)}")
            out.append(
                f"  {node.name + ':':<{width}} {roles[node.name]:<12} {node.gpus} GPUs; "
                + ("; ".join(parts) or "nothing placed")
            )
        out += ["", _group_text(self.trainer, t.unit), ""]
        out += [_group_text(g) for g in self.samplers]
        return "\n".join(out)

    def _all_seats(self) -> list[Seat]:
        return [*self.trainer.seats, *(x for g in self.samplers for x in g.seats)]


def _num(x: float) -> str:
    return f"{x:g}"


def _span(names: list[str]) -> str:
    """`sampler 4 .. sampler 7` for a run of names, else the names joined."""
    if len(names) <= 2:
        return ", ".join(names)
    numbers = sorted(int(n.split()[-1]) for n in names)
    return f"sampler {numbers[0]} .. sampler {numbers[-1]}"


def _group_text(g: GroupPlan, block: int = 1) -> str:
    """A trainer: a header, then one line per block of `block` ranks (its node and GPUs); a
    sampler engine: one line."""
    if g.name != "trainer":
        res = ", ".join(f"{k}: {_num(v)}" for k, v in g.bundles[0].items())
        how = "node affinity" if g.strategy == "NODE_AFFINITY" else f"placement group {g.strategy}"
        return f"{g.name}: {how} {{{res}}} -> {g.bundle_nodes[0]} {_gpus(g.seats)}"
    res = ", ".join(f"{k}: {_num(v)}" for k, v in g.bundles[0].items())
    kind = (
        "one actor, no placement group"
        if g.strategy == "ACTOR"
        else f"one placement group, strategy {g.strategy}, {len(g.bundles)} bundles {{{res}}}"
    )
    lines = [f"trainer: {kind}"]
    for start in range(0, len(g.seats), block):
        seats = g.seats[start : start + block]
        first, last = seats[0].role.split(" (")[0], seats[-1].role.split()[2]
        coords = seats[0].role.split(" (")[1].rstrip(")").split()
        last_dp = seats[-1].role.split(" (")[1].split()[1]
        dps = coords[1] if last_dp == coords[1] else f"{coords[1]}..{last_dp}"  # an EP block
        lines.append(f"  {first}..{last} (dp {dps}, pp {coords[3]}) -> {seats[0].node} "
                     f"{_gpus(seats)}")  # fmt: skip
    return "\n".join(lines)


def _gpus(seats: tuple[Seat, ...]) -> str:
    if seats[0].gpu is None:
        return "cpu"
    gpus = [x.gpu for x in seats]
    if len(gpus) > 2 and gpus == list(range(gpus[0], gpus[-1] + 1)):
        return f"gpu{gpus[0]}-{gpus[-1]}"
    return ",".join(f"gpu{x}" for x in gpus)


# -- shapes from the config ----------------------------------------------------------------------


def trainer_shape(local: LocalBackendConfig) -> TrainerShape:
    """The trainer's ranks: megatron's dp · pp · cp · tp (ep divides dp · cp); a group of more
    than one rank is rank actors of one GPU (and one CPU) each (`engines/megatron/group.py`), one
    rank is the trainer actor itself on `gpus_per_trainer` (a fraction when colocated). `dp`
    unset: as many replicas as `gpus_per_trainer` holds (`parallel.pp_plan.resolve_dp`). The
    torch trainer is one rank on `gpus_per_trainer` of a GPU (CUDA) or a CPU."""
    if local.trainer_engine == "torch":
        share = min(local.gpus_per_trainer, 1.0) if local.device == "cuda" else 0.0
        return TrainerShape(share=share)
    m = local.megatron
    g = local.gpus_per_trainer
    model = m.tp * m.pp * m.cp
    dp = m.dp if m.dp is not None else max(1, int(g // model))
    ranks = dp * model
    if (dp * m.cp) % m.ep:
        raise PlacementError(
            f"local.megatron.ep={m.ep} must divide dp × cp = {dp} × {m.cp} (Megatron carves the "
            "expert-parallel groups out of the data- and context-parallel ranks)"
        )
    if ranks > 1 and g != ranks:
        raise PlacementError(
            f"local.gpus_per_trainer={g:g}: local.megatron dp={dp} × pp={m.pp} × cp={m.cp} × "
            f"tp={m.tp} runs {ranks} ranks (ep={m.ep} divides dp × cp), one GPU each, so the "
            f"trainer needs local.gpus_per_trainer={ranks}"
        )
    if ranks == 1:
        return TrainerShape(share=min(g, 1.0) if 0 < g < 1 else 1.0)
    return TrainerShape(dp, m.pp, m.cp, m.ep, m.tp, 1.0, 1.0, m.placement_strategy)


def sampler_shape(local: LocalBackendConfig, models: int = 1) -> SamplerShape:
    """`samplers_per_model` engines per base model; a vllm engine holds `vllm.tp` GPUs (each a
    fraction `gpus_per_sampler` when that is < 1, else whole); a torch engine one GPU share on
    CUDA, or none."""
    engines = local.samplers_per_model * models
    g = local.gpus_per_sampler
    if local.sampler_engine == "vllm":
        tp = local.vllm.tp  # tp > 1: whole GPUs (config: `_vllm_tp_whole_gpus`)
        return SamplerShape(engines, tp, g if 0 < g < 1 and tp == 1 else 1.0, "vllm")
    share = min(g, 1.0) if local.device == "cuda" else 0.0
    return SamplerShape(engines, 1, share, "torch")


# -- the planner -------------------------------------------------------------------------------


class _Free:
    """Free GPU shares and CPUs per node while placing."""

    def __init__(self, nodes: tuple[ClusterNode, ...]) -> None:
        self.nodes = nodes
        self.gpu = {n.name: [1.0] * n.gpus for n in nodes}
        self.cpu = {n.name: float(n.cpus) for n in nodes}

    def gpus_on(self, node: str, count: int, share: float) -> list[int] | None:
        fits = [i for i, free in enumerate(self.gpu[node]) if free + EPS >= share]
        return fits[:count] if len(fits) >= count else None

    def take(self, node: str, gpus: list[int], share: float, cpus: float) -> None:
        for i in gpus:
            self.gpu[node][i] -= share
        self.cpu[node] -= cpus

    def free_gpus(self) -> float:
        return sum(sum(max(f, 0.0) for f in v) for v in self.gpu.values())


def _place_unit(
    free: _Free, count: int, share: float, spread: bool, cpus: float = 0.0
) -> tuple[str, list[int]] | None:
    """A node (and GPU positions) with room for `count` seats of `share` (0 = CPU seats): the first
    that fits in node order, or with `spread` the one with the most free CPUs."""
    nodes = list(free.nodes)
    if spread:
        nodes.sort(key=lambda n: -free.cpu[n.name])  # stable: ties keep node order
    for node in nodes:
        if share == 0:
            if free.cpu[node.name] + EPS >= count * CPU_PER_CPU_RANK:
                return node.name, []
            continue
        gpus = free.gpus_on(node.name, count, share)
        if gpus is not None and free.cpu[node.name] + EPS >= count * cpus:
            return node.name, gpus
    return None


def _trainer_role(rank: int, t: TrainerShape) -> str:
    tp = rank % t.tp
    cp = (rank // t.tp) % t.cp
    dp = (rank // (t.tp * t.cp)) % t.dp
    pp = rank // (t.tp * t.cp * t.dp)
    ep = (rank // t.tp) % t.ep  # Megatron's expert order: tp, then ep over the dp · cp ranks
    return f"trainer rank {rank} (dp {dp} pp {pp} cp {cp} ep {ep} tp {tp})"


def _bundle(count: int, share: float) -> dict[str, float]:
    if share == 0:
        return {"CPU": count * CPU_PER_CPU_RANK}
    return {"GPU": round(count * share, 6)}


def plan_placement(
    local: LocalBackendConfig, cluster: list[ClusterNode] | tuple[ClusterNode, ...], models: int = 1
) -> PlacementPlan:
    """Place the trainer of `local` and its sampler engines (`models` base models) on `cluster`
    (see the module docstring); raises PlacementError naming what is short."""
    return plan_shapes(trainer_shape(local), sampler_shape(local, models), cluster)


def plan_shapes(
    t: TrainerShape, s: SamplerShape, cluster: list[ClusterNode] | tuple[ClusterNode, ...]
) -> PlacementPlan:
    nodes = tuple(cluster)
    if not nodes:
        raise PlacementError("the cluster has no nodes")
    free = _Free(nodes)
    largest = max(n.gpus for n in nodes)
    if t.share and t.unit > largest:
        raise PlacementError(
            f"trainer needs {t.unit} GPUs packed on one node for tp·lcm(cp,ep)={t.unit} "
            f"(local.megatron tp={t.tp}, cp={t.cp}, ep={t.ep}); largest node has {largest}"
        )
    trainer = _place_trainer(free, t, nodes)
    samplers = _place_samplers(free, s, nodes, largest)
    return PlacementPlan(nodes, t, s, trainer, tuple(samplers), {n.name: n.node_id for n in nodes})


def _trainer_strategy(t: TrainerShape, nodes: tuple[ClusterNode, ...]) -> str:
    """`group.rank_bundles`' rule: auto = STRICT_PACK when the whole group fits one node (its
    GPU and CPU totals), else PACK; any other value as given."""
    if t.ranks == 1:
        return "ACTOR"  # one rank: the trainer actor itself, no placement group
    if t.strategy != "auto":
        return t.strategy
    need_gpu, need_cpu = t.ranks * t.share, t.ranks * t.cpus
    fits = any(n.gpus + EPS >= need_gpu and n.cpus + EPS >= need_cpu for n in nodes)
    return "STRICT_PACK" if fits else "PACK"


def _place_trainer(free: _Free, t: TrainerShape, nodes: tuple[ClusterNode, ...]) -> GroupPlan:
    """Blocks of tp · cp · ep consecutive ranks, each on one node, first fit in node order (what
    Ray's PACK does with bundles in rank order; STRICT_PACK: one node for all)."""
    strategy = _trainer_strategy(t, nodes)
    blocks = t.ranks // t.unit
    if strategy in ("SPREAD", "STRICT_SPREAD") and t.unit > 1:
        raise PlacementError(
            f"local.megatron.placement_strategy={strategy} spreads the ranks of each tp·cp·ep="
            f"{t.unit} block over nodes; those blocks must share a node: use auto or PACK"
        )
    if strategy == "STRICT_PACK":
        blocks_at_once, blocks = blocks, 1  # one "block" of every rank
    else:
        blocks_at_once = 1
    size = t.unit * blocks_at_once
    seats: list[Seat] = []
    for block in range(blocks):
        spot = _place_unit(free, size, t.share, spread=strategy.endswith("SPREAD"), cpus=t.cpus)
        if spot is None:
            gpus = f"{size * t.share:g} GPU(s)" if t.share else f"{size:g} CPU(s)"
            raise PlacementError(
                f"trainer needs {blocks} block(s) of {gpus} on one node each ({t.ranks} ranks: "
                f"{blocks} block(s) of tp·lcm(cp,ep) = {t.unit}, strategy {strategy}); the cluster "
                f"({len(nodes)} nodes, {sum(n.gpus for n in nodes)} GPUs) has room for {block}"
            )
        node, gpus_at = spot
        free.take(node, gpus_at, t.share, t.cpus * size if t.share else size * CPU_PER_CPU_RANK)
        for k in range(size):
            rank = block * size + k
            gpu = gpus_at[k] if gpus_at else None
            seats.append(Seat(_trainer_role(rank, t), node, gpu, t.share))
    bundle = _rank_bundle(t)
    return GroupPlan(
        "trainer", strategy, tuple(dict(bundle) for _ in seats), tuple(x.node for x in seats),
        tuple(seats),
    )  # fmt: skip


def _rank_bundle(t: TrainerShape) -> dict[str, float]:
    """One rank's bundle, as `group.rank_bundles` builds it (a zero entry left out)."""
    if t.ranks == 1:
        return {"GPU": t.share} if t.share else {"CPU": CPU_PER_CPU_RANK}
    return {k: float(v) for k, v in (("GPU", t.share), ("CPU", t.cpus)) if v > 0}


def _place_samplers(
    free: _Free, s: SamplerShape, nodes: tuple[ClusterNode, ...], largest: int
) -> list[GroupPlan]:
    if s.share and s.tp > largest:
        raise PlacementError(
            f"sampler engine needs {s.tp} GPUs on one node for local.vllm.tp={s.tp}; largest node "
            f"has {largest}"
        )
    groups = []
    for e in range(s.engines):
        spot = _place_unit(free, s.tp if s.share else 1, s.share, spread=not s.share)
        if spot is None:
            need = f"{s.tp} GPU(s) of {s.share:g}" if s.share else "1 CPU"
            left = f"{free.free_gpus():g} GPU(s)" if s.share else f"{sum(free.cpu.values()):g} CPUs"
            raise PlacementError(
                f"samplers need {s.engines} engine(s) x {need} on one node each "
                f"(local.samplers_per_model, local.vllm.tp); after the trainer, {left} are "
                f"left: room for only {e} engine(s). Lower local.samplers_per_model or add nodes"
            )
        node, gpus = spot
        free.take(node, gpus, s.share, 0.0 if s.share else CPU_PER_CPU_RANK)
        name = f"sampler {e}"
        seat_list = (
            tuple(Seat(f"{name} worker {w}", node, g, s.share) for w, g in enumerate(gpus))
            if gpus
            else (Seat(f"{name} worker 0", node, None, 0.0),)
        )
        bundle = _bundle(s.tp, s.share) if s.share else {"CPU": CPU_PER_CPU_RANK}
        strategy = "STRICT_PACK" if s.share else "NODE_AFFINITY"  # a CPU engine: no group
        groups.append(GroupPlan(name, strategy, (bundle,), (node,), seat_list))
    return groups


# -- runtime: put a sampler engine where the plan says -------------------------------------------

PG_READY_TIMEOUT_S = 300.0


def sampler_options(plan: PlacementPlan, index: int) -> dict[str, Any]:
    """Ray actor options that put sampler engine `index` on its planned node: a GPU engine in its
    own placement group (one bundle of its tp GPUs, pinned by node label; waited for, bounded); a
    CPU engine by node affinity. The caller passes them to `SamplerActor.options(...)`."""
    import ray
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    group = plan.samplers[index]
    node_id = plan.node_ids.get(group.bundle_nodes[0])
    if node_id is None:
        raise PlacementError(f"{group.name}: node {group.bundle_nodes[0]} has no Ray node id (a "
                             "described cluster plans, it cannot place)")  # fmt: skip
    bundle = dict(group.bundles[0])
    if "GPU" not in bundle:
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
    pg = ray.util.placement_group(
        [bundle], strategy=group.strategy, bundle_label_selector=[{NODE_ID_LABEL: node_id}]
    )
    try:
        ray.get(pg.ready(), timeout=PG_READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise PlacementError(
            f"{group.name}: Ray did not reserve {bundle} on {group.bundle_nodes[0]}"
            f" within {PG_READY_TIMEOUT_S:.0f} s (taken by another job?)"
        ) from None
    return {
        "num_gpus": bundle["GPU"],
        "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
    }


def sampler_num_gpus(local: LocalBackendConfig) -> float:
    """GPUs one sampler actor reserves: `vllm.tp` whole GPUs for a tensor-parallel vllm engine,
    else `local.gpus_per_sampler` (as before tensor parallelism)."""
    if local.sampler_engine == "vllm" and local.vllm.tp > 1:
        return float(local.vllm.tp)
    return local.gpus_per_sampler


def sampler_actor_options(local: LocalBackendConfig) -> list[dict[str, Any]]:
    """Ray options for each of a pool's `samplers_per_model` sampler actors. On a one-node Ray:
    the GPUs each reserves (Ray packs an actor's GPUs on its node). On several nodes: the node
    the plan of `local` on the live cluster names for each engine (`sampler_options`)."""
    nodes = live_cluster()
    if len(nodes) <= 1:
        return [{"num_gpus": sampler_num_gpus(local)}] * local.samplers_per_model
    plan = plan_placement(local, nodes)
    return [sampler_options(plan, i) for i in range(local.samplers_per_model)]


def placement_groups(options: list[dict[str, Any]]) -> list[Any]:
    """The placement groups `sampler_actor_options` reserved (to remove when the pool stops)."""
    groups = [getattr(o.get("scheduling_strategy"), "placement_group", None) for o in options]
    return [g for g in groups if g is not None]
