"""Checkpoints of the local backend: `tinker://<run>/<weights|sampler_weights>/<name>` paths, where
they live under the run directory, and the metadata file that marks each one complete.

Every path component (run id, kind, name) must match a conservative pattern, so no path can reach
outside `run_dir` (no `..`, no separators, no absolute parts). A checkpoint directory holds the
engine's files and `meta.json` (`CheckpointMeta`), written last and atomically: a directory without
it is an unfinished save and does not exist as far as any reader is concerned.

A save writes into a staging directory beside its target, `.<name>.partial` (no valid name starts
with '.'), and moves it into place whole (`staged`). A process killed mid-save (the OOM killer, a
lost node) leaves only the staging directory, with the writer's host and pid in `owner.json`: the
next save of that name replaces it, and `sweep_partials` removes the ones whose writer is dead
when a local backend starts on the run directory. At 35B+ scale one is tens of GB.
"""

import contextlib
import json
import os
import re
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from oneloop.backends.megatron_local.engines.base import LoraSpec
from oneloop.errors import CheckpointNotFoundError, RequestError

SCHEME = "tinker://"
_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
CheckpointKind = Literal["weights", "sampler_weights"]
KINDS: tuple[CheckpointKind, ...] = ("weights", "sampler_weights")
META_FILE = "meta.json"
PARTIAL = ".partial"
OWNER_FILE = "owner.json"


def check_component(value: str, what: str) -> str:
    """`value` if it is a safe single path component, else a RequestError naming `what`."""
    if not _COMPONENT.match(value) or ".." in value:
        raise RequestError(
            f"{what} {value!r} is not a valid name: use letters, digits, '.', '_', ':' or '-' "
            "(at most 128 characters, no '..')"
        )
    return value


