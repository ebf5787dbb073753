"""What `oneloop serve` remembers: sessions, training models, samplers, and saved checkpoints.

Sessions, models and samplers live in memory for the life of the server (the SDK re-creates
them after a restart). A model's trainer is released (its slot stays, marked with why, so a
later request gets a clear 410) when its session finishes or expires, when it is unloaded, or
when it sits idle; `Registry.live_models` counts the ones that still hold a trainer (the cap).

Checkpoints live on disk where the local backend saves them,
`<run_dir>/<run>/<weights|sampler_weights>/<name>/meta.json`, so listing and deleting them
works across restarts; `checkpoints.TinkerPath` guarantees every path stays inside `run_dir`.

Ids: a session is `sess-<hex>`; the SDK derives a training model id `"{session}:train:{n}"`
and a sampler id `"{session}:sample:{n}"` itself, so the server keys models and samplers by
those wire ids and maps a model to the backend's run id (`run-<hex>`, the `<run>` of its paths).
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tinker import types

from oneloop.backends.megatron_local.checkpoints import META_FILE, CheckpointMeta, TinkerPath
from oneloop.backends.megatron_local.serve.request_store import ModelSequencer, SeenIds
from oneloop.errors import RequestError, WireError


@dataclass
class Session:
    session_id: str
    sdk_version: str
    user_metadata: dict[str, Any]
    tags: list[str]
    created: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.monotonic)
    finished: str | None = None
    detail: str | None = None


@dataclass
class ModelSlot:
    """One training model: its creation request, its backend client (once ready), its queue."""

    model_id: str
    session_id: str
    creation_digest: str
    creation_request_id: str
    client: asyncio.Future[Any]
    sequencer: ModelSequencer
    base_model: str | None
    user_metadata: dict[str, Any] | None
    last_request: float = field(default_factory=time.time)
    requests: list[str] = field(default_factory=list)
    """Ids of its ordered requests not yet seen finished (pruned by the idle sweep)."""
    released: str | None = None
    """Why the model's trainer was released (session finished, unloaded, idle), None while live."""

    @property
    def backend(self) -> Any | None:
        """The backend training client, or None while it is being created (or if that failed)."""
        ready = self.client.done() and not self.client.cancelled()
        return self.client.result() if ready and self.client.exception() is None else None


@dataclass
class SamplerSlot:
    """One sampling session: its backend sampling client (once ready) and its seen seq_ids."""

    sampler_id: str
    session_id: str
    creation_digest: str
    client: asyncio.Future[Any]
    base_model: str | None
    model_path: str | None
    seen: SeenIds
    fixed_weights: bool = True
    """False for an `inflight` sampler, whose weights may move on while a sample waits; True for
    snapshots, checkpoint paths and base models (every sample runs on the version at creation)."""
    inline_overruns: int = 0
    """Samples submitted on the event loop that overran their budget; at `INLINE_SUBMIT_STRIKES`
    its submits go to a worker thread (`ServeService._submit_to_sampler`)."""


