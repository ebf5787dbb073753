"""`tinker://<run>/<weights|sampler_weights>/<name>` paths and where they live under the run dir.

Every component (run id, kind, name) must match a conservative pattern, so no path can reach
outside `run_dir` (no `..`, no separators, no absolute parts).
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from oneloop.errors import CheckpointNotFoundError, RequestError

SCHEME = "tinker://"
_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
CheckpointKind = Literal["weights", "sampler_weights"]
_KINDS: tuple[CheckpointKind, ...] = ("weights", "sampler_weights")
META_FILE = "meta.json"


def check_component(value: str, what: str) -> str:
    """Return `value` if it is a safe single path component, else raise RequestError naming `what`."""
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
        if len(parts) != 3 or parts[1] not in _KINDS:
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