@dataclass(frozen=True)
class TinkerPath:
    """A parsed checkpoint path."""

    run_id: str
    kind: CheckpointKind
    name: str

    @classmethod
    def parse(cls, path: str) -> "TinkerPath":
        if not isinstance(path, str) or not path.startswith(SCHEME):
            raise RequestError(
                f"checkpoint path {path!r} must look like tinker://<run>/weights/<name> or "
                "tinker://<run>/sampler_weights/<name>"
            )
        parts = path[len(SCHEME) :].split("/")
        if len(parts) != 3 or parts[1] not in KINDS:
            raise RequestError(
                f"checkpoint path {path!r} must look like tinker://<run>/weights/<name> or "
                "tinker://<run>/sampler_weights/<name>"
            )
        run_id, kind, name = parts
        check_component(run_id, "run id")
        check_component(name, "checkpoint name")
        return cls(run_id=run_id, kind=kind, name=name)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.kind}/{self.name}"

    def directory(self, run_dir: Path) -> Path:
        """Where this checkpoint lives; guaranteed to be inside `run_dir`."""
        root = run_dir.resolve()
        target = (root / self.run_id / self.kind / self.name).resolve()
        if root not in target.parents:
            raise RequestError(f"checkpoint path {self} resolves outside the run directory")
        return target

    def existing_directory(self, run_dir: Path) -> Path:
        """The checkpoint's directory, or CheckpointNotFoundError if nothing was saved there."""
        target = self.directory(run_dir)
        if not (target / META_FILE).is_file():
            raise CheckpointNotFoundError(f"no checkpoint saved at {self} (looked in {target})")
        return target


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint directory's `meta.json` records; one JSON object with these keys.

    Written by the trainer actor (`save_state`, `save_sampler_weights`) after the engine's files;
    read to restore a training client, to load sampler weights, and by `oneloop serve` to list
    checkpoints. `user_metadata` is written for training-state checkpoints only (`None` leaves
    the key out, as sampler checkpoints always have).
    """

    kind: CheckpointKind
    """`weights` (training state) or `sampler_weights`."""
    name: str
    """The checkpoint's name, the last component of its path."""
    run_id: str
    """The training run that saved it (`run-<hex>`)."""
    base_model: str
    """The base-model name the run was created with."""
    model_dir: str
    """The base model's local Hugging Face directory."""
    lora_rank: int
    """LoRA rank of the run; 0 = full fine-tuning."""
    train_mlp: bool
    """Whether the run trains the MLP blocks (LoRA targets)."""
    train_attn: bool
    """Whether the run trains the attention blocks (LoRA targets)."""
    train_unembed: bool
    """Whether the run trains the unembedding (LoRA targets)."""
    sync_version: int
    """The trainer's weight version at the save (set by the trainer actor when it writes)."""
    user_metadata: dict[str, str] | None = None
    """The caller's `user_metadata` (training-state checkpoints)."""

    @property
    def lora(self) -> LoraSpec:
        """The run's LoRA settings (no seed: the weights come from the checkpoint)."""
        return LoraSpec(self.lora_rank, None, self.train_mlp, self.train_attn, self.train_unembed)

    def with_version(self, sync_version: int) -> "CheckpointMeta":
        return replace(self, sync_version=sync_version)

    def to_json(self) -> dict[str, Any]:
        out = {
            "kind": self.kind,
            "name": self.name,
            "run_id": self.run_id,
            "base_model": self.base_model,
            "model_dir": self.model_dir,
            "lora_rank": self.lora_rank,
            "train_mlp": self.train_mlp,
            "train_attn": self.train_attn,
            "train_unembed": self.train_unembed,
            "sync_version": self.sync_version,
        }
        if self.user_metadata is not None:
            out["user_metadata"] = self.user_metadata
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CheckpointMeta":
        return cls(
            kind=data["kind"],
            name=data["name"],
            run_id=data["run_id"],
            base_model=data["base_model"],
            model_dir=data["model_dir"],
            lora_rank=int(data["lora_rank"] or 0),
            train_mlp=bool(data["train_mlp"]),
            train_attn=bool(data["train_attn"]),
            train_unembed=bool(data["train_unembed"]),
            sync_version=int(data["sync_version"]),
            user_metadata=data.get("user_metadata"),
        )

    def write(self, directory: Path) -> None:
        """Write `meta.json` last, atomically: its presence marks a complete checkpoint."""
        tmp = directory / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))
        tmp.replace(directory / META_FILE)

    @classmethod
    def read(cls, directory: Path) -> "CheckpointMeta":
        """The meta of the checkpoint in `directory` (which must hold one)."""
        return cls.from_json(json.loads((directory / META_FILE).read_text()))


def staging_directory(directory: Path) -> Path:
    """Where a save into `directory` writes until it is complete."""
    return directory.with_name(f".{directory.name}{PARTIAL}")


@contextlib.contextmanager
def staged(directory: Path) -> Iterator[Path]:
    """Yield an empty staging directory for a save into `directory`; once the body returns, it
    replaces `directory` whole (an earlier checkpoint of that name included: overwrite). A body
    that raises leaves nothing behind; a process killed inside it leaves the staging directory,
    its owner recorded for `sweep_partials`."""
    staging = staging_directory(directory)
    if staging.exists():  # an earlier save of this name was killed
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    owner = {"host": socket.gethostname(), "pid": os.getpid()}
    (staging / OWNER_FILE).write_text(json.dumps(owner))
    try:
        yield staging
        (staging / OWNER_FILE).unlink()
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def sweep_partials(run_dir: Path) -> list[Path]:
    """Remove the staging directories under `run_dir` whose writer was a process of this host
    that is gone (killed mid-save); the ones removed. A live writer's, another host's, or one
    without a readable owner is left alone."""
    removed = []
    for kind in KINDS:
        for staging in sorted(run_dir.glob(f"*/{kind}/.*{PARTIAL}")):
            try:
                owner = json.loads((staging / OWNER_FILE).read_text())
                host, pid = owner["host"], int(owner["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if host != socket.gethostname() or _alive(pid):
                continue
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
