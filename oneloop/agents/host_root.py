"""A trial's view of the host filesystem: a per-trial overlay of the host root, in a mount
namespace held open for the whole trial.

This module owns the mount plan of the container-free environment (`oneloop.agents.environment`)
and the process that holds a trial's mount namespace. `RootPlan.script()` is a shell script run
once per trial under `unshare -m --propagation private`: it mounts the trial's view under its
private root directory, prints `READY_LINE` and then waits on its stdin; every command of the
trial enters that namespace (`nsenter --mount=/proc/<holder>/ns/mnt`) and `chroot`s into the
root. Closing the holder's stdin (or killing it) ends the namespace once the trial's last
process is gone.

The view (`HostRoot.OVERLAY`, the default): every top-level host directory other than the
kernel's (`/proc`, `/sys`, `/dev`: bound recursively) and the trial's private ones (`/logs`,
`/tmp`, the workdir, ...) is an overlayfs whose lower layer is the host's directory and whose
upper layer lives in the trial's control directory: a task's writes to `/usr`, `/etc`, `/var`,
`/root`, the checkout, ... land there and are deleted with the trial. Mounts nested under those
directories are bound back read-only, and so are the runtime directories (interpreter, venv,
checkout) that live under a private top-level directory. `HostRoot.SHARED` (explicit opt-out,
for hosts without overlayfs) binds the host's directories read-write as before.

Not isolated in either mode: the network, processes (a trial sees and can signal the host's),
the kernel (sysctls under `/proc/sys`, devices under `/dev`), and memory/CPU.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path, PurePosixPath

# Top-level directories that stay the host's own kernel views (bound recursively, writable).
KERNEL_DIRS = frozenset({"proc", "sys", "dev"})
READY_LINE = "oneloop-root-ready"
# Exit status of the setup script when the namespace could not be set up.
SETUP_FAILED_EXIT = 125


class HostRoot(StrEnum):
    """How a trial sees the host's directories (environment kwarg `host_root`)."""

    OVERLAY = "overlay"  # copy-on-write per trial: the host never changes
    SHARED = "shared"  # the host's directories, read-write (opt-out; a task can change the host)


@dataclass
class RootPlan:
    """The mounts of one trial's root (see the module docstring)."""

    root: Path
    layers: Path  # overlay upper/work dirs live here (same filesystem for both)
    mode: HostRoot
    private_tops: frozenset[str]
    commands: list[str] = field(default_factory=list)

    def build(self, runtime_dirs: list[Path]) -> None:
        """Create the root's directories and symlinks on the host; queue the mounts."""
        for entry in sorted(Path("/").iterdir()):
            if entry.name in self.private_tops:
                continue
            target = self.root / entry.name
            if entry.is_symlink():
                target.symlink_to(os.readlink(entry))
            elif entry.is_dir():
                target.mkdir()
                self._mount_top(entry, target)
        if self.mode is HostRoot.OVERLAY:
            for mount_point in nested_mounts(self.private_tops):
                self.bind(Path(mount_point), self.root / mount_point.lstrip("/"), read_only=True)
        # The interpreter, the venv and the oneloop checkout must stay visible even when they
        # live under a directory made private (e.g. a clone under /tmp): bind them back.
        for host_dir in runtime_dirs:
            pure = PurePosixPath(host_dir)
            if len(pure.parts) > 1 and pure.parts[1] in self.private_tops:
                target = self.root / str(pure).lstrip("/")
                target.mkdir(parents=True, exist_ok=True)
                self.bind(host_dir, target, read_only=self.mode is HostRoot.OVERLAY, rec=True)

    def _mount_top(self, entry: Path, target: Path) -> None:
        if self.mode is HostRoot.SHARED or entry.name in KERNEL_DIRS:
            self.bind(entry, target, rec=True)
            return
        upper, work = self.layers / "upper" / entry.name, self.layers / "work" / entry.name
        upper.mkdir(parents=True)
        work.mkdir(parents=True)
        options = f"lowerdir={entry},upperdir={upper},workdir={work}"
        self.commands.append(
            f"mount -t overlay overlay -o {shlex.quote(options)} {shlex.quote(str(target))}"
        )

    def bind(self, source: Path, target: Path, read_only: bool = False, rec: bool = False) -> None:
        src, dst = shlex.quote(str(source)), shlex.quote(str(target))
        self.commands.append(f"mount {'--rbind' if rec else '--bind'} {src} {dst}")
        if read_only:
            self.commands.append(f"mount -o remount,bind,ro {dst}")

    def script(self) -> str:
        """The holder's script: mounts, then READY_LINE, then wait for stdin's EOF."""
        body = " &&\n  ".join(self.commands) or "true"
        return (
            "#!/bin/sh\n"
            f"setup() {{\n  {body}\n}}\n"
            "if ! setup; then\n"
            "  echo 'oneloop container-free environment: mount namespace setup failed' >&2\n"
            f"  exit {SETUP_FAILED_EXIT}\n"
            "fi\n"
            f"echo {READY_LINE}\n"
            "read -r _ignored || true\n"
        )


def nested_mounts(private_tops: frozenset[str]) -> list[str]:
    """Host mount points below an overlaid top-level directory (outermost first): the overlay
    shows the directory's own filesystem only, so these are bound back (read-only)."""
    points: list[str] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        point = _unescape(fields[4])
        parts = PurePosixPath(point).parts
        if len(parts) < 3 or parts[1] in KERNEL_DIRS or parts[1] in private_tops:
            continue
        points.append(point)
    unique = sorted(set(points), key=lambda p: (len(PurePosixPath(p).parts), p))
    return [p for p in unique if os.path.isdir(p) or os.path.isfile(p)]


def _unescape(path: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (`\\040`)."""
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and i + 3 < len(path) and path[i + 1 : i + 4].isdigit():
            out.append(chr(int(path[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def holder_argv(control: Path) -> list[str]:
    """argv of the process that sets up and holds a trial's mount namespace."""
    return [
        "unshare", "-m", "--propagation", "private", "--", "/bin/sh", str(control / "setup.sh"),
    ]  # fmt: skip


def entry_argv(holder_pid: int, root: Path, cwd: str) -> list[str]:
    """argv prefix that runs a command in the trial's namespace and root, in `cwd`."""
    return [
        "nsenter", f"--mount=/proc/{holder_pid}/ns/mnt", "--",
        "chroot", str(root), "/bin/sh", "-c", 'cd "$0" || exit 1; exec "$@"', cwd,
    ]  # fmt: skip


def runtime_dirs() -> list[Path]:
    """Host directories a trial's processes need: the oneloop checkout, the venv, the base
    interpreter (outermost first, duplicates and nested ones removed)."""
    import oneloop

    candidates = {
        Path(oneloop.__file__).resolve().parents[1],
        Path(sys.prefix).resolve(),
        Path(sys.base_prefix).resolve(),
    }
    ordered = sorted(candidates, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in ordered:
        if not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    return kept
