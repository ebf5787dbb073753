"""`oneloop serve` as a child process: started on a port the OS picks, awaited until it says where
it listens, stopped with SIGINT (the clean stop: status 130) and killed only if that hangs.

For scripts, notebooks, benchmarks and tests that need a server in front of a local backend of its
own, as users run it:

    with serve_process(["--backend-config", "backend.yaml"]) as served:
        client = tinker.ServiceClient(base_url=served.url, api_key="tml-...")
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 300.0
"""Ray's start, the sampler actor's model load: ~10-60 s on a loaded 2-core machine."""
STOP_TIMEOUT_S = 60.0
_LISTENING = re.compile(r"oneloop serve on (http://[^\s]+:\d+)")


@dataclass(frozen=True)
class ServeProcess:
    """A running `oneloop serve`: its base URL, its process, the file its output goes to."""

    url: str
    process: subprocess.Popen
    log: Path


@contextlib.contextmanager
def serve_process(
    args: Sequence[str] = (),
    *,
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
    stop_timeout_s: float = STOP_TIMEOUT_S,
) -> Iterator[ServeProcess]:
    """`python -m oneloop.cli serve --port 0 *args`, yielded once it listens. Output (stdout and
    stderr) goes to `log` (a temporary file when not given), so no pipe can fill and block it.
    A server that exits or stays silent past `start_timeout_s` raises RuntimeError with the last
    of its output. On exit: SIGINT, at most `stop_timeout_s` for the clean stop, then SIGKILL;
    `process.returncode` then tells which (130: stopped by the signal)."""
    if log is None:
        handle, name = tempfile.mkstemp(prefix="oneloop-serve-", suffix=".log")
        os.close(handle)
        log = Path(name)
    command = [sys.executable, "-m", "oneloop.cli", "serve", "--port", "0", *args]
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )  # fmt: skip
    try:
        yield ServeProcess(_wait_listening(process, log, start_timeout_s), process, log)
    finally:
        _stop(process, stop_timeout_s)


def _wait_listening(process: subprocess.Popen, log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        found = _LISTENING.search(log.read_text(errors="replace"))
        if found:
            return found.group(1)
        if process.poll() is not None:
            raise RuntimeError(
                f"oneloop serve exited with status {process.returncode} before listening; "
                f"its output ({log}):\n{_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"oneloop serve did not listen within {timeout_s:.0f} s; its output ({log}):\n"
                f"{_tail(log)}"
            )
        time.sleep(0.25)


def _stop(process: subprocess.Popen, timeout_s: float) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:]
