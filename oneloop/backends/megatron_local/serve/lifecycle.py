"""When `oneloop serve` frees a training model's trainer, and the cap on live trainers.

Every training model holds one trainer (a Ray actor with the model, its gradients and optimizer
state: ~0.85 GB on the tiny model). `TrainerReleaser` releases it, through the backend's
`release_training_client(run_id)`, when
- its session finishes (`ServiceClient.close`, the SDK's `sessions/{id}/finish`),
- its session expires: no heartbeat for `session_expiry_s` (the SDK beats every 10 s, so a
  client that died without closing is noticed),
- it is unloaded (`/api/v1/unload_model`),
- it sat idle for `trainer_idle_s`: no request admitted or running since then, counted from
  when the trainer was ready (off by default: an idle release loses unsaved training state).
The model's slot stays, marked with the reason, so its later requests get a 410 naming it.

`max_live_trainers` caps the models holding a trainer: one more is refused with a 403 naming the
cap and how to raise it, before any actor starts. Not a 429: the SDK's retry handler (its
create-from-state path) retries a 429 for minutes whatever `x-should-retry` says, so a client
over the cap waited in silence; no SDK path retries a 403 (a quota refusal, as cloud APIs answer).

A backend without `release_training_client` (the `tinker` relay, whose trainers the remote
service owns) gets its slots marked and counted all the same; nothing local is stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from oneloop.backends.megatron_local.serve.state import ModelSlot, Registry
from oneloop.errors import WireError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LifecycleLimits:
    """Bounds on live trainers (see the module docstring)."""

    max_live_trainers: int | None = 8
    """Most training models holding a trainer at once; None = no cap."""
    trainer_idle_s: float | None = None
    """Release a trainer after this many seconds without a request; None = never."""
    session_expiry_s: float | None = 180.0
    """Finish a session (and release its trainers) after this many seconds without a heartbeat;
    None = never."""
    release_timeout_s: float = 60.0
    """Longest one release may take (waiting for a trainer still starting, then stopping it)."""

    def sweep_interval_s(self, default_s: float) -> float:
        """How often the sweeper should run so the bounds are met within a quarter of themselves
        (never more often than every 0.25 s)."""
        bounds = [b / 4 for b in (self.trainer_idle_s, self.session_expiry_s) if b is not None]
        return max(0.25, min([default_s, *bounds]))


class TrainerReleaser:
    """Releases trainers of one server's models; use from its event loop only."""

    def __init__(self, backend: Any, registry: Registry, limits: LifecycleLimits, *,
                 pending: Callable[[str], bool]) -> None:
        self.limits = limits
        self._registry = registry
        self._pending = pending  # whether a request id is still queued or running
        release = getattr(backend, "release_training_client", None)  # absent on the relay
        self._release_backend = release
        self._tasks: set[asyncio.Task[None]] = set()
        self.released = 0
        """Trainers stopped so far."""
        self.release_failures = 0
        """Releases that failed or timed out (logged; the slot stays released)."""

    def check_capacity(self, what: str) -> None:
        """403 if one more training model would exceed `max_live_trainers`."""
        cap = self.limits.max_live_trainers
        live = len(self._registry.live_models())
        if cap is not None and live >= cap:
            raise WireError(
                f"{what}: {live} training models hold a trainer, the cap of this server "
                f"(max_live_trainers={cap}); close a ServiceClient (ends its session) or unload a "
                f"model to free one, or restart `oneloop serve` with --max-live-trainers N",
                403, retry=False,
            )

    def release(self, slot: ModelSlot, reason: str) -> None:
        """Mark `slot` released for `reason` and stop its trainer in the background."""
        if slot.released is not None:
            return
        slot.released = reason
        task = asyncio.create_task(self._release(slot), name=f"serve:release:{slot.model_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def release_session(self, session_id: str, reason: str) -> None:
        for slot in self._registry.models_of(session_id):
            self.release(slot, reason)

    async def wait_released(self, slot: ModelSlot) -> None:
        """Until `slot`'s release (started by `release`) has ended."""
        tasks = [t for t in self._tasks if t.get_name() == f"serve:release:{slot.model_id}"]
        if tasks:
            await asyncio.wait(tasks, timeout=self.limits.release_timeout_s)

    async def _release(self, slot: ModelSlot) -> None:
        try:
            async with asyncio.timeout(self.limits.release_timeout_s):
                try:
                    client = await asyncio.shield(slot.client)  # a trainer may still be starting
                except Exception:
                    return  # creation failed: no trainer to stop
                if self._release_backend is not None:
                    await asyncio.to_thread(self._release_backend, client.run_id)
                    self.released += 1
        except Exception as error:  # counted and logged: the sweeper must go on
            self.release_failures += 1
            logger.warning("releasing the trainer of %s (%s) failed: %s: %s", slot.model_id,
                           slot.released, type(error).__name__, error)

    def sweep(self) -> None:
        """Finish expired sessions and release idle trainers (called by the server's sweeper)."""
        expiry = self.limits.session_expiry_s
        if expiry is not None:
            for session in self._registry.expired_sessions(time.monotonic(), expiry):
                session.finished = "expired"
                session.detail = f"no heartbeat for {expiry:g} s (session_expiry_s)"
                self.release_session(session.session_id, f"session {session.session_id} expired")
        now = time.time()
        for slot in self._registry.models.values():
            slot.requests = [r for r in slot.requests if self._pending(r)]
            if slot.requests:  # a request still queued or running is activity
                slot.last_request = now
        idle = self.limits.trainer_idle_s
        if idle is not None:
            for slot in self._registry.idle_models(now, idle):
                self.release(slot, f"idle for over {idle:g} s (trainer_idle_s)")

    async def close(self, timeout_s: float) -> None:
        """Wait (bounded) for releases under way."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
