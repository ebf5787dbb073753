"""Rollout routing replay (R3) on the megatron engine's MoE layers.

megatron-core's top-k router asks its `router_replay` object (when one is set) for the top-k of
each call: `get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)`, scores
being the router logits (softmax after top-k, our `norm_topk_prob` models) or the softmax over
every expert (`moe_router_pre_softmax`). `MegatronRouterReplay` sets one `_LayerReplay` per MoE
layer for a micro-batch: positions given a recorded choice (id >= 0) take those experts and the
scores gathered at them, so the gating weights come from the router's own logits and gradients
still reach it; other positions keep their own routing. That is the torch engine's semantics
(`engines.torch.routing.RouterReplay`); megatron-core's own `RouterReplay` replays every position
and keeps its instances in one process-wide list, so it is not used.

megatron-core routes the tokens of a micro-batch sequence-major ([positions, rows] flattened); the
datums' routing arrays (`DatumArrays.routing`, int [positions, MoE layers, top-k]) are laid out
that way here. The checks and the `routing/...` metrics are the torch engine's
(`engines.torch.routing.check_routing`, `replay_metrics`). Under activation recompute
(`local.megatron.recompute`) the backward runs each layer's router again: the one-process engine
runs the backward inside the micro-batch's replay; a pipeline schedule queues each forward's
replay for its recomputation (`schedule_replay`).
"""

import collections
import contextlib

import torch

from oneloop.backends.megatron_local.engines.base import DatumArrays
from oneloop.backends.megatron_local.engines.torch.routing import check_routing, forced_routing


class _LayerReplay:
    """One MoE layer's replay: `forced` int64 [tokens, k], −1 where the router picks freely."""

    def __init__(self, forced: torch.Tensor) -> None:
        self.forced = forced
        self.natural: torch.Tensor | None = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):  # fmt: skip
        values, ids = default_compute_topk(scores, topk, num_groups, group_topk)
        forced = self.forced.to(ids.device)
        if forced.shape != ids.shape:
            raise ValueError(f"routed_experts: {tuple(forced.shape)} replayed choices for a router "
                             f"call of {tuple(ids.shape)} (tokens, top-k)")  # fmt: skip
        replay = (forced[:, :1] >= 0).expand_as(ids)
        chosen = torch.where(replay, forced, ids)
        self.natural = ids.detach()
        return torch.where(replay, scores.gather(1, chosen), values), chosen


class _ScheduleReplay:
    """A router's replay for one run of a pipeline schedule under activation recompute. The
    schedule runs a micro-batch's backward after later micro-batches' forwards, outside the
    replay that was installed for its forward, and recompute runs the router again there: each
    checkpointed forward's replay (or None: free routing) is queued, and each recomputation takes
    the oldest (1F1B runs the backwards in forward order), so the recomputed layer routes as its
    forward did. `current`: the replay of the micro-batch whose forward runs now."""

    def __init__(self) -> None:
        self.current: _LayerReplay | None = None
        self.queued: collections.deque = collections.deque()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):  # fmt: skip
        from megatron.core.tensor_parallel.random import is_checkpointing

        layer = self.current
        if is_checkpointing():
            if torch.is_grad_enabled():  # the backward's recomputation (the forward: no grad)
                layer = self.queued.popleft()
            else:
                self.queued.append(layer)
        if layer is None:
            return default_compute_topk(scores, topk, num_groups, group_topk)
        return layer.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)


@contextlib.contextmanager
def schedule_replay(module: torch.nn.Module, recompute: bool):
    """Within `with`: a pipeline schedule's routers keep each micro-batch's replay for its
    recomputation (`_ScheduleReplay`; `recompute` False: nothing to keep)."""
    routers = moe_routers(module) if recompute else []
    for router in routers:
        router.router_replay = _ScheduleReplay()
    try:
        yield
    finally:
        for router in routers:
            router.router_replay = None


COUNT_KEYS = ("routing/positions:sum", "routing/differ:sum")


def summed_counts(counts: dict[str, float], group) -> dict[str, float]:
    """This rank's `routing_counts` figures summed over `group` (pipeline stages and sequence
    shards, or CP ranks, each counted their own positions); every rank of `group` calls it."""
    summed = torch.tensor([counts.get(k, 0.0) for k in COUNT_KEYS], dtype=torch.float64)
    torch.distributed.all_reduce(summed, group=group)
    return dict(zip(COUNT_KEYS, summed.tolist(), strict=True))


