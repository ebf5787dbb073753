"""A real two-node Ray cluster on one host, for tests of placement across nodes.

`two_node_cluster()` starts `ray.cluster_utils.Cluster`: a head node and a second raylet, each with
its own CPUs and a custom resource naming it (`node:a` / `node:b` style: `HEAD_RESOURCE`,
`WORKER_RESOURCE`), connects this process to it, and yields a `TwoNodes` (the address and each
node's Ray node id). Ray allows one runtime per process, and the pytest session may already hold
one (tests/conftest.py's `local_service`): run code that uses this from a subprocess (as the
megatron CPU checks run their phases, `cpu_megatron.run_phases`), never in the pytest process.

    with two_node_cluster(head_cpus=1, worker_cpus=1) as nodes:
        ...  # ray is initialised; nodes.head_id / nodes.worker_id are the node ids
"""

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

HEAD_RESOURCE = "test_node_head"
WORKER_RESOURCE = "test_node_worker"


@dataclass(frozen=True)
class TwoNodes:
    """The running cluster: Ray's address and the node id of each node."""

    address: str
    head_id: str
    worker_id: str

    def name(self, node_id: str) -> str:
        """"head" or "worker" for a node id of this cluster."""
        return {self.head_id: "head", self.worker_id: "worker"}[node_id]


@contextlib.contextmanager
def two_node_cluster(
    *,
    head_cpus: int = 1,
    worker_cpus: int = 1,
    head_resources: dict[str, float] | None = None,
    worker_resources: dict[str, float] | None = None,
    runtime_env: dict[str, Any] | None = None,
) -> Iterator[TwoNodes]:
    """Start the two nodes (each with its CPUs, its custom resource and `*_resources`), connect
    this process (`ray.init`, with `runtime_env` for every worker), yield them; shut both down."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        raise RuntimeError("two_node_cluster needs a process without a Ray runtime: run it in a "
                           "subprocess (see the module docstring)")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "resources": {HEAD_RESOURCE: 1.0, **(head_resources or {})},
            "include_dashboard": False,
        },
    )
    try:
        cluster.add_node(
            num_cpus=worker_cpus, resources={WORKER_RESOURCE: 1.0, **(worker_resources or {})}
        )
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, runtime_env=runtime_env or None)
        ids = {}
        for node in ray.nodes():
            for marker in (HEAD_RESOURCE, WORKER_RESOURCE):
                if node.get("Alive") and marker in node["Resources"]:
                    ids[marker] = node["NodeID"]
        if len(ids) != 2:
            raise RuntimeError(f"two_node_cluster: expected two live nodes, Ray sees {ray.nodes()}")
        yield TwoNodes(cluster.address, ids[HEAD_RESOURCE], ids[WORKER_RESOURCE])
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
