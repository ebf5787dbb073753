"""Sampler engine `torch`: transformers generation from token ids with per-token logprobs.

- Weight sets are named (`base`, one inflight set per training model, snapshots); the model holds
  one at a time and switches by `load_state_dict` (cheap at the sizes this engine serves). Weights
  only move forward: installing a version older than the one held under a key is a no-op.
- Concurrent requests are batched (`base.ConcurrentSampler`): `submit_sample` queues a request and
  returns a future; one worker thread takes whatever is waiting (once the first request of an idle
  spell arrives it gathers while more keep arriving: `GATHER_S`, `MAX_GATHER_S`) and runs the
  requests of one weight set as one padded batch: prompts left-padded under an attention mask, one
  prefill, then one decode step per token for every row of every request; a finished row leaves
  the batch and a finished request is answered at once. Requests that arrive while a batch runs
  join it between decode steps (`engines.torch.generation`: prefilled apart, their cache stacked
  onto the running one), while the first in line is on the same weight set and no weight update
  waits. `sample` runs one request on the calling thread. A lock guards the model, so a weight
  update lands between batches.
- Determinism: row i of a request draws from its own `torch.Generator` seeded from (`seed`, i),
  and temperature / top-k / top-p / the draw act row by row. Same seed ⇒ same tokens, whether the
  request runs alone or batched with others, and sample i does not depend on num_samples. (Batch
  shape and padding move the logits' float rounding by ~1e-6, never the draw's random stream.)
- Isolation: a request that fails its checks (token ids outside the vocabulary, ...) fails alone
  before any batch runs; a batch that raises anyway reruns its unanswered requests one by one, so
  only the request that fails gets the error. `batch_history` records the requests per batch
  (joiners included), `joined_requests` those that joined a running batch.
- Returned logprobs are the model's raw (temperature 1, unfiltered) log-probabilities of the sampled
  tokens, the same quantity the trainer computes; temperature / top-k / top-p only shape the draw.
- Stops: `stop=None` stops on the model's EOS ids; token-id stops end on (and include) that token;
  string stops end on the token whose decoding completes the string (included).
- Mixture-of-experts models (Qwen3-MoE, Qwen3.5-MoE): every sequence carries the experts each
  fed position was routed to (`SampledArrays.routed_experts`, `routing.RouterRecorder`), the
  record rollout routing replay gives the trainer. Hybrid (Gated DeltaNet) models keep their
  fixed-size state in the same cache, selected by row like the KV cache.
"""

import contextlib
import inspect
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from oneloop.backends.megatron_local.engines.base import (
    SampleOutput,
    SamplerEngine,
    SampleRequest,
)
from oneloop.backends.megatron_local.engines.hf import (
    cache_kwarg,
    fuse_experts,
    load_causal_lm,
    set_threads,
    token_logprobs,
    untie_embeddings,
)
from oneloop.backends.megatron_local.engines.torch.generation import (
    Generation,
    joinable,
    run_to_end,
)
from oneloop.backends.megatron_local.engines.torch.routing import RouterRecorder, moe_routers
from oneloop.errors import BackendError, RequestError

BASE_KEY = "base"
GATHER_S = 0.005
"""How long the worker waits for one more request once the first of an idle spell arrives, and
again after each arrival: callers that fire together (one Ray actor call each) land within a few
ms of each other; 5 ms is small beside one request's generation, and requests that come while a
batch runs join the next batch anyway."""
MAX_GATHER_S = 0.05
"""The most a batch waits for requests still arriving (a burst through `oneloop serve` spreads
over tens of ms); later ones join the running batch."""
MAX_BATCH_ROWS = 64
"""Sequences (sum of num_samples) per batch; a larger single request still runs, alone."""
MAX_BATCH_PROMPT_TOKENS = 32768
"""Padded prompt tokens per batch's prefill (requests × longest prompt): bounds padding waste and
the prefill's activations; a longer single request still runs, alone."""
MAX_BATCH_CACHE_TOKENS = 4 * MAX_BATCH_PROMPT_TOKENS
"""Padded cache positions (rows × positions) a batch may reach by admitting requests mid-way:
a long prompt joining pads every running row's cache to its length."""
IDLE_POLL_S = 1.0  # the worker's bounded wait on an empty queue, between checks of `close()`
CLOSE_TIMEOUT_S = 30.0  # how long `close()` waits for the batch in progress to finish


@dataclass
class _Queued:
    """A request waiting for the worker, and the future its caller holds."""

    key: str
    request: SampleRequest
    future: Future


