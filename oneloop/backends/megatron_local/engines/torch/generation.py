"""One running batch of the `torch` sampler: the rows of several requests generated together, to
which more requests can be admitted between decode steps (iteration-level batching).

- `admit(requests)`: the new prompts are left-padded under an attention mask and prefilled as one
  batch with a cache of their own; each request's prefill row is repeated `num_samples` times;
  the new rows then join the running rows: attention caches are left-padded to one length and
  stacked by row (a padded position is masked out, and every row carries its own positions, so a
  row's attention is unchanged), Gated DeltaNet states (fixed size per sequence) are stacked as
  they are. `joinable` says whether a model's cache layers are of kinds this handles.
- `step()`: one token for every running row (row i of a request draws from its own generator
  seeded from (`seed`, i)), finished rows leave the batch, then one decode forward for the rest.
  A request whose rows have all finished is settled at once (`take_finished`), not when the
  whole batch ends.
- MoE models: a `RouterRecorder` collects each row's routing, prefill and decode steps alike.
"""

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from oneloop.backends.megatron_local.engines.base import SampledArrays, SampleOutput, SampleRequest
from oneloop.backends.megatron_local.engines.hf import token_logprobs
from oneloop.backends.megatron_local.engines.torch.routing import ROUTING_DTYPE, RouterRecorder

JOINABLE_LAYERS = (DynamicLayer, LinearAttentionLayer)


def joinable(cache: DynamicCache) -> bool:
    """Whether rows prefilled apart can be stacked into `cache` (full attention and Gated DeltaNet
    layers can; a sliding-window or quantized layer cannot, and its batch admits no one)."""
    return all(type(layer) in JOINABLE_LAYERS for layer in cache.layers)