def moe_routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's megatron-core top-k routers in layer order (empty for a dense model)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in module.modules() if isinstance(m, TopKRouter)]


class MegatronRouterReplay:
    """Within `with`: the micro-batch `data` (padded to `seq`) routes as its datums' records say;
    `forced` int64 [seq × rows, layers, k] (sequence-major) and, after the forward, `natural`
    (the routers' own choices, per layer) feed `replay_metrics`."""

    def __init__(
        self,
        routers: list[torch.nn.Module],
        data: list[DatumArrays],
        seq: int,
        stage: range | None = None,
        shard: tuple[int, int] | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        if not routers:
            raise ValueError(
                "routed_experts: routing replay needs a mixture-of-experts model; this model "
                "has no MoE router (set algo.routing_replay: false)"
            )
        config = routers[0].config
        k, experts = config.moe_router_topk, config.num_moe_experts
        # the records hold every MoE layer (each decoder layer of these families); a pipeline
        # stage's routers are its `stage` slice of them
        records = len(routers) if stage is None else config.num_layers
        for datum in data:
            if datum.routing is not None:
                check_routing(datum.routing, len(datum.tokens), records, k, experts)
        by_row = forced_routing([d.routing for d in data], seq, records, k)
        if stage is not None:
            by_row = by_row[:, stage.start : stage.stop]
        layers = len(routers)
        if by_row.shape[1] != layers:
            raise ValueError(f"routed_experts: {by_row.shape[1]} recorded MoE layers for this "
                             f"stage's {layers} routers")  # fmt: skip
        self.forced = (
            by_row.reshape(len(data), seq, layers, k).transpose(0, 1).reshape(-1, layers, k)
        )
        if shard is not None:  # sequence parallelism: this TP rank's slice of the positions
            rank, size = shard
            self.forced = self.forced.reshape(size, -1, layers, k)[rank]
        if positions is not None:  # context parallelism: this CP rank's positions
            rows = len(data)
            by_position = self.forced.reshape(seq, rows, layers, k)
            self.forced = by_position[positions.cpu()].reshape(-1, layers, k)
        self.routers = routers
        self._layers = [_LayerReplay(self.forced[:, i]) for i in range(layers)]

    @property
    def natural(self) -> list[torch.Tensor]:
        return [layer.natural for layer in self._layers]

    def __enter__(self) -> "MegatronRouterReplay":
        for router, layer in zip(self.routers, self._layers, strict=True):
            if isinstance(router.router_replay, _ScheduleReplay):  # a schedule under recompute
                router.router_replay.current = layer
            else:
                router.router_replay = layer
        return self

    def __exit__(self, *exc: object) -> None:
        for router in self.routers:
            if isinstance(router.router_replay, _ScheduleReplay):
                router.router_replay.current = None
            else:
                router.router_replay = None


def replay(
    module: torch.nn.Module,
    data: list[DatumArrays],
    seq: int,
    stage: range | None = None,
    shard: tuple[int, int] | None = None,
    positions: torch.Tensor | None = None,
) -> MegatronRouterReplay | None:
    """The replay of one micro-batch (padded to `seq`), None when no datum carries routing.
    `stage`: the decoder layers `module` holds (a pipeline stage's), None: every layer; `shard`:
    (TP rank, tp) under sequence parallelism (each TP rank routes a contiguous slice of the
    sequence-major tokens); `positions`: the positions a context-parallel rank holds (its
    chunks, in its order); None: every token."""
    if all(d.routing is None for d in data):
        return None
    return MegatronRouterReplay(moe_routers(module), data, seq, stage, shard, positions)


def free_pass(data: list[DatumArrays]) -> bool:
    """Whether a `forward_backward` call's micro-batches each run the extra no-grad forward of
    `replay_metrics` (routing and sampler logprobs). At ep > 1 (and under pipeline stages) every
    rank must know it: each forward is a collective of the expert-parallel group (a pipeline
    schedule of its own), so a call carries routing on every datum or on none (ValueError
    otherwise)."""
    with_routing = [d.routing is not None for d in data]
    if any(with_routing) and not all(with_routing):
        raise ValueError(
            "routed_experts: at local.megatron.ep > 1 every datum of a forward_backward call "
            "carries its routing, or none does"
        )
    return any(with_routing) and "logprobs" in data[0].inputs
