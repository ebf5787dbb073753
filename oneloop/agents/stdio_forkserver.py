"""A fork server for Python stdio programs (MCP servers) started once per trial.

Why: a trial starts its stdio MCP server as a fresh `python -m MODULE`; importing the MCP SDK
alone costs ~0.8 s of CPU, more than the rest of a demo trial. A fork server imports MODULE once
and forks a copy per trial, which then runs MODULE as `__main__` exactly as `python -m` would.

How (Linux, root: the no-container environment's own requirements):
- `StdioForkServers.command(python, args)` returns the argv that starts the program through the
  fork server when `args` is `-m MODULE ...` for this interpreter, else None (start it directly).
  The fork server of a module is started lazily, once per process, in its own session; it exits
  when its parent process exits (EOF on its stdin).
- It listens on an abstract unix socket (not a path: trials run in private mount namespaces with
  their own /tmp) and accepts only connections from our own uid.
- The launcher (`stdio_launch.py`, stdlib only) runs where the program should run: inside the
  trial's namespace and chroot. It passes its stdio, mount namespace, root and working directory
  and its environment; the forked child enters that namespace (`setns`), chroots, changes
  directory, takes the stdio and environment, and runs the module. The child's exit status goes
  back to the launcher, which exits with it, so crash accounting is unchanged.
- The launcher gone (killed with its process group) → the child is killed. The fork server gone
  → the launcher exits with `stdio_launch.LOST_EXIT`, or, when it could not connect at all, runs
  the module itself.

Run as `python -m oneloop.agents.stdio_forkserver --address ADDR --module MODULE`.
"""

from __future__ import annotations

import argparse
import array
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import uuid
from pathlib import Path

from oneloop.agents import stdio_launch

LAUNCHER = Path(stdio_launch.__file__).resolve()
MAX_REQUEST_BYTES = 1 << 20
N_FDS = 6  # stdin, stdout, stderr, mount namespace, root, cwd


class StdioForkServers:
    """The fork servers of this process, one per module, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        self.started = 0  # fork servers started (a restart after a crash counts again)

    def command(self, python: str, args: list[str]) -> tuple[str, list[str]] | None:
        """`(command, args)` starting `python args` through a fork server, or None when `args`
        is not `-m MODULE ...` for this very interpreter."""
        if len(args) < 2 or args[0] != "-m" or not _same_interpreter(python):
            return None
        module = args[1]
        address = self._address(module)
        return sys.executable, ["-I", "-S", str(LAUNCHER), address, module, *args[2:]]

    def _address(self, module: str) -> str:
        with self._lock:
            running = self._servers.get(module)
            if running is not None and running[0].poll() is None:
                return running[1]
            address = f"oneloop-forkserver-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            proc = subprocess.Popen(
                [sys.executable, "-m", __name__, "--address", address, "--module", module],
                stdin=subprocess.PIPE,
                start_new_session=True,
            )
            self._servers[module] = (proc, address)
            self.started += 1
            return address

    def close(self) -> None:
        """Stop every fork server of this process (their running children are killed)."""
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for proc, _ in servers:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)


def _same_interpreter(python: str) -> bool:
    try:
        return os.path.samefile(python, sys.executable)
    except OSError:
        return False


FORK_SERVERS = StdioForkServers()


# -- the fork server process ---------------------------------------------------------------------


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a length-prefixed JSON header with the launcher's fds attached."""
    fds = array.array("i")
    header = b""
    while len(header) < stdio_launch.HEADER.size:
        msg, ancdata, _, _ = conn.recvmsg(
            stdio_launch.HEADER.size - len(header), socket.CMSG_SPACE(N_FDS * fds.itemsize)
        )
        if not msg:
            raise ConnectionError("launcher closed before sending its request")
        header += msg
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    (size,) = stdio_launch.HEADER.unpack(header)
    if size > MAX_REQUEST_BYTES:
        raise ValueError(f"request of {size} bytes (limit {MAX_REQUEST_BYTES})")
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("launcher closed mid-request")
        body += chunk
    if len(fds) != N_FDS:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected {N_FDS} file descriptors, got {len(fds)}")
    return json.loads(body), list(fds)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the fork server dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the prctl took effect
        os._exit(stdio_launch.LOST_EXIT)


def _child(module: str, request: dict, fds: list[int], parent: int) -> None:
    """In the forked child (the server's own sockets already closed): become the program the
    launcher asked for, then exit."""
    code = 1
    try:
        _die_with_parent(parent)
        stdin, stdout, stderr, mount_ns, root, cwd = fds
        os.setns(mount_ns, os.CLONE_NEWNS)
        os.fchdir(root)
        os.chroot(".")
        os.fchdir(cwd)
        for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it at start
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [module, *request["argv"]]
        # Run it as `python -m` would: a fresh `__main__` (its imports stay warm in sys.modules).
        sys.modules.pop(module, None)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - report like the interpreter would, then exit
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - the pipe may be gone
                pass
        os._exit(code)


class _Server:
    def __init__(self, address: str, module: str) -> None:
        self.module = module
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + address)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}  # child pid -> its launcher's connection
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    os.read(self.wake_r, 4096)
                elif key.data == "parent":
                    if not os.read(sys.stdin.fileno(), 4096):
                        self._shutdown()
                        return
                else:  # a launcher's connection readable: it went away (it never sends more)
                    self._launcher_gone(key.data)
            self._reap()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():
            conn.close()
            return
        conn.settimeout(10.0)
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError) as exc:
            sys.stderr.write(f"stdio fork server: bad request: {exc}\n")
            conn.close()
            return
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._close_in_child(conn)
            _child(self.module, request, fds, parent)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _close_in_child(self, conn: socket.socket) -> None:
        """Close (not just forget) the server's fds, so none leaks into the program."""
        self.selector.close()
        self.listener.close()
        for other in (*self.children.values(), conn):
            other.close()
        signal.set_wakeup_fd(-1)
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _launcher_gone(self, pid: int) -> None:
        conn = self.children.get(pid)
        if conn is not None:
            self.selector.unregister(conn)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(stdio_launch.STATUS.pack(code))
            except OSError:
                pass  # the launcher is gone; nobody waits for this status
            try:
                self.selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()

    def _shutdown(self) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(self.children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--module", required=True)
    ns = parser.parse_args(argv)
    importlib.import_module(ns.module)  # the point: the expensive imports happen once, here
    if threading.active_count() != 1:
        # fork() copies only this thread; a module that started threads cannot be forked safely.
        sys.stderr.write(f"stdio fork server: importing {ns.module} started threads; not serving\n")
        return 1
    _Server(ns.address, ns.module).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
