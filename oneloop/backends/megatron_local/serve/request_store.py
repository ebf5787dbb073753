"""The server's request store: futures of the Tinker wire protocol by request id, long polling,
and per-model ordering (the client-side futures of the local backend are
`megatron_local/futures.py`).

Protocol facts (tinker 0.38, `lib/api_future_impl.py`, `lib/public_interfaces/training_client.py`):
- Every mutating route answers at once with an `UntypedAPIFuture` `{request_id, model_id?,
  sample_sequence_ids?}`; the SDK then polls `POST /retrieve_future {request_id,
  allow_metadata_only}` with a 45 s client timeout and no HTTP retries of its own. A 408 (body
  `TryAgainResponse`) makes it poll again at once; 410 makes it resend the original request;
  5xx are retried; any other 4xx is fatal for that future. A finished request answers 200 with
  the result (protobuf for Sample/ForwardBackward, JSON otherwise) or a JSON
  `{"error", "category"}` (category `user` | `server` | `unknown`), which the SDK raises as
  `RequestFailedError`.
- Training requests carry `seq_id = request_id + 1` per training client (so 1, 2, 3, ...), and a
  `forward_backward` of more than `fwdbwd_max_chunk_len` (1024) datums is sent as several chunks
  with consecutive seq_ids *in parallel, first chunk last*: the server must acknowledge chunk k
  before k-1 has arrived and execute in seq_id order. The SDK retries a POST whose answer was
  lost, with the same seq_id: that must return the original future, not run twice.
- Sampling requests carry a per-sampling-client `seq_id` (0, 1, ...) used only for idempotency.

`FutureStore` keeps one entry per request id until it is delivered (then `delivered_ttl_s`) or
forgotten (`result_ttl_s` after completion, after which polls get 410). `ModelSequencer`
admits each model's requests by seq_id and submits them to the backend strictly in order, one
at a time, so request k is submitted only after k-1 was. `SeenIds` remembers which payload
(sha256) used which seq_id: a repeat returns the original request id, a different payload is a
409 that tells the SDK not to retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tinker import APIFuture, types

from oneloop.errors import RequestError, WireError

logger = logging.getLogger(__name__)

# How far ahead of the next expected seq_id a request may be (chunks of one call are adjacent).
MAX_SEQ_AHEAD = 1 << 16


@dataclass(frozen=True)
class Outcome:
    """A finished request as `/retrieve_future` sends it."""

    body: bytes
    content_type: str
    failed: bool = False


@dataclass
class _Entry:
    request_type: str
    created: float
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    completed: float | None = None
    delivered: float | None = None
    task: asyncio.Task[None] | None = None


def classify_error(error: BaseException) -> tuple[str, types.RequestErrorCategory]:
    """The message and category a failed request reports; never a traceback."""
    if isinstance(error, WireError | RequestError | ValueError):
        return f"{type(error).__name__}: {error}", types.RequestErrorCategory.User
    if isinstance(error, TimeoutError):
        return f"timed out: {error}", types.RequestErrorCategory.Server
    if isinstance(error, asyncio.CancelledError):
        return "cancelled", types.RequestErrorCategory.Server
    return f"{type(error).__name__}: {error}", types.RequestErrorCategory.Server


async def await_backend(value: Any, timeout_s: float) -> Any:
    """The result of what a backend method returned: an `APIFuture`, an awaitable or a value."""
    async with asyncio.timeout(timeout_s):
        if isinstance(value, APIFuture):
            return await asyncio.wrap_future(value.future())
        if isinstance(value, Awaitable):
            return await value
        return value


class FutureStore:
    """Request id -> state of one asynchronous request. Use from one event loop only."""

    def __init__(
        self,
        *,
        result_ttl_s: float = 3600.0,
        delivered_ttl_s: float = 60.0,
        failure_body: Callable[[str, types.RequestErrorCategory], bytes],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._entries: dict[str, _Entry] = {}
        self._forgotten: OrderedDict[str, float] = OrderedDict()
        self._result_ttl_s = result_ttl_s
        self._delivered_ttl_s = delivered_ttl_s
        self._failure_body = failure_body
        self._clock = clock

    def new(self, request_type: str) -> str:
        request_id = f"req-{uuid.uuid4().hex}"
        self._entries[request_id] = _Entry(request_type=request_type, created=self._clock())
        return request_id

    def pending(self, request_id: str) -> bool:
        """Whether the request is known and has no outcome yet (still queued or running)."""
        entry = self._entries.get(request_id)
        return entry is not None and entry.outcome is None

    def discard(self, request_id: str) -> None:
        """Forget a request that was never acknowledged to the client."""
        self._entries.pop(request_id, None)

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        entry = self._entries.get(request_id)
        if entry is None or entry.outcome is not None:
            return
        entry.outcome, entry.completed = outcome, self._clock()
        entry.done.set()

    def fail(self, request_id: str, error: BaseException) -> None:
        message, category = classify_error(error)
        body = self._failure_body(message, category)
        self.resolve(request_id, Outcome(body, "application/json", failed=True))

    def start(
        self,
        request_id: str,
        work: Awaitable[Any],
        encode: Callable[[Any], Outcome],
    ) -> None:
        """Run `work` in a named task and store `encode(result)` (or the failure)."""
        entry = self._entries[request_id]

        async def run() -> None:
            try:
                result = await work
                outcome = encode(result)
            except asyncio.CancelledError as e:
                self.fail(request_id, e)
                raise
            except Exception as e:  # every failure becomes the future's error
                if not isinstance(e, WireError | RequestError | ValueError):
                    logger.warning("request %s (%s) failed: %s: %s", request_id,
                                   entry.request_type, type(e).__name__, e)
                self.fail(request_id, e)
            else:
                self.resolve(request_id, outcome)

        entry.task = asyncio.create_task(run(), name=f"serve:{entry.request_type}:{request_id}")

    async def wait(self, request_id: str, timeout_s: float) -> Outcome | None:
        """The outcome, or None if still running after `timeout_s` (the caller answers 408)."""
        entry = self._entries.get(request_id)
        if entry is None:
            if request_id in self._forgotten:
                raise WireError(f"request_id: {request_id} expired; resend the request", 410)
            raise WireError(f"request_id: unknown request {request_id!r}", 404)
        if entry.outcome is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await entry.done.wait()
        if entry.outcome is not None and entry.delivered is None:
            entry.delivered = self._clock()
        return entry.outcome

    def cancel(self, request_id: str) -> bool:
        entry = self._entries.get(request_id)
        if entry is None or entry.outcome is not None or entry.task is None:
            return False
        entry.task.cancel()
        return True

    def sweep(self) -> int:
        """Forget delivered and expired results; returns how many entries went."""
        now = self._clock()
        gone = [
            rid
            for rid, e in self._entries.items()
            if e.completed is not None
            and (
                (e.delivered is not None and now - e.delivered >= self._delivered_ttl_s)
                or now - e.completed >= self._result_ttl_s
            )
        ]
        for rid in gone:
            del self._entries[rid]
            self._forgotten[rid] = now
        while self._forgotten and now - next(iter(self._forgotten.values())) > self._result_ttl_s:
            self._forgotten.popitem(last=False)
        return len(gone)

    def stats(self) -> dict[str, int]:
        """Counts by state, and the number of request tasks still running."""
        pending = sum(1 for e in self._entries.values() if e.outcome is None)
        delivered = sum(1 for e in self._entries.values() if e.delivered is not None)
        running = sum(1 for e in self._entries.values() if e.task and not e.task.done())
        return {
            "pending": pending,
            "undelivered": len(self._entries) - pending - delivered,
            "delivered": delivered,
            "running_tasks": running,
        }

    async def close(self, timeout_s: float) -> None:
        """Cancel every running request task and wait (bounded) for them to end."""
        tasks = [e.task for e in self._entries.values() if e.task and not e.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)


def digest(*parts: bytes | str) -> str:
    """A stable fingerprint of a request payload, to tell a retry from a conflicting reuse."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\x00")
    return h.hexdigest()