class Registry:
    """Sessions, models and samplers by wire id."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ModelSlot] = {}
        self.samplers: dict[str, SamplerSlot] = {}

    def new_session(self, sdk_version: str, user_metadata: dict[str, Any], tags: list[str]) -> str:
        session_id = f"sess-{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = Session(session_id, sdk_version, user_metadata, tags)
        return session_id

    def session(self, session_id: str, field_name: str = "session_id") -> Session:
        """An active session; 404 if unknown, 400 if it was finished."""
        session = self.sessions.get(session_id)
        if session is None:
            raise WireError(f"{field_name}: unknown session {session_id!r}", 404)
        if session.finished is not None:
            raise WireError(f"{field_name}: session {session_id} is finished ({session.finished})")
        return session

    def model(self, model_id: str) -> ModelSlot:
        slot = self.models.get(model_id)
        if slot is None:
            raise WireError(f"model_id: unknown model {model_id!r}", 404)
        self.session(slot.session_id, "model_id")
        if slot.released is not None:
            raise WireError(
                f"model_id: model {model_id} was released ({slot.released}); create "
                "a training client again (from a saved state to continue)",
                410,
            )
        slot.last_request = time.time()
        return slot

    def live_models(self) -> list[ModelSlot]:
        """Models that hold (or are starting) a trainer: not released, creation not failed."""
        return [
            s
            for s in self.models.values()
            if s.released is None
            and not (s.client.done() and (s.client.cancelled() or s.client.exception() is not None))
        ]

    def models_of(self, session_id: str) -> list[ModelSlot]:
        return [s for s in self.models.values() if s.session_id == session_id]

    def expired_sessions(self, now: float, expiry_s: float) -> list[Session]:
        """Unfinished sessions whose last heartbeat (`time.monotonic`) is over `expiry_s` old."""
        return [
            s
            for s in self.sessions.values()
            if s.finished is None and now - s.last_heartbeat > expiry_s
        ]

    def idle_models(self, now: float, idle_s: float) -> list[ModelSlot]:
        """Live, ready models whose last request (`time.time`) is over `idle_s` old (a trainer
        still starting is never idle)."""
        return [s for s in self.live_models() if s.client.done() and now - s.last_request > idle_s]

    def sampler(self, sampler_id: str) -> SamplerSlot:
        slot = self.samplers.get(sampler_id)
        if slot is None:
            raise WireError(f"sampling_session_id: unknown sampler {sampler_id!r}", 404)
        return slot

    def run_id_of(self, run_or_model_id: str) -> str:
        """The backend run id for a run id or a wire model id."""
        slot = self.models.get(run_or_model_id)
        if slot is not None and slot.backend is not None:
            return str(slot.backend.run_id)
        return run_or_model_id

    def slot_of_run(self, run_id: str) -> ModelSlot | None:
        for slot in self.models.values():
            if slot.backend is not None and slot.backend.run_id == run_id:
                return slot
        return None


def _parse(path: str, field_name: str) -> TinkerPath:
    try:
        return TinkerPath.parse(path)
    except RequestError as e:
        raise WireError(f"{field_name}: {e}") from e


class CheckpointStore:
    """Checkpoints saved by the local backend under `run_dir`."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir.resolve()

    def parse(self, path: str, field_name: str) -> TinkerPath:
        """Validate a `tinker://` path (no traversal, known kind) without touching disk."""
        return _parse(path, field_name)

    def meta(self, path: TinkerPath, field_name: str) -> CheckpointMeta:
        try:
            directory = path.existing_directory(self.run_dir)
        except RequestError as e:
            raise WireError(f"{field_name}: {e}", 404) from e
        return CheckpointMeta.read(directory)

    def weights_info(self, path: str) -> types.WeightsInfoResponse:
        meta = self.meta(self.parse(path, "tinker_path"), "tinker_path")
        rank = meta.lora_rank
        return types.WeightsInfoResponse(
            base_model=meta.base_model,
            is_lora=rank > 0,
            lora_rank=rank or None,
            train_mlp=meta.train_mlp,
            train_attn=meta.train_attn,
            train_unembed=meta.train_unembed,
        )

    def checkpoints(self, run_id: str) -> list[types.Checkpoint]:
        """Every checkpoint of one run, oldest first."""
        out = []
        for kind, ctype in (("weights", "training"), ("sampler_weights", "sampler")):
            base = self.run_dir / run_id / kind
            if not base.is_dir():
                continue
            for directory in base.iterdir():
                meta_file = directory / META_FILE
                if directory.name.startswith(".") or not meta_file.is_file():  # a save staging
                    continue
                meta = CheckpointMeta.read(directory)
                out.append(
                    types.Checkpoint(
                        checkpoint_id=f"{kind}/{directory.name}",
                        checkpoint_type=ctype,  # type: ignore[arg-type]
                        time=datetime.fromtimestamp(meta_file.stat().st_mtime, UTC),
                        tinker_path=f"tinker://{run_id}/{kind}/{directory.name}",
                        size_bytes=sum(
                            f.stat().st_size for f in directory.rglob("*") if f.is_file()
                        ),
                        user_metadata=meta.user_metadata or None,
                    )
                )
        return sorted(out, key=lambda c: c.time)

    def run_ids(self) -> list[str]:
        if not self.run_dir.is_dir():
            return []
        return sorted(p.name for p in self.run_dir.iterdir() if p.is_dir())

    def delete(self, run_id: str, kind: str, name: str) -> None:
        path = _parse(f"tinker://{run_id}/{kind}/{name}", "checkpoint_id")
        try:
            directory = path.existing_directory(self.run_dir)
        except RequestError as e:
            raise WireError(f"checkpoint_id: {e}", 404) from e
        shutil.rmtree(directory)

    def training_run(self, run_id: str, slot: ModelSlot | None) -> types.TrainingRun:
        checkpoints = self.checkpoints(run_id)
        if slot is None and not checkpoints:
            raise WireError(f"training_run_id: unknown training run {run_id!r}", 404)
        meta: CheckpointMeta | None = None
        if checkpoints:
            last = checkpoints[-1]
            meta = self.meta(_parse(last.tinker_path, "training_run_id"), "training_run_id")
        backend = slot.backend if slot is not None else None
        rank = int(backend.lora.rank if backend is not None else meta.lora_rank if meta else 0)
        training = [c for c in checkpoints if c.checkpoint_type == "training"]
        sampler = [c for c in checkpoints if c.checkpoint_type == "sampler"]
        last_time = max(
            [c.time for c in checkpoints]
            + ([datetime.fromtimestamp(slot.last_request, UTC)] if slot else [])
        )
        return types.TrainingRun(
            training_run_id=run_id,
            base_model=str(backend.base_model if backend is not None else meta.base_model),
            model_owner="local",
            is_lora=rank > 0,
            lora_rank=rank or None,
            last_request_time=last_time,
            last_checkpoint=training[-1] if training else None,
            last_sampler_checkpoint=sampler[-1] if sampler else None,
            user_metadata=(slot.user_metadata if slot is not None else None) or None,
        )
