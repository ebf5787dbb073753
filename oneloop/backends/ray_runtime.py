"""Starting the local Ray runtime: loopback only, and a bounded retry of one transient failure.

Own runtime. With no `address` and no `RAY_ADDRESS`, `ray.init()` joins the runtime that `ray
start` (or `ray.cluster_utils.Cluster`) last recorded in Ray's temp dir, if it still runs (seen in
CI: a run joined a concurrent two-node test's cluster and failed when that one shut down). A run
with no address therefore starts its own, always: `address="local"`. Joining a cluster takes an
address (`local.ray_address`; `auto` for the one `ray start` runs on this node).

Loopback. A runtime this process starts (no `address`, no `RAY_ADDRESS`) is a single-node one,
and every port it opens (GCS, raylet, object manager, core-worker gRPC servers, the runtime-env
agent) listens on 127.0.0.1 only: nothing of it is reachable from the network, whatever address
`oneloop serve` binds. Ray 2.x binds those servers to its node IP (all interfaces for the gRPC
servers) and turns an explicit `_node_ip_address="127.0.0.1"` back into the host's outward IP
(`services.resolve_ip_for_localhost`); the one switch it honours is the one it uses on macOS and
Windows, `ray_constants.ENABLE_RAY_CLUSTER` (env `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`, read when
Ray is imported): off, the node IP is loopback and every server binds it. It is turned off for
the `ray.init` call only (the driver's node IP is then fixed) and put back after, so a later
connection to a real cluster resolves its address as usual. Checked by
`tests/backends/serve/test_serve_process.py` from the runtime's listening sockets. A multi-node
cluster (`local.ray_address`) is the cluster's own: its ports listen on each node's IP.

Slow starts. Ray waits a fixed 30 s for a fresh raylet to register with its GCS
(`ray/_private/node.py`) and then gives up with "The current node timed out during startup". On
an overloaded host (measured: a 2-core machine at load 20+) that is a slow start, not a broken
install; the half-started processes are shut down and Ray is started again, at most `attempts`
times. Any other error, and the last attempt's, is raised as Ray raised it.

Unreachable clusters. Joining a cluster (`address="host:port"`, or `auto` with a recorded one)
that nothing answers makes `ray.init` retry its GCS connection without end (measured with Ray
2.x: still retrying after 200 s). So the GCS port is dialled first, with a bound
(`connect_timeout_s`): a refused or silent address raises ConfigError naming it at once. A port
that accepts but is not a GCS still leaves Ray to its own retries.
"""

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import ray

from oneloop.errors import ConfigError

log = logging.getLogger(__name__)

SLOW_START = "timed out during startup"
LOOPBACK_ADDRESSES = ("127.0.0.1", "::1")


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Ray's local-only node mode for the duration of one `ray.init` (see the module docstring).
    `ray._private.ray_constants` is pinned with Ray in uv.lock; the test above fails if a Ray
    upgrade stops honouring it."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def starts_local_runtime(kwargs: dict[str, Any]) -> bool:
    """Whether `ray.init(**kwargs)` starts a new single-node runtime (rather than joining one)."""
    address = kwargs.get("address")
    return address == "local" or (address is None and not os.environ.get("RAY_ADDRESS"))


def gcs_address(address: str | None) -> tuple[str, int] | None:
    """Host and port of the GCS that `ray.init(address=address)` joins (`RAY_ADDRESS` and `auto`
    resolved as Ray resolves them); None when it starts a runtime, joins through the Ray client
    (`ray://`), or finds no recorded cluster (then `ray.init` says so at once)."""
    if address is not None and (address == "local" or address.startswith("ray://")):
        return None
    from ray._private import services  # pinned with Ray in uv.lock

    try:
        resolved = services.canonicalize_bootstrap_address(address)
    except Exception:  # nothing to resolve "auto" to: ray.init raises its own ConnectionError
        return None
    if resolved is None or resolved.startswith("ray://"):
        return None
    host, _, port = resolved.rpartition(":")
    return host.strip("[]"), int(port)


def check_reachable(address: str | None, timeout_s: float) -> None:
    """Raise ConfigError unless the GCS that `address` names accepts a connection in `timeout_s`."""
    target = gcs_address(address)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=timeout_s).close()
    except OSError as error:
        where = "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "backend.local.ray_address"
        raise ConfigError(
            f"no Ray cluster answers at {target[0]}:{target[1]} ({where}={address!r}, waited "
            f"{timeout_s:g} s: {error or type(error).__name__}); start the cluster "
            "(scripts/cluster/head.sh on the head node) or fix the address"
        ) from None


def init_ray(attempts: int = 3, connect_timeout_s: float = 20.0, **kwargs: Any) -> None:
    """`ray.init(**kwargs)` unless Ray is already up; see the module docstring."""
    if ray.is_initialized():
        return
    local = starts_local_runtime(kwargs)
    if local:
        kwargs = {**kwargs, "address": "local"}  # never another process's runtime (docstring)
    else:
        check_reachable(kwargs.get("address"), connect_timeout_s)
    for attempt in range(1, attempts + 1):
        try:
            with _loopback_node() if local else contextlib.nullcontext():
                ray.init(**kwargs)
            break
        except Exception as error:
            if SLOW_START not in str(error) or attempt == attempts:
                raise
            log.warning("Ray start %d/%d timed out (host overloaded?); retrying", attempt, attempts)
            ray.shutdown()
            time.sleep(2.0 * attempt)
    if local:
        node_ip = ray.util.get_node_ip_address()
        if node_ip not in LOOPBACK_ADDRESSES:
            log.warning("the local Ray runtime's node IP is %s, not loopback: its ports may be "
                        "reachable from the network", node_ip)
