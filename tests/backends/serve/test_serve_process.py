"""One `oneloop serve` process on 127.0.0.1 (a subprocess, its own Ray runtime), driven by the
official SDK (issue 21, items 3, 4, 6 and the 5xx half of 5):

- every port its Ray runtime opens listens on loopback only (from /proc/net/tcp*);
- training clients past `--max-live-trainers` are refused with a 403 naming the cap; closing a
  ServiceClient (its session) or `--trainer-idle-s` of silence releases its trainers, and the
  count of live Ray trainer actors returns to its bound;
- a base model that is not a model directory is a user error every time (regression: the second
  was a `500 backend error: KeyError` the SDK retried for a minute);
- SIGTERM ends it within 60 s with status 143, no traceback or C++ stack trace, Ray gone.

The tests run in file order and share the one server (starting Ray costs ~20 s on 2 cores).
"""

import ipaddress
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from oneloop.backends.megatron_local.serve.spawn import serve_process
from oneloop.tiny.model import TINY_MODEL_NAME

pytestmark = pytest.mark.slow
CLIENT_KEY = "tml-any-key-on-loopback"
IDLE_S = 8.0
"""`--trainer-idle-s`: long enough that a loaded 2-core host never idles a trainer in use."""
START_TIMEOUT_S = 240.0


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return kids


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it (Ray's GCS, raylet, agents and workers)."""
    kids, out = _children(), [pid]
    for parent in out:
        out += kids.get(parent, [])
    return out


def _address(kind: str, hex_address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address,
                                                   int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if kind == "tcp":
        return ipaddress.IPv4Address(raw[::-1]), int(port, 16)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # /proc prints host-order words
    return ipaddress.IPv6Address(words), int(port, 16)


def _listening(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, command, address, port) of every listening TCP socket the processes hold."""
    listening = {}
    for kind in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{kind}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                listening[fields[9]] = _address(kind, fields[1])
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
            if inode in listening:
                address, port = listening[inode]
                out.append((pid, command, str(address), port))
    return out


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _live_trainers(server_pid: int) -> int:
    """Live Ray trainer actors of the server: worker processes whose title Ray set to
    `ray::TrainerActor...` (a killed actor's worker process exits)."""
    count = 0
    for pid in _tree(server_pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        count += title.startswith(b"ray::TrainerActor")
    return count


def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_process")
    backend = tmp / "backend.yaml"
    backend.write_text(f"backend:\n  run_dir: {tmp / 'runs'}\n  local:\n    torch_threads: 1\n"
                       "    ray_num_cpus: 2\n")
    args = ["--host", "127.0.0.1", "--backend-config", str(backend), "--max-live-trainers", "1",
            "--trainer-idle-s", str(IDLE_S)]  # fmt: skip
    env = {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    log = tmp / "serve.log"
    with serve_process(args, log=log, env=env, start_timeout_s=START_TIMEOUT_S) as server:
        yield server.process, server.url, server.log


def test_ray_runtime_listens_on_loopback_only(served):
    process, _, _ = served
    sockets = _listening(_tree(process.pid))
    commands = " ".join(command for _, command, _, _ in sockets)
    assert "gcs_server" in commands and "raylet" in commands, sockets  # the runtime is there
    exposed = [s for s in sockets if not _is_loopback(s[2])]
    assert exposed == [], f"listening off loopback: {exposed}"


def _train_step(training) -> None:
    datum = types.Datum(model_input=types.ModelInput.from_ints([301, 302, 303]),
                        loss_fn_inputs={"target_tokens": np.array([302, 303, 304], np.int64),
                                        "weights": np.ones(3, np.float32)})
    training.forward_backward([datum], "cross_entropy").result(timeout=120)


def test_trainers_are_capped_and_released(served):
    process, url, _ = served
    first = tinker.ServiceClient(base_url=url, api_key=CLIENT_KEY)
    training = first.create_lora_training_client(TINY_MODEL_NAME, rank=2).result(timeout=180)
    _train_step(training)
    assert _live_trainers(process.pid) == 1
    with pytest.raises(tinker.APIStatusError) as refused:
        first.create_lora_training_client(TINY_MODEL_NAME, rank=2).result(timeout=60)
    assert refused.value.status_code == 403
    assert "max_live_trainers=1" in str(refused.value) and "--max-live-trainers" in str(
        refused.value)
    first.close("success").result(timeout=60)  # ends the session: its trainer is released
    _until(lambda: _live_trainers(process.pid) == 0, 60, "the finished session's trainer released")

    second = tinker.ServiceClient(base_url=url, api_key=CLIENT_KEY)
    try:
        idle = second.create_lora_training_client(TINY_MODEL_NAME, rank=2).result(timeout=180)
        assert _live_trainers(process.pid) == 1  # a second client past the cap of one
        _until(lambda: _live_trainers(process.pid) == 0, 60, f"released after {IDLE_S} s idle")
        with pytest.raises(Exception, match="released .*idle"):
            _train_step(idle)
    finally:
        second.close("success").result(timeout=60)


def test_a_base_model_that_is_not_a_model_is_a_user_error_every_time(served, tmp_path):
    _, url, _ = served
    client = tinker.ServiceClient(base_url=url, api_key=CLIENT_KEY)
    try:
        for _ in range(2):
            with pytest.raises(tinker.RequestFailedError) as failed:
                client.create_lora_training_client(str(tmp_path), rank=2).result(timeout=120)
            assert failed.value.category == types.RequestErrorCategory.User
            assert "without config.json" in str(failed.value)
            with pytest.raises(tinker.APIStatusError) as refused:
                client.create_sampling_client(base_model=str(tmp_path)).result(timeout=60)
            assert refused.value.status_code == 400 and "without config.json" in str(
                refused.value)
    finally:
        client.close("success").result(timeout=60)


def test_sigterm_stops_serve_cleanly(served):
    process, _, log = served
    tree = _tree(process.pid)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 128 + signal.SIGTERM
    text = log.read_text()
    assert "stopped by SIGTERM" in text
    for marker in ("Traceback", "*** SIG", "Stack trace", "terminate called", "core dumped"):
        assert marker not in text, text[-3000:]
    _until(lambda: all(not Path(f"/proc/{pid}").exists() or
                       Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
                       for pid in tree), 30, "Ray's processes ended")
