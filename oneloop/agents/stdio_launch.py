"""Launcher of a stdio program through a preloaded fork server (`stdio_forkserver`).

Run as a plain script with the standard library only (`python -I -S stdio_launch.py ADDRESS
MODULE ARGS...`), so it starts in ~10 ms instead of the ~0.8 s of CPU that importing an MCP server
costs. It runs where the program should run (inside a trial's private mount namespace and chroot),
hands its stdin/stdout/stderr, its mount namespace, root and working directory, its environment
and the program's argv to the fork server over an abstract unix socket, then waits for the forked
program's exit status and exits with it (a signal death becomes 128 + signal, as in a shell).

If the fork server cannot be reached it runs the program itself (`python -m MODULE ARGS...`), so a
missing or crashed fork server costs speed, never the trial. If the fork server dies while the
program runs, the launcher exits with `LOST_EXIT` and says so on stderr. Killing the launcher
(the MCP client closing its process group) makes the fork server kill the program.
"""

import array
import json
import os
import socket
import struct
import sys
import time

CONNECT_TIMEOUT_S = 20.0  # the fork server may still be importing the module
CONNECT_TIMEOUT_ENV = "ONELOOP_FORKSERVER_CONNECT_TIMEOUT_S"  # overrides it (tests)
CONNECT_RETRY_S = 0.05
LOST_EXIT = 70  # EX_SOFTWARE: the fork server went away while the program ran
HEADER = struct.Struct("!I")
STATUS = struct.Struct("!i")  # >= 0: exit code; < 0: killed by that signal


def _connect(address: str) -> socket.socket | None:
    deadline = time.monotonic() + float(os.environ.get(CONNECT_TIMEOUT_ENV, CONNECT_TIMEOUT_S))
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect("\0" + address)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(CONNECT_RETRY_S)


def _run_locally(module: str, args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        sys.stderr.write("usage: stdio_launch.py ADDRESS MODULE [ARGS...]\n")
        return 2
    address, module, args = argv[0], argv[1], argv[2:]
    sock = _connect(address)
    if sock is None:
        sys.stderr.write(f"stdio fork server {address!r} unreachable; starting {module} directly\n")
        _run_locally(module, args)
    assert sock is not None
    request = json.dumps({"module": module, "argv": args, "env": dict(os.environ)}).encode()
    fds = [0, 1, 2, os.open("/proc/self/ns/mnt", os.O_RDONLY), os.open("/", os.O_RDONLY),
           os.open(".", os.O_RDONLY)]  # fmt: skip
    sock.sendmsg(
        [HEADER.pack(len(request)), request],
        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
    )
    for fd in fds[3:]:
        os.close(fd)
    # The program holds the pipes now; our copies of stdin/stdout must not keep them open.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    reply = b""
    while len(reply) < STATUS.size:
        chunk = sock.recv(STATUS.size - len(reply))
        if not chunk:
            sys.stderr.write(f"stdio fork server {address!r} went away while {module} ran\n")
            return LOST_EXIT
        reply += chunk
    (status,) = STATUS.unpack(reply)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
