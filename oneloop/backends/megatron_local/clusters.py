"""Clusters for the placement plan: nodes with GPU and CPU counts, described in a YAML/JSON file
(`oneloop train --plan --cluster FILE`) or read from the Ray cluster this process is connected to.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from oneloop.errors import ConfigError


class PlacementError(ConfigError):
    """The layout does not fit the cluster, or the cluster description is invalid."""


@dataclass(frozen=True)
class ClusterNode:
    """One node: its name (a description's or `ip:node-id prefix`), GPUs, CPUs, Ray id."""

    name: str
    gpus: int
    cpus: float
    node_id: str | None = None


def read_cluster_file(path: Path | str) -> list[ClusterNode]:
    """A described cluster (`--cluster FILE`, YAML or JSON):

        nodes:
          - {name: train, count: 4, gpus: 8, cpus: 96}   # train-0 .. train-3
          - {name: node-x, gpus: 4, cpus: 48}            # one node

    `count` > 1 expands to `<name>-<i>`; `cpus` defaults to 0 (GPU-only plans need none).
    Errors name the file and the entry."""
    path = Path(path)
    where = f"--cluster {path}"
    try:
        text = path.read_text()
    except OSError as error:
        raise PlacementError(f"{where}: cannot read it ({error.strerror or error})") from None
    try:
        if path.suffix.lower() == ".json":
            raw = json.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text)
    except Exception as error:  # json.JSONDecodeError, yaml.YAMLError
        raise PlacementError(
            f"{where}: not valid YAML/JSON ({' '.join(str(error).split())})"
        ) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("nodes"), list) or not raw["nodes"]:
        raise PlacementError(f"{where}: expected a mapping with a non-empty list `nodes:` of "
                             "{name, gpus, cpus, count}")  # fmt: skip
    nodes: list[ClusterNode] = []
    for i, entry in enumerate(raw["nodes"]):
        field_ = f"{where}: nodes[{i}]"
        if not isinstance(entry, dict):
            raise PlacementError(f"{field_}: expected a mapping {{name, gpus, cpus, count}}")
        unknown = set(entry) - {"name", "gpus", "cpus", "count"}
        if unknown:
            raise PlacementError(
                f"{field_}: unknown key(s) {sorted(unknown)} (expected name, gpus, cpus, count)"
            )
        name = str(entry.get("name", f"node{i}"))
        values = {}
        for key, default in (("gpus", None), ("cpus", 0), ("count", 1)):
            value = entry.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < (key == "count"):
                raise PlacementError(f"{field_}.{key}: expected an integer >= {int(key == 'count')}"
                                     f", got {value!r}")  # fmt: skip
            values[key] = value
        count = values["count"]
        for k in range(count):
            label = f"{name}-{k}" if count > 1 else name
            nodes.append(ClusterNode(label, values["gpus"], float(values["cpus"])))
    names = [n.name for n in nodes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise PlacementError(f"{where}: node names repeat: {dupes}")
    return nodes


def cluster_from_ray_nodes(rows: list[dict]) -> list[ClusterNode]:
    """The alive nodes of `ray.nodes()` rows, in a stable order (address, then id)."""
    nodes = []
    for row in rows:
        if not row.get("Alive", row.get("alive", False)):
            continue
        res = row.get("Resources", {})
        node_id = str(row["NodeID"])
        name = f"{row.get('NodeManagerAddress', '?')}:{node_id[:8]}"
        nodes.append(ClusterNode(name, int(res.get("GPU", 0)), float(res.get("CPU", 0)), node_id))
    return sorted(nodes, key=lambda n: (n.name.split(":")[0], n.node_id or ""))


def live_cluster() -> list[ClusterNode]:
    """The nodes of the Ray cluster this process is connected to."""
    import ray

    return cluster_from_ray_nodes(ray.nodes())