class TorchSamplerEngine(SamplerEngine):
    """See the module docstring (a `ConcurrentSampler`)."""

    def __init__(
        self,
        model_path: Path,
        *,
        dtype: str = "float32",
        threads: int | None = None,
        max_snapshots: int = 8,
        device: str = "cpu",
        admit_mid_batch: bool = True,
    ) -> None:
        """`admit_mid_batch=False` runs each batch with the requests it started with (the
        sampling bench's baseline)."""
        set_threads(threads)
        self.device = torch.device(device)
        self.model = untie_embeddings(load_causal_lm(model_path, dtype)).to(self.device).eval()
        self.cache_kwarg = cache_kwarg(self.model)
        # Prefill computes the last position's logits only, unless a request wants the prompt's.
        self.keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.routers = moe_routers(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        eos = self.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.max_snapshots = max_snapshots
        base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.weight_sets: OrderedDict[str, tuple[dict[str, torch.Tensor], int]] = OrderedDict()
        self.weight_sets[BASE_KEY] = (base, 0)
        self.evicted: set[str] = set()
        self.serves_adapters = False  # merged weights only
        self.sync_history: list = []  # keeps no records of weight updates
        self.loaded_key = BASE_KEY
        self.lock = threading.RLock()  # the model and the weight sets
        self.batch_history: deque[int] = deque(maxlen=1024)  # requests per batch, newest last
        self.admit_mid_batch = admit_mid_batch
        self.joined_requests = 0  # requests admitted into a batch already running
        self.failed_requests = 0  # requests that ended in an error (checks, weights, generation)
        self._queue: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._waiting: list[_Queued] = []  # taken off the queue by the worker, not yet running
        self._lock_waiters = 0  # callers other than the worker waiting for `lock`
        self._worker: threading.Thread | None = None
        self._worker_lock = threading.Lock()
        self._closed = False

    # -- weights ---------------------------------------------------------------------------------

    def set_weights(self, key: str, weights: dict[str, np.ndarray], version: int) -> None:
        # per-expert checkpoint names (a megatron trainer's export) → this model's fused experts
        weights = fuse_experts(weights)
        tensors = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in weights.items()}
        expected = set(self.weight_sets[BASE_KEY][0])
        if set(tensors) != expected:
            extra, missing = set(tensors) - expected, expected - set(tensors)
            raise RequestError(
                f"weights for {key!r} do not match the sampler's model: "
                f"unexpected {sorted(extra)[:3]}, missing {sorted(missing)[:3]}"
            )
        with self._exclusive():
            held = self.weight_sets.get(key)
            if held is not None and held[1] > version:
                return  # a newer version got here first (updates may race without the actor lock)
            self.weight_sets[key] = (tensors, version)
            self.weight_sets.move_to_end(key)
            self.evicted.discard(key)
            if self.loaded_key == key:
                self.loaded_key = ""  # force a reload on next use
            self._evict()

    def _evict(self) -> None:
        snapshots = [k for k in self.weight_sets if k.startswith("snapshot:")]
        while len(snapshots) > self.max_snapshots:
            oldest = snapshots.pop(0)
            del self.weight_sets[oldest]
            self.evicted.add(oldest)

    def drop_weights(self, key: str) -> None:
        if key != BASE_KEY:
            with self._exclusive():
                self.weight_sets.pop(key, None)

    def has_weights(self, key: str) -> bool:
        return key in self.weight_sets

    def version(self, key: str) -> int:
        """The version of weight set `key` (without loading it)."""
        return self.weight_sets[key][1]

    def _use(self, key: str) -> int:
        """Load weight set `key` into the model (the caller holds `lock`); its version."""
        if key not in self.weight_sets:
            if key in self.evicted:
                raise RequestError(
                    f"sampler weights {key!r} were evicted to keep at most "
                    f"{self.max_snapshots} snapshots in memory; raise local.max_snapshots or "
                    "sample from a saved path (save_weights_for_sampler)"
                )
            raise RequestError(f"sampler has no weights named {key!r}")
        tensors, version = self.weight_sets[key]
        if self.loaded_key != key:
            self.model.load_state_dict(tensors, strict=True)
            self.loaded_key = key
        return version

    # -- requests --------------------------------------------------------------------------------

    def sample(self, key: str, request: SampleRequest) -> SampleOutput:
        """One request at once on the calling thread (a batch of one)."""
        try:
            self._check(request)
            return self._sample_batch(key, [request])[0]
        except Exception:
            self.failed_requests += 1
            raise

    def submit_sample(self, key: str, request: SampleRequest) -> "Future[SampleOutput]":
        """Queue `request` for the batching worker; a future of its output (or its error)."""
        if self._closed:
            raise BackendError("the torch sampler engine is closed")
        future: Future[SampleOutput] = Future()
        try:
            self._check(request)
        except RequestError as error:
            self.failed_requests += 1
            future.set_exception(error)
            return future
        self._queue.put(_Queued(key, request, future))
        with self._worker_lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(
                    target=self._serve, name="torch-sampler-batcher", daemon=True
                )
                self._worker.start()
        return future

    def close(self) -> None:
        """Stop the worker (bounded wait); requests still queued fail with a BackendError."""
        self._closed = True
        self._queue.put(None)
        worker = self._worker
        if worker is not None:
            worker.join(timeout=CLOSE_TIMEOUT_S)
        self._fail_queued()

    def _check(self, request: SampleRequest) -> None:
        """What would break a whole batch, refused for this request alone."""
        prompt = request.prompt
        if prompt.ndim != 1 or prompt.shape[0] < 1:
            raise RequestError(f"prompt: must be a non-empty 1-D array, got shape {prompt.shape}")
        low, high = int(prompt.min()), int(prompt.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise RequestError(
                f"prompt: token id {bad} is outside the model's vocabulary [0, {self.vocab_size})"
            )
        if request.num_samples < 1 or request.max_tokens < 1:
            raise RequestError(
                f"num_samples and max_tokens: must be >= 1, got {request.num_samples} and "
                f"{request.max_tokens}"
            )
        if not request.temperature >= 0 or not 0 < request.top_p <= 1:  # NaN fails too
            raise RequestError(
                f"sampling_params: temperature must be >= 0 and top_p in (0, 1], got "
                f"{request.temperature} and {request.top_p}"
            )

    # -- the batching worker ---------------------------------------------------------------------

    def _serve(self) -> None:
        waiting = self._waiting
        while not self._closed:
            if not waiting:
                try:
                    item = self._queue.get(timeout=IDLE_POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    break
                waiting.append(item)
                self._gather(waiting, GATHER_S)
            else:
                self._gather(waiting, 0.0)  # whatever arrived while the last batch ran
            batch = self._take_batch(waiting)
            try:
                self._run_batch(batch)
            except Exception as error:  # a bug here must not strand the callers
                for item in batch:
                    if not item.future.done():
                        self._fail(item.future, error)
        for item in waiting:
            self._fail(item.future, BackendError("the torch sampler engine is closed"))
        self._fail_queued()

    def _gather(self, waiting: list[_Queued], window_s: float) -> None:
        """Move queued requests into `waiting` until a batch is full or none arrives within
        `window_s` of the last (0: only what is queued now), `MAX_GATHER_S` at most in all."""
        cap = time.monotonic() + MAX_GATHER_S
        while sum(i.request.num_samples for i in waiting) < MAX_BATCH_ROWS:
            timeout = min(window_s, cap - time.monotonic())
            try:
                item = self._queue.get(timeout=max(0.0, timeout))
            except queue.Empty:
                return
            if item is None:
                self._closed = True
                return
            waiting.append(item)

    @staticmethod
    def _take_batch(waiting: list[_Queued]) -> list[_Queued]:
        """The oldest request and those after it on the same weight set that fit in one batch,
        removed from `waiting` (the rest wait for the next batch, order kept)."""
        key = waiting[0].key
        batch: list[_Queued] = []
        rows = width = 0
        for item in list(waiting):
            if item.key != key:
                continue
            n, p = item.request.num_samples, len(item.request.prompt)
            fits = rows + n <= MAX_BATCH_ROWS
            fits = fits and (len(batch) + 1) * max(width, p) <= MAX_BATCH_PROMPT_TOKENS
            if batch and not fits:
                break
            batch.append(item)
            waiting.remove(item)
            rows, width = rows + n, max(width, p)
        return batch

    def _run_batch(self, items: list[_Queued]) -> None:
        """Run `items` as one batch, admitting more requests of the same weight set between
        decode steps (`_joiners`); settle each future as its request finishes. Cancelled
        requests are skipped."""
        items = [i for i in items if i.future.set_running_or_notify_cancel()]
        if not items:
            return
        key = items[0].key
        try:
            with self.lock, self._recording() as recorder:
                generation = Generation(self, self._use(key), recorder)
                generation.admit([i.request for i in items])
                while generation.rows:
                    generation.step()
                    for j, output in generation.take_finished():
                        items[j].future.set_result(output)
                    joiners = self._joiners(key, generation) if generation.rows else []
                    if joiners:
                        items += joiners
                        self.joined_requests += len(joiners)
                        generation.admit([i.request for i in joiners])
        except Exception as error:
            self.batch_history.append(len(items))
            unsettled = [i for i in items if not i.future.done()]
            if len(items) == 1:
                self._fail(items[0].future, error)
                return
            for item in unsettled:  # request by request: only the request that fails gets the error
                try:
                    output = self._sample_batch(key, [item.request])[0]
                except Exception as alone:
                    self._fail(item.future, alone)
                else:
                    item.future.set_result(output)
        else:
            self.batch_history.append(len(items))

    def _joiners(self, key: str, generation: Generation) -> list[_Queued]:
        """Waiting requests that join the running batch now: those at the head of the queue on
        the same weight set (none when a request of another set is first in line, or while another
        caller waits for the model: a weight update), as many as fit the batch's rows and its
        joined cache; cancelled ones are dropped."""
        if not self.admit_mid_batch or self._lock_waiters or self._closed:
            return []
        if not joinable(generation.cache):
            return []
        self._gather(self._waiting, 0.0)
        rows, length = generation.rows, generation.length
        joiners: list[_Queued] = []
        width = 0
        while self._waiting and self._waiting[0].key == key:
            request = self._waiting[0].request
            n, p = request.num_samples, len(request.prompt)
            fits = rows + n <= MAX_BATCH_ROWS
            fits = fits and (len(joiners) + 1) * max(width, p) <= MAX_BATCH_PROMPT_TOKENS
            fits = fits and (rows + n) * max(length, width, p) <= MAX_BATCH_CACHE_TOKENS
            if not fits:
                break
            item = self._waiting.pop(0)
            if item.future.set_running_or_notify_cancel():
                joiners.append(item)
                rows, width = rows + n, max(width, p)
        return joiners

    def _fail(self, future: Future, error: BaseException) -> None:
        """Settle `future` with `error` (unless its caller cancelled it while it was queued)."""
        self.failed_requests += 1
        if future.running() or future.set_running_or_notify_cancel():
            future.set_exception(error)

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._fail(item.future, BackendError("the torch sampler engine is closed"))

    def _sample_batch(self, key: str, requests: list[SampleRequest]) -> list[SampleOutput]:
        """`requests` as one batch on the calling thread, no one admitted on the way."""
        with self._exclusive(), self._recording() as recorder:
            generation = Generation(self, self._use(key), recorder)
            outputs = run_to_end(generation, requests)
            self.batch_history.append(len(requests))
            return outputs

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The model lock for a caller other than the batching worker: counted while it waits,
        so a running batch admits no one more and ends (weights land between batches)."""
        with self._worker_lock:
            self._lock_waiters += 1
        try:
            with self.lock:
                yield
        finally:
            with self._worker_lock:
                self._lock_waiters -= 1

    def _recording(self) -> contextlib.AbstractContextManager[RouterRecorder | None]:
        return RouterRecorder(self.routers) if self.routers else contextlib.nullcontext()

    # -- generation (engines.torch.generation) ---------------------------------------------------

    def _stops(self, token: int, generated: list[int], request: SampleRequest) -> bool:
        if token in request.stop_token_ids:
            return True
        if request.stop_strings:
            # A window of tokens wide enough for the longest stop string (a byte-level token can
            # decode to less than one character); the string must be completed by this token.
            window = 4 * max(len(s) for s in request.stop_strings) + 8
            now = self.tokenizer.decode(generated[-window:])
            before = self.tokenizer.decode(generated[-window:-1])
            return any(s in now and s not in before for s in request.stop_strings)
        return False

    @staticmethod
    def _draw(
        logits: torch.Tensor, request: SampleRequest, generators: list[torch.Generator]
    ) -> torch.Tensor:
        logits = logits.float()
        if request.temperature == 0.0:
            return logits.argmax(dim=-1)
        scaled = logits / request.temperature
        if request.top_k > 0:
            kth = torch.topk(scaled, min(request.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if request.top_p < 1.0:
            sorted_logits, order = torch.sort(scaled, descending=True, dim=-1)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= request.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
        probs = torch.softmax(scaled, dim=-1)
        rows = [
            torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)
        ]
        return torch.cat(rows)

    def _generator(self, seed: int, row: int) -> torch.Generator:
        """Row `row`'s own stream: a request's i-th sample does not depend on num_samples."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed((seed * 1_000_003 + row) % (2**63))
        return generator

    def _prompt_logprobs_from(self, logits: torch.Tensor, prompt: torch.Tensor) -> np.ndarray:
        scored = token_logprobs(logits[:-1], prompt[1:]).cpu().numpy().astype(np.float32)
        return np.concatenate([np.array([np.nan], np.float32), scored])

    @torch.no_grad()
    def prompt_logprobs(self, key: str, tokens: np.ndarray) -> np.ndarray:
        with self._exclusive():
            self._use(key)
            prompt = torch.from_numpy(tokens.astype(np.int64)).to(self.device)
            logits = self.model(input_ids=prompt[None, :]).logits[0]
        return self._prompt_logprobs_from(logits, prompt)