def _left_pad(states: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(states, (0, 0, pad, 0)) if pad else states  # [rows, heads, length, dim]


def join_caches(cache: DynamicCache, other: DynamicCache, pad: int, pad_other: int) -> None:
    """Stack `other`'s rows after `cache`'s, in place: attention keys and values left-padded by
    `pad` and `pad_other` positions to one length, linear-attention states as they are."""
    for mine, theirs in zip(cache.layers, other.layers, strict=True):
        if type(mine) is not type(theirs) or type(mine) not in JOINABLE_LAYERS:
            raise TypeError(
                f"cannot join cache layers {type(mine).__name__}, {type(theirs).__name__}"
            )
        if isinstance(mine, DynamicLayer):
            mine.keys = torch.cat([_left_pad(mine.keys, pad), _left_pad(theirs.keys, pad_other)])
            mine.values = torch.cat(
                [_left_pad(mine.values, pad), _left_pad(theirs.values, pad_other)]
            )
            continue
        for field in ("conv_states", "recurrent_states"):
            ours, new = getattr(mine, field), getattr(theirs, field)
            for index, state in ours.items():
                if (state is None) != (new[index] is None):
                    raise TypeError(f"cannot join linear-attention {field}: one side is empty")
                if state is not None:
                    ours[index] = torch.cat([state, new[index]])


def runs_drawn_alike(active: list[int], params: list[tuple]) -> list[tuple[int, int]]:
    """`(start, stop)`: runs of adjacent active rows with the same sampling parameters (one draw
    call each); `params[row]` = (temperature, top_k, top_p) of the row's request."""
    runs: list[tuple[int, int]] = []
    for p, row in enumerate(active):
        if runs and params[row] == params[active[p - 1]]:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


class Generation:
    """See the module docstring. `engine` is the `TorchSamplerEngine` (its model, draw, stops and
    generators); the caller holds its lock with the weights of `version` loaded."""

    def __init__(self, engine, version: int, recorder: RouterRecorder | None) -> None:
        self.engine = engine
        self.version = version
        self.recorder = recorder
        self.requests: list[SampleRequest] = []
        self.prompt_logprobs: list[np.ndarray | None] = []
        self.left: list[int] = []  # unfinished rows per request
        self.owner: list[int] = []  # row → request
        self.params: list[tuple] = []  # row → (temperature, top_k, top_p)
        self.generators: list[torch.Generator] = []
        self.tokens: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.reasons: list[str] = []
        self.routing: list[list[torch.Tensor]] = []
        self.active: list[int] = []  # rows still generating, in the cache's row order
        self.cache: DynamicCache | None = None
        self.logits = self.mask = self.positions = None
        self.finished: list[tuple[int, SampleOutput]] = []

    @property
    def rows(self) -> int:
        return len(self.active)

    @property
    def length(self) -> int:
        """Positions in the running cache (0 before the first admit)."""
        return 0 if self.mask is None else int(self.mask.shape[1])

    @torch.no_grad()
    def admit(self, requests: list[SampleRequest]) -> None:
        """Prefill `requests` and add their rows to the batch (see the module docstring)."""
        engine, device = self.engine, self.engine.device
        lengths = [int(r.prompt.shape[0]) for r in requests]
        width = max(lengths)
        ids = torch.zeros((len(requests), width), dtype=torch.long)  # left padding, masked
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for j, request in enumerate(requests):
            ids[j, width - lengths[j] :] = torch.from_numpy(request.prompt.astype(np.int64))
            mask[j, width - lengths[j] :] = 1
        ids, mask = ids.to(device), mask.to(device)
        want_prompt = any(r.include_prompt_logprobs for r in requests)
        cache = DynamicCache(config=engine.model.config)
        out = engine.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            **({} if want_prompt or not engine.keeps_logits else {"logits_to_keep": 1}),
            **{engine.cache_kwarg: cache},
        )
        first = len(self.requests)
        for j, (request, n) in enumerate(zip(requests, lengths, strict=True)):
            self.prompt_logprobs.append(
                engine._prompt_logprobs_from(out.logits[j, width - n :], ids[j, width - n :])
                if request.include_prompt_logprobs
                else None
            )
        owner = [j for j, r in enumerate(requests) for _ in range(r.num_samples)]
        prefill = None
        if self.recorder is not None:  # [requests × width, layers, k] → each row's prompt
            shape = self.recorder.take_shape()
            prefill = self.recorder.take().reshape(len(requests), width, *shape)
        rows = torch.tensor(owner, device=device)
        cache.reorder_cache(rows)  # row select; hybrid (GDN) caches too
        logits, mask = out.logits[:, -1, :][rows], mask[rows]
        positions = torch.tensor([lengths[j] for j in owner], device=device)
        del out
        for j, request in enumerate(requests):
            seed = request.seed if request.seed is not None else int.from_bytes(np.random.bytes(7))
            for i in range(request.num_samples):
                self.generators.append(engine._generator(seed, i))
                self.params.append((request.temperature, request.top_k, request.top_p))
                self.owner.append(first + j)
                if prefill is not None:
                    self.routing.append([prefill[j, width - lengths[j] :]])
        self.requests += requests
        self.left += [r.num_samples for r in requests]
        new_rows = list(range(len(self.tokens), len(self.tokens) + len(owner)))
        self.tokens += [[] for _ in owner]
        self.logprobs += [[] for _ in owner]
        self.reasons += ["length"] * len(owner)
        if self.cache is None:
            self.cache, self.logits, self.mask, self.positions = cache, logits, mask, positions
        else:
            length = max(self.length, width)
            join_caches(self.cache, cache, length - self.length, length - width)
            self.mask = torch.cat(
                [F.pad(self.mask, (length - self.length, 0)), F.pad(mask, (length - width, 0))]
            )
            self.logits = torch.cat([self.logits, logits])
            self.positions = torch.cat([self.positions, positions])
        self.active += new_rows

    @torch.no_grad()
    def step(self) -> None:
        """One token per running row; finished rows leave; one decode forward for the rest."""
        engine, active = self.engine, self.active
        chosen = torch.empty(len(active), dtype=torch.long, device=engine.device)
        for start, stop in runs_drawn_alike(active, self.params):
            request = self.requests[self.owner[active[start]]]
            gens = [self.generators[g] for g in active[start:stop]]
            chosen[start:stop] = engine._draw(self.logits[start:stop], request, gens)
        picked = chosen.tolist()
        scored = token_logprobs(self.logits, chosen).tolist()
        keep = []
        for p, g in enumerate(active):
            request = self.requests[self.owner[g]]
            self.tokens[g].append(picked[p])
            self.logprobs[g].append(scored[p])
            if engine._stops(picked[p], self.tokens[g], request):
                self.reasons[g] = "stop"
            elif len(self.tokens[g]) < request.max_tokens:
                keep.append(p)
                continue
            self._row_done(g)
        if not keep:
            self.active, self.cache = [], None  # the batch has ended
            return
        mask, positions = self.mask, self.positions
        if len(keep) < len(active):  # finished rows leave the batch
            index = torch.tensor(keep, device=engine.device)
            self.cache.reorder_cache(index)
            chosen, mask, positions = chosen[index], mask[index], positions[index]
            self.active = [active[p] for p in keep]
        self.mask = torch.cat([mask, mask.new_ones((len(self.active), 1))], dim=1)
        out = engine.model(
            input_ids=chosen[:, None],
            attention_mask=self.mask,
            position_ids=positions[:, None],
            use_cache=True,
            **{engine.cache_kwarg: self.cache},
        )
        self.logits = out.logits[:, -1, :]
        self.positions = positions + 1
        if self.recorder is not None:
            step = self.recorder.take()  # [active rows, layers, k]
            for p, g in enumerate(self.active):
                self.routing[g].append(step[p : p + 1])

    def _row_done(self, row: int) -> None:
        j = self.owner[row]
        self.left[j] -= 1
        if self.left[j]:
            return
        rows = [g for g, owner in enumerate(self.owner) if owner == j]
        sequences = [
            SampledArrays(
                tokens=np.asarray(self.tokens[g], dtype=np.int32),
                logprobs=np.asarray(self.logprobs[g], dtype=np.float32),
                stop_reason=self.reasons[g],
                routed_experts=torch.cat(self.routing[g]).cpu().numpy().astype(ROUTING_DTYPE)
                if self.routing
                else None,
            )
            for g in rows
        ]
        prompt = self.prompt_logprobs[j]
        self.finished.append((j, SampleOutput(sequences, self.version, prompt_logprobs=prompt)))

    def take_finished(self) -> list[tuple[int, SampleOutput]]:
        """(request index in admission order, output) of the requests settled since the last
        call."""
        done, self.finished = self.finished, []
        return done


def run_to_end(generation: Generation, requests: list[SampleRequest]) -> list[SampleOutput]:
    """Admit `requests` and step until every row has finished; each request's output, in order."""
    generation.admit(requests)
    outputs: dict[int, SampleOutput] = {}
    while generation.rows:
        generation.step()
        outputs.update(generation.take_finished())
    return [outputs[j] for j in range(len(generation.requests))]
