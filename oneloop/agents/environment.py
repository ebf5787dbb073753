"""The no-container Harbor environment: per-trial private files on the host, for development and CI.

This module owns `NoContainerEnvironment`, a harbor 0.25 `BaseEnvironment` loaded by import path
(`TrialConfig.environment.import_path = NO_CONTAINER_IMPORT_PATH`). It isolates FILES, not
security: every command runs as the calling user (root) on the host kernel and sees the host's
processes and network. Production uses Harbor's Docker / Modal / Daytona environments through the
same trial config; only `environment.import_path` changes.

How a trial gets private files: `start()` makes a private root directory holding Harbor's fixed
paths (`/logs` with `agent/`, `verifier/`, `artifacts/`, `/tests`, `/solution`, `/installed-agent`,
`/tmp` and the task workdir, default `/app`) and starts one process that holds a fresh mount
namespace for the whole trial (`oneloop.agents.host_root`). In it every other top-level host
directory (`/usr`, `/etc`, `/var`, `/root`, `/work`, ...) is a per-trial overlay of the host's
(kwarg `host_root="overlay"`, the default: writes land in a scratch layer deleted with the trial,
the host never changes), `/proc`, `/sys` and `/dev` are the host's, and Harbor's host mounts (the
trial's `agent/`, `verifier/` and artifacts dirs, so no download is needed) are bound over their
fixed paths. Each `exec` enters that namespace (`nsenter`) and `chroot`s into the root.
Concurrent trials therefore never see each other's files, nor change the host's. Where overlayfs
cannot be mounted, `start()` fails with the kernel's reason; `host_root="shared"` is the explicit
opt-out (the host's directories read-write, as before; a task can then change the host).

Every command gets its own process group; a timeout, a cancellation and `stop()` kill the group.
Capabilities are honest: no GPUs, no network policy (a task asking for `no-network`, an allowlist
or GPUs is rejected by Harbor's validators with an error naming the environment), no users other
than root, Linux only. Agents that start stdio MCP servers call `stdio_command` so the server runs
inside the same private view (and, e.g., writes `/logs/agent/answer.txt` into this trial).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import tempfile
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, override

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.models.task.config import TaskOS

from oneloop.agents.host_root import (
    READY_LINE,
    HostRoot,
    RootPlan,
    entry_argv,
    holder_argv,
    runtime_dirs,
)
from oneloop.agents.stdio_forkserver import FORK_SERVERS
from oneloop.errors import ConfigError, OneloopError

NO_CONTAINER_IMPORT_PATH = "oneloop.agents.environment:NoContainerEnvironment"
DEFAULT_WORKDIR = "/app"
# Harbor's fixed in-environment paths plus /tmp; each is a directory of the private root.
PRIVATE_DIRS = ("/logs", "/tests", "/solution", "/installed-agent", "/tmp")
# Harbor calls `exec` without a timeout for some steps (it wraps whole phases in `wait_for`); this
# cap makes sure no command outlives a forgotten caller. One hour is above any demo-task phase.
DEFAULT_MAX_EXEC_TIMEOUT_SEC = 3600.0
# After the command's main process exits, background children may keep its pipes open (like a
# `docker exec` of `server &`). Output is collected for this long, then the pipes are dropped; the
# children live on until `stop()`.
PIPE_DRAIN_GRACE_SEC = 1.0
# SIGTERM first so tools can clean up; SIGKILL after this grace.
KILL_GRACE_SEC = 2.0
# Setting up a trial's mount namespace (tens of mounts) finishes well within this.
NAMESPACE_SETUP_TIMEOUT_SEC = 30.0
# Task-level fault-injection knob (task.toml `[environment.env]`): start() fails when set to "1".
INJECT_START_FAILURE_ENV = "ONELOOP_INJECT_START_FAILURE"
ROOT_USERS = (None, "root", 0, "0")
# A stdio program (MCP server) started through `stdio_command` that exits nonzero leaves
# `<trial agent dir>/<prefix><pid>.txt` holding "<status> <argv>".
STDIO_EXIT_PREFIX = "oneloop-stdio-exit-"


class EnvironmentStartError(OneloopError, RuntimeError):
    """The environment could not be started (bad task definition, missing tools, injected fault)."""


class ExecTimeoutError(OneloopError, RuntimeError):
    """A command ran past its timeout; its process group was killed."""


class NoContainerEnvironment(BaseEnvironment):
    """Harbor environment that isolates a trial's FILES (not security) without containers.

    Each `exec` runs in its own mount namespace chrooted into a per-trial root where Harbor's
    fixed paths are private; the rest of the host filesystem is shared read-write. Use it for
    development and CI; production uses Harbor's Docker / Modal / Daytona environments through
    the same `TrialConfig`. Kwargs (via `TrialConfig.environment.kwargs`): `root_base_dir`
    (where private roots are made; default `$TMPDIR/oneloop-envs`), `max_exec_timeout_sec`
    (cap for commands given no timeout), `auto_mounting` (default True: the trial's log dirs are
    bound in, so Harbor reads them without copying), `stdio_forkserver` (default True: see
    `stdio_command`), `host_root` ("overlay", default, or "shared": see the module docstring).
    """

    def __init__(
        self,
        *args: Any,
        root_base_dir: str | Path | None = None,
        max_exec_timeout_sec: float = DEFAULT_MAX_EXEC_TIMEOUT_SEC,
        auto_mounting: bool = True,
        stdio_forkserver: bool = True,
        host_root: str = HostRoot.OVERLAY.value,
        **kwargs: Any,
    ) -> None:
        if host_root not in tuple(HostRoot):
            raise ConfigError(
                f"environment.kwargs.host_root={host_root!r}: expected one of "
                f"{[m.value for m in HostRoot]}"
            )
        self._host_root = HostRoot(host_root)
        self._holder: asyncio.subprocess.Process | None = None
        if max_exec_timeout_sec <= 0:
            raise ConfigError(
                f"environment.kwargs.max_exec_timeout_sec must be > 0, got {max_exec_timeout_sec}"
            )
        self._root_base_dir = Path(
            root_base_dir or Path(tempfile.gettempdir()) / "oneloop-envs"
        ).absolute()
        self._max_exec_timeout_sec = float(max_exec_timeout_sec)
        if not isinstance(stdio_forkserver, bool):
            raise ConfigError(
                "environment.kwargs.stdio_forkserver must be true or false, got "
                f"{stdio_forkserver!r}"
            )
        self._stdio_forkserver = stdio_forkserver
        self._control_dir: Path | None = None
        self._process_groups: set[int] = set()
        super().__init__(*args, auto_mounting=auto_mounting, **kwargs)
        self._workdir = self.task_env_config.workdir or DEFAULT_WORKDIR
        # (environment path, host path) for every private path, longest environment path first.
        self._path_map: list[tuple[PurePosixPath, Path]] = []

    @staticmethod
    @override
    def type() -> str:
        return "oneloop-no-container"

    @classmethod
    @override
    def preflight(cls) -> None:
        """Harbor's contract: SystemExit naming what is missing on this host."""
        problem = _host_problem()
        if problem is not None:
            raise SystemExit(problem)

    @property
    @override
    def capabilities(self) -> EnvironmentCapabilities:
        # mounted=True: host dirs can be bound in (Harbor's log dirs by default). Nothing else:
        # no GPUs, no network policy, no Windows, no compose.
        return EnvironmentCapabilities(mounted=True)

    @classmethod
    @override
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # CPU and memory values are accepted but neither limited nor reserved.
        return EnvironmentResourceCapabilities()

    @override
    def _validate_definition(self) -> None:
        if self.task_env_config.os != TaskOS.LINUX:
            raise ConfigError(
                f"task.environment.os={self.task_env_config.os.value!r}: the no-container "
                "environment runs Linux tasks only"
            )
        workdir = self.task_env_config.workdir or DEFAULT_WORKDIR
        path = PurePosixPath(workdir)
        if not path.is_absolute() or ".." in path.parts or len(path.parts) < 2:
            raise ConfigError(
                f"task.environment.workdir={workdir!r} must be an absolute path below '/'"
            )
        top = Path("/", path.parts[1])
        if top.exists() and str(top) not in PRIVATE_DIRS:
            raise ConfigError(
                f"task.environment.workdir={workdir!r} lies inside host directory {top}, which "
                "this environment shares with the host; use a top-level path such as '/app'"
            )
        for index, mount in enumerate(self._host_mounts):
            if mount["type"] != "bind":
                raise ConfigError(
                    f"environment.mounts[{index}].type={mount['type']!r}: only 'bind' mounts "
                    "are supported by the no-container environment"
                )

    # ----------------------------------------------------------------------------------------
    # Lifecycle
    # ----------------------------------------------------------------------------------------

    @override
    async def start(self, force_build: bool) -> None:
        del force_build  # nothing is built
        if self.task_env_config.env.get(INJECT_START_FAILURE_ENV) == "1":
            raise EnvironmentStartError(
                f"injected start failure ({INJECT_START_FAILURE_ENV}=1 in the task's "
                "[environment.env])"
            )
        problem = _host_problem()
        if problem is not None:
            raise EnvironmentStartError(problem)
        if self.task_env_config.docker_image:
            self.logger.warning(
                "task.environment.docker_image=%r is ignored: the no-container environment "
                "runs on the host's filesystem",
                self.task_env_config.docker_image,
            )
        self._root_base_dir.mkdir(parents=True, exist_ok=True)
        control = Path(
            tempfile.mkdtemp(prefix=f"{_safe_name(self.session_id)}-", dir=self._root_base_dir)
        )
        self._control_dir = control
        await asyncio.to_thread(self._build_root, control)
        await self._start_holder(control)
        await self._upload_environment_files()

    async def _start_holder(self, control: Path) -> None:
        """Start the process holding this trial's mount namespace; wait until it is mounted."""
        if self._host_root is HostRoot.SHARED:
            self.logger.warning(
                "environment.kwargs.host_root='shared': the trial writes to the host's own "
                "directories (/usr, /etc, ...); a task can change this host"
            )
        holder = await asyncio.create_subprocess_exec(
            *holder_argv(control),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._holder = holder
        assert holder.stdout is not None and holder.stderr is not None
        try:
            line = await asyncio.wait_for(holder.stdout.readline(), NAMESPACE_SETUP_TIMEOUT_SEC)
        except TimeoutError:
            line = b""
        if line.decode().strip() != READY_LINE:
            _kill_group(holder.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(holder.wait(), KILL_GRACE_SEC)
            stderr = b""
            with contextlib.suppress(TimeoutError):
                stderr = await asyncio.wait_for(holder.stderr.read(), KILL_GRACE_SEC)
            self._holder = None
            hint = (
                " (hosts without overlayfs in a mount namespace: environment.kwargs."
                "host_root='shared' runs unprotected, on purpose)"
                if self._host_root is HostRoot.OVERLAY
                else ""
            )
            raise EnvironmentStartError(
                f"the trial's mount namespace could not be set up (host_root="
                f"{self._host_root.value!r}): {stderr.decode(errors='replace').strip()[-800:]}"
                + hint
            )

    def _build_root(self, control: Path) -> None:
        root = control / "root"
        root.mkdir()
        private = [*PRIVATE_DIRS, self._workdir]
        for env_path in private:
            (root / env_path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for sub in ("agent", "verifier", "artifacts"):
            (root / "logs" / sub).mkdir(parents=True, exist_ok=True)
        (root / "tmp").chmod(0o1777)
        private_tops = frozenset(PurePosixPath(p).parts[1] for p in private)
        plan = RootPlan(root, control / "layers", self._host_root, private_tops)
        plan.build(runtime_dirs())
        path_map: dict[PurePosixPath, Path] = {
            PurePosixPath(p): root / p.lstrip("/") for p in private
        }
        for mount in sorted(self._host_mounts, key=lambda m: len(PurePosixPath(m["target"]).parts)):
            env_target = PurePosixPath(mount["target"])
            if not any(env_target.is_relative_to(p) for p in private):
                raise ConfigError(
                    f"environment mount target {str(env_target)!r} is outside the private dirs "
                    f"{private}; the no-container environment can only bind inside them"
                )
            source = Path(mount["source"]).resolve()
            source.mkdir(parents=True, exist_ok=True)
            host_target = root / str(env_target).lstrip("/")
            host_target.mkdir(parents=True, exist_ok=True)
            plan.bind(source, host_target, read_only=bool(mount.get("read_only")))
            path_map[env_target] = source
        (control / "setup.sh").write_text(plan.script())
        self._path_map = sorted(path_map.items(), key=lambda kv: len(kv[0].parts), reverse=True)

    async def _upload_environment_files(self) -> None:
        """Copy the task's `environment/` files (except container build files) into the workdir."""
        env_dir = self.environment_dir
        if not env_dir.is_dir():
            return
        skip = {"Dockerfile", "docker-compose.yaml", "docker-compose.yml", ".dockerignore"}
        for entry in env_dir.iterdir():
            if entry.name in skip:
                continue
            target = str(PurePosixPath(self._workdir) / entry.name)
            if entry.is_dir():
                await self.upload_dir(entry, target)
            else:
                await self.upload_file(entry, target)

    @override
    async def stop(self, delete: bool) -> None:
        for pgid in list(self._process_groups):
            _kill_group(pgid, signal.SIGKILL)
        self._process_groups.clear()
        control = self._control_dir
        if control is None:
            return
        for pid_line in _read_lines(control / "stdio.pids"):
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                pid = int(pid_line)
                if os.getpgid(pid) == pid:  # still the leader of the group it started
                    _kill_group(pid, signal.SIGKILL)
        holder, self._holder = self._holder, None
        if holder is not None:  # its exit ends the namespace (the trial's processes are gone)
            _kill_group(holder.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(holder.wait(), KILL_GRACE_SEC)
        if delete:
            await asyncio.to_thread(_remove_root, control)
            self._control_dir = None

    # ----------------------------------------------------------------------------------------
    # Commands
    # ----------------------------------------------------------------------------------------

    def _entry_argv(self, cwd: str) -> list[str]:
        if self._control_dir is None or self._holder is None:
            raise EnvironmentStartError(
                f"environment {self.session_id!r} is not started (call start() first)"
            )
        if self._holder.returncode is not None:
            raise EnvironmentStartError(
                f"environment {self.session_id!r}: the process holding its mount namespace "
                f"exited ({self._holder.returncode})"
            )
        return entry_argv(self._holder.pid, self._control_dir / "root", cwd)

    def stdio_command(self, command: str, args: list[str]) -> tuple[str, list[str]]:
        """Return `(command, args)` that start a stdio program inside this trial's private view.

        Agents use it for stdio MCP servers (mcp's `stdio_client` gives the process its own
        group and kills it on close). The pid is recorded so `stop()` kills leftovers, and a
        nonzero exit of the server (a crash mid-trial, not the client's SIGTERM, which takes
        the wrapper down with it) is written to `<trial agent dir>/STDIO_EXIT_PREFIX<pid>.txt`
        so the trial runner can count it as an infrastructure failure.

        `python -m MODULE` of this interpreter starts through a fork server that imported MODULE
        once (`stdio_forkserver`; kwarg `stdio_forkserver=False` turns it off): the same program
        in the same private view and with the same exit status, without paying its imports again.
        """
        argv = self._entry_argv(self._workdir)
        control = self._control_dir
        assert control is not None  # _entry_argv checked it
        if self._stdio_forkserver:
            command, args = FORK_SERVERS.command(command, args) or (command, args)
        pids = shlex.quote(str(control / "stdio.pids"))
        exits = shlex.quote(str(self.host_path(PurePosixPath("/logs/agent")) / STDIO_EXIT_PREFIX))
        script = (
            f'echo $$ >> {pids}; "$@"; status=$?; '
            f'if [ "$status" -ne 0 ]; then echo "$status $*" > {exits}$$.txt; fi; exit "$status"'
        )
        return "/bin/sh", ["-c", script, "oneloop-stdio", *argv, command, *args]

    @override
    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | float | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        resolved_user = self._resolve_user(user)
        if resolved_user not in ROOT_USERS:
            raise ConfigError(
                f"exec user={resolved_user!r}: the no-container environment runs commands as "
                "root only (task.agent.user / task.verifier.user must be unset or 'root')"
            )
        if timeout_sec is not None and timeout_sec <= 0:
            raise ValueError(f"exec timeout_sec must be > 0, got {timeout_sec}")
        limit = min(float(timeout_sec or self._max_exec_timeout_sec), self._max_exec_timeout_sec)
        argv = [*self._entry_argv(cwd or self._workdir), "/bin/bash", "-c", command]
        proc_env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": "/root",
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "TMPDIR": "/tmp",
            **(self._merge_env(env) or {}),
        }
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=proc_env,
            start_new_session=True,
        )
        self._process_groups.add(proc.pid)
        stdout_task = asyncio.create_task(_read_all(proc.stdout), name="env-exec-stdout")
        stderr_task = asyncio.create_task(_read_all(proc.stderr), name="env-exec-stderr")
        try:
            await asyncio.wait_for(proc.wait(), timeout=limit)
        except TimeoutError as exc:
            await _terminate_group(proc)
            self._process_groups.discard(proc.pid)
            stdout_task.cancel()
            stderr_task.cancel()
            raise ExecTimeoutError(
                f"command timed out after {limit:g} s and its process group was killed: "
                f"{command[:200]!r}"
            ) from exc
        except BaseException:
            await asyncio.shield(_terminate_group(proc))
            self._process_groups.discard(proc.pid)
            stdout_task.cancel()
            stderr_task.cancel()
            raise
        done, pending = await asyncio.wait(
            {stdout_task, stderr_task}, timeout=PIPE_DRAIN_GRACE_SEC
        )
        for task in pending:
            task.cancel()
        if not _group_alive(proc.pid):  # background children keep the group for stop() to kill
            self._process_groups.discard(proc.pid)
        stdout = stdout_task.result() if stdout_task in done else ""
        stderr = stderr_task.result() if stderr_task in done else ""
        return ExecResult(
            stdout=stdout or None, stderr=stderr or None, return_code=proc.returncode or 0
        )

    # ----------------------------------------------------------------------------------------
    # Files
    # ----------------------------------------------------------------------------------------

    def host_path(self, env_path: str | PurePosixPath) -> Path:
        """The host path behind an environment path; only private paths have one."""
        if self._control_dir is None:
            raise EnvironmentStartError(f"environment {self.session_id!r} is not started")
        path = PurePosixPath(os.path.normpath(str(env_path)))
        if not path.is_absolute():
            path = PurePosixPath(self._workdir) / path
        for env_root, host_root in self._path_map:
            if path.is_relative_to(env_root):
                return host_root.joinpath(*path.relative_to(env_root).parts)
        raise ValueError(
            f"environment path {str(env_path)!r} is outside the private dirs "
            f"{[str(p) for p, _ in self._path_map]}; the rest of the filesystem is the host's "
            "own and this environment does not copy files there"
        )

    @override
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = self.host_path(target_path)
        await asyncio.to_thread(_copy_file, Path(source_path), target)

    @override
    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        target = self.host_path(target_dir)
        await asyncio.to_thread(_copy_tree, Path(source_dir), target)

    @override
    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        source = self.host_path(source_path)
        await asyncio.to_thread(_copy_file, source, Path(target_path))

    @override
    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        source = self.host_path(source_dir)
        await asyncio.to_thread(_copy_tree, source, Path(target_dir))


def _host_problem() -> str | None:
    """Why this host cannot run the no-container environment, or None."""
    for tool in ("unshare", "nsenter", "mount", "chroot"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found on PATH; install util-linux"
    if os.geteuid() != 0:
        return "the no-container environment needs root (mount namespaces and chroot)"
    return None


def _safe_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return cleaned[:80] or f"env-{uuid.uuid4().hex[:8]}"


def _read_lines(path: Path) -> list[str]:
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


async def _read_all(stream: asyncio.StreamReader | None) -> str:
    if stream is None:
        return ""
    chunks: list[bytes] = []
    while chunk := await stream.read(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _terminate_group(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the command's process group, SIGKILL it after a grace period, reap the leader."""
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), timeout=KILL_GRACE_SEC)
    except TimeoutError:
        pass
    _kill_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), timeout=KILL_GRACE_SEC)


def _copy_file(source: Path, target: Path) -> None:
    if not source.is_file():
        raise FileNotFoundError(f"no such file to copy: {source}")
    if source.resolve() == target.resolve():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)


def _copy_tree(source: Path, target: Path) -> None:
    if not source.is_dir():
        raise FileNotFoundError(f"no such directory to copy: {source}")
    if source.resolve() == target.resolve():
        return
    shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)


def _remove_root(control: Path) -> None:
    """Delete a private root; refuses if anything below it is still a mount point on the host."""
    root = control / "root"
    if root.is_dir():
        mounted = [p for p in root.iterdir() if p.is_dir() and os.path.ismount(p)]
        if mounted:
            raise OneloopError(
                f"refusing to delete {root}: {mounted[0]} is a mount point in this namespace"
            )
    shutil.rmtree(control)
