"""Router hooks of the torch engines on mixture-of-experts models: record and replay (R3).

The MoE blocks of transformers' Qwen3-MoE and Qwen3.5-MoE call a top-k router module
(`*TopKRouter`) on the flattened tokens ([rows × positions, hidden]) that returns
`(logits, top-k weights, top-k expert ids)`. A forward hook on each router sees every choice:

- `RouterRecorder` (sampler): keeps each call's expert ids, per MoE layer, in layer order;
- `RouterReplay` (trainer, rollout routing replay): replaces the ids of the positions given a
  recorded choice (id >= 0) by that choice and recomputes their weights from the router's own
  logits (softmax over all experts, gathered at the forced ids, renormalised when the router
  normalises its top-k), so gradients still reach the router; other positions keep their own
  routing. It records the router's own choice (`natural`) and the ids used (`used`), per layer.

Routing arrays are `int16 [positions, MoE layers, top-k]` (vLLM's `routed_experts` layout):
position p is the token fed at p, so a sample's routing covers its prompt and every generated
token but the last (which is never fed back).
"""

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

ROUTING_DTYPE = np.int16


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k router modules in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def top_k(model: torch.nn.Module) -> int:
    """Experts per token of the model's routers (0 for a dense model)."""
    routers = moe_routers(model)
    return int(routers[0].top_k) if routers else 0


class _Hooks:
    """Registers `hook` on every router; removes them on exit."""

    def __init__(self, routers: list[torch.nn.Module]) -> None:
        self.routers = routers
        self.handles: list[Any] = []

    def _register(self, make: Callable[[int], Callable[..., Any]]) -> None:
        self.handles = [r.register_forward_hook(make(i)) for i, r in enumerate(self.routers)]

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class RouterRecorder(_Hooks):
    """Within `with`: `calls[layer]` lists each router call's expert ids (int64 [tokens, k])."""

    def __enter__(self) -> "RouterRecorder":
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]

        def make(layer: int) -> Callable[..., Any]:
            def hook(module: Any, args: Any, output: Any) -> None:
                self.calls[layer].append(output[2].detach())

            return hook

        self._register(make)
        return self

    def take_shape(self) -> tuple[int, int]:
        """(layers, k) of the records."""
        return len(self.routers), int(self.routers[0].top_k)

    def take(self) -> torch.Tensor:
        """The oldest call of every layer as one tensor [tokens, layers, k], removed."""
        return torch.stack([calls.pop(0) for calls in self.calls], dim=1)


class RouterReplay(_Hooks):
    """Within `with`: positions whose `forced[layer]` row (int64 [tokens, k]) is >= 0 route to
    those experts; `natural[layer]` / `used[layer]` are the router's own and the applied ids."""

    def __init__(self, routers: list[torch.nn.Module], forced: torch.Tensor) -> None:
        super().__init__(routers)
        self.forced = forced  # [tokens, layers, k], -1 where free

    def __enter__(self) -> "RouterReplay":
        self.natural: list[torch.Tensor] = []
        self.used: list[torch.Tensor] = []

        def make(layer: int) -> Callable[..., Any]:
            def hook(module: Any, args: Any, output: Any) -> Any:
                logits, weights, ids = output
                forced = self.forced[:, layer, :].to(ids.device)
                replay = forced[:, 0] >= 0
                chosen = torch.where(replay[:, None], forced, ids)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float)
                picked = probs.gather(-1, chosen)
                if getattr(module, "norm_topk_prob", True):
                    picked = picked / picked.sum(dim=-1, keepdim=True)
                new_weights = torch.where(replay[:, None], picked.to(weights.dtype), weights)
                self.natural.append(ids.detach())
                self.used.append(chosen.detach())
                return logits, new_weights, chosen

            return hook

        self._register(make)
        return self


def forced_routing(
    routings: list[np.ndarray | None], seq: int, layers: int, k: int
) -> torch.Tensor:
    """Per-row routing arrays (int [positions <= seq, layers, k], or None) → int64
    [rows × seq, layers, k], -1 where a position has no recorded choice (the model's flattening)."""
    forced = torch.full((len(routings), seq, layers, k), -1, dtype=torch.long)
    for row, routing in enumerate(routings):
        if routing is not None:
            n = min(len(routing), seq)
            forced[row, :n] = torch.from_numpy(np.array(routing[:n], dtype=np.int64))
    return forced.reshape(len(routings) * seq, layers, k)


def check_routing(routing: np.ndarray, length: int, layers: int, k: int, experts: int) -> None:
    """Raise ValueError unless `routing` is int [positions <= length, layers, k] of expert ids."""
    if routing.ndim != 3 or routing.shape[1:] != (layers, k) or routing.shape[0] > length:
        raise ValueError(
            f"routed_experts: expected shape (positions <= {length}, {layers} MoE layers, "
            f"top-k {k}), got {routing.shape}"
        )
    if not np.issubdtype(routing.dtype, np.integer):
        raise ValueError(f"routed_experts: expected integer expert ids, got {routing.dtype}")
    if routing.size and (routing.min() < 0 or routing.max() >= experts):
        raise ValueError(f"routed_experts: expert ids must lie in [0, {experts})")


def replay_metrics(
    forced: torch.Tensor,
    natural: list[torch.Tensor],
    inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
    target_lp: torch.Tensor,
    free_logprobs: Callable[[], torch.Tensor],
) -> dict[str, float]:
    """One micro-batch's R3 figures, summed (the trainers' `routing/...` metrics): position ×
    MoE-layer pairs replayed and those whose own expert set (`natural[layer]`, int [tokens, k],
    in `forced`'s token order) differed; with sampler logprobs in `inputs`, their count and the
    |trainer − sampler| gap with replay (`target_lp`) and without (`free_logprobs()`, one extra
    no-grad forward)."""
    metrics = routing_counts(forced, natural)
    if "logprobs" in inputs:
        with torch.no_grad():
            free = free_logprobs()
        metrics.update(sampler_gaps(inputs, mask, target_lp))
        metrics.update(sampler_gaps(inputs, mask, free, key="routing/gap_free:sum"))
    return metrics


def routing_counts(forced: torch.Tensor, natural: list[torch.Tensor]) -> dict[str, float]:
    """Position × MoE-layer pairs replayed (`forced` [tokens, layers, k], −1 = free) and those
    whose own expert set (`natural[layer]`) differed from the replayed one."""
    replayed = forced[:, :, 0] >= 0  # [tokens, layers]
    own = torch.stack(natural, dim=1).cpu().sort(dim=-1).values
    differ = (own != forced.sort(dim=-1).values).any(dim=-1) & replayed
    return {
        "routing/positions:sum": float(replayed.sum()),
        "routing/differ:sum": float(differ.sum()),
    }


def sampler_gaps(
    inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
    target_lp: torch.Tensor,
    key: str = "routing/gap_replay:sum",
) -> dict[str, float]:
    """Σ |trainer − sampler| logprob over the sampled tokens (sampler logprob ≠ 0) under `key`;
    with the replay's key also their count (`routing/gap_tokens:sum`)."""
    sampled = mask & (inputs["logprobs"] != 0)
    gap = (target_lp.detach() - inputs["logprobs"]).abs() * sampled
    out = {key: float(gap.sum())}
    if key == "routing/gap_replay:sum":
        out["routing/gap_tokens:sum"] = float(sampled.sum())
    return out