class SeenIds:
    """seq_id -> (payload digest, value), remembering the last `capacity` ids. The value is what
    a retry of the same request must get back (a request id, or an acknowledgement)."""

    def __init__(self, scope: str, capacity: int = 65536) -> None:
        self._scope = scope
        self._seen: OrderedDict[int, tuple[str, Any]] = OrderedDict()
        self._capacity = capacity

    def lookup(self, seq_id: int, payload_digest: str) -> Any | None:
        """The stored value for a retry; None for a new seq_id; 409 for a reuse."""
        seen = self._seen.get(seq_id)
        if seen is None:
            return None
        if seen[0] != payload_digest:
            raise WireError(
                f"seq_id: {seq_id} of {self._scope} was already used by a different request",
                409,
                retry=False,
            )
        return seen[1]

    def add(self, seq_id: int, payload_digest: str, value: Any) -> None:
        self._seen[seq_id] = (payload_digest, value)
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)

    def remove(self, seq_id: int) -> None:
        self._seen.pop(seq_id, None)


@dataclass
class Job:
    """One ordered request: `submit(client)` calls the backend (in a worker thread) and returns
    an `APIFuture`, awaitable or value; `encode(result)` turns the result into an `Outcome`."""

    request_id: str
    submit: Callable[[Any], Any]
    encode: Callable[[Any], Outcome]


class ModelSequencer:
    """Admits one training model's requests by seq_id and submits them to it in order."""

    def __init__(
        self,
        model_id: str,
        store: FutureStore,
        client: asyncio.Future[Any],
        *,
        first_seq_id: int = 1,
        submit_timeout_s: float,
        result_timeout_s: float,
    ) -> None:
        self.model_id = model_id
        self._store = store
        self._client = client
        self._next = first_seq_id
        self._seen = SeenIds(f"model {model_id}")
        self._waiting: dict[int, tuple[Job, float]] = {}
        self._ready: asyncio.Queue[Job] = asyncio.Queue()
        self._submit_timeout_s = submit_timeout_s
        self._result_timeout_s = result_timeout_s
        self._worker: asyncio.Task[None] | None = None
        self.early_arrivals = 0
        """Requests admitted before their predecessor (parallel chunks do this by design)."""

    def offer(
        self, seq_id: int, payload_digest: str, request_type: str, make_job: Callable[[str], Job]
    ) -> str:
        """Admit request `seq_id`; returns its request id (the original one for a retry)."""
        original = self._seen.lookup(seq_id, payload_digest)
        if original is not None:
            return original
        if seq_id < self._next:
            raise WireError(
                f"seq_id: {seq_id} of model {self.model_id} is already used (next is {self._next})",
                409,
                retry=False,
            )
        if seq_id >= self._next + MAX_SEQ_AHEAD:
            raise WireError(f"seq_id: {seq_id} is too far ahead of the next ({self._next})")
        job = make_job(self._store.new(request_type))
        self.early_arrivals += seq_id > self._next
        self._seen.add(seq_id, payload_digest, job.request_id)
        self._waiting[seq_id] = (job, time.monotonic())
        while self._next in self._waiting:
            self._ready.put_nowait(self._waiting.pop(self._next)[0])
            self._next += 1
        if self._worker is None:
            self._worker = asyncio.create_task(self._run(), name=f"serve:model:{self.model_id}")
        return job.request_id

    def fail_stale_gaps(self, max_wait_s: float) -> int:
        """Fail requests whose predecessor has not arrived for `max_wait_s` (a client died)."""
        now = time.monotonic()
        stale = [s for s, (_, t) in self._waiting.items() if now - t >= max_wait_s]
        for seq_id in stale:
            job, _ = self._waiting.pop(seq_id)
            self._store.fail(
                job.request_id,
                TimeoutError(f"seq_id {self._next} of model {self.model_id} never arrived"),
            )
        return len(stale)

    async def _run(self) -> None:
        try:
            async with asyncio.timeout(self._result_timeout_s):
                client = await asyncio.shield(self._client)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            client, error = None, e
        else:
            error = None
        while True:
            job = await self._ready.get()
            if client is None:
                message = f"model {self.model_id} could not be created: {error}"
                self._store.fail(job.request_id, RuntimeError(message))
                continue
            try:
                async with asyncio.timeout(self._submit_timeout_s):
                    submitted = await asyncio.to_thread(job.submit, client)
            except Exception as e:
                self._store.fail(job.request_id, e)
                continue
            self._store.start(
                job.request_id, await_backend(submitted, self._result_timeout_s), job.encode
            )

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._worker, timeout=5.0)
