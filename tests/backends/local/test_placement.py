"""The placement dry run (`oneloop train --plan`, `megatron_local.placement`): the presets'
16-node layouts on a described cluster (test data, no cluster), refusals that name what is short,
and the planner's trainer bundles agreeing with the rank group's own rule (`group.rank_bundles`)."""

import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import yaml

from oneloop.backends import plan
from oneloop.backends.config import LocalBackendConfig
from oneloop.backends.megatron_local.placement import (
    ClusterNode,
    PlacementError,
    plan_placement,
    read_cluster_file,
)
from oneloop.errors import ConfigError
from oneloop.loop.cli import main as train_main
from oneloop.loop.config import load_config

ROOT = Path(__file__).resolve().parents[3]
CLUSTERS = ROOT / "tests" / "fixtures" / "clusters"
CLUSTER_16 = CLUSTERS / "h200-16x8.yaml"
LAYOUTS = yaml.safe_load((CLUSTERS / "layouts-16-nodes.yaml").read_text())


def preset_plan(preset: str):
    cfg = load_config(preset, LAYOUTS[preset])
    return plan(cfg.backend, CLUSTER_16)


def gpus_used(p) -> dict[tuple[str, int], float]:
    used: Counter = Counter()
    for seat in [*p.trainer.seats, *(s for g in p.samplers for s in g.seats)]:
        used[(seat.node, seat.gpu)] += seat.share
    return used


def test_qwen3_6_35b_a3b_on_16_nodes_trains_on_4_and_samples_on_12():
    p = preset_plan("qwen3.6-35b-a3b")
    roles = p.node_roles()
    assert [roles[f"node-{i}"] for i in range(16)] == ["train"] * 4 + ["sample"] * 12
    t = p.trainer_shape
    assert (t.dp, t.pp, t.cp, t.ep, t.tp, t.ranks) == (32, 1, 1, 8, 1, 32)  # ep within dp
    assert p.trainer.strategy == "PACK"  # 32 ranks do not fit one 8-GPU node
    assert p.trainer.bundles == ({"GPU": 1.0, "CPU": 1.0},) * 32
    # Each EP block of 8 consecutive ranks (one DP replica) fills one node.
    for block in range(4):
        seats = p.trainer.seats[8 * block : 8 * block + 8]
        assert {s.node for s in seats} == {f"node-{block}"}
        assert [s.gpu for s in seats] == list(range(8))
        assert seats[0].role == f"trainer rank {8 * block} (dp {8 * block} pp 0 cp 0 ep 0 tp 0)"
    assert len(p.samplers) == 48
    for e, group in enumerate(p.samplers):
        assert (group.strategy, group.bundles) == ("STRICT_PACK", ({"GPU": 2.0},))
        assert group.bundle_nodes == (f"node-{4 + e // 4}",)
        assert [s.gpu for s in group.seats] == [2 * (e % 4), 2 * (e % 4) + 1]
    used = gpus_used(p)
    assert len(used) == 128 and set(used.values()) == {1.0}  # every GPU used once


def test_qwen3_5_397b_a17b_trains_in_10_stages_a_node_and_samples_on_6():
    p = preset_plan("qwen3.5-397b-a17b")
    roles = p.node_roles()
    assert [roles[f"node-{i}"] for i in range(16)] == ["train"] * 10 + ["sample"] * 6
    t = p.trainer_shape
    assert (t.dp, t.pp, t.cp, t.ep, t.tp, t.ranks) == (8, 10, 1, 8, 1, 80)
    assert p.trainer.strategy == "PACK"
    for stage in range(10):  # a stage's 8 replicas (its EP group) fill one node
        seats = p.trainer.seats[8 * stage : 8 * stage + 8]
        assert [s.node for s in seats] == [f"node-{stage}"] * 8
        assert seats[1].role == f"trainer rank {8 * stage + 1} (dp 1 pp {stage} cp 0 ep 1 tp 0)"
    assert len(p.samplers) == 6
    for e, group in enumerate(p.samplers):
        assert (group.strategy, group.bundles) == ("STRICT_PACK", ({"GPU": 8.0},))
        assert group.bundle_nodes == (f"node-{10 + e}",)
    used = gpus_used(p)
    assert len(used) == 128 and set(used.values()) == {1.0}


def test_qwen3_8b_on_16_nodes_trains_on_1_and_samples_on_15():
    p = preset_plan("qwen3-8b-1node")
    roles = p.node_roles()
    assert [roles[f"node-{i}"] for i in range(16)] == ["train"] + ["sample"] * 15
    assert p.trainer.strategy == "STRICT_PACK"  # TP 2 x DP 4 fits one node
    assert [s.role for s in p.trainer.seats[:3]] == [
        "trainer rank 0 (dp 0 pp 0 cp 0 ep 0 tp 0)",
        "trainer rank 1 (dp 0 pp 0 cp 0 ep 0 tp 1)",
        "trainer rank 2 (dp 1 pp 0 cp 0 ep 0 tp 0)",
    ]
    assert Counter(g.bundle_nodes[0] for g in p.samplers) == {f"node-{i}": 8 for i in range(1, 16)}
    assert set(gpus_used(p).values()) == {1.0} and len(gpus_used(p)) == 128


def test_plan_command_prints_the_layout(capsys):
    argv = ["--config", "qwen3.6-35b-a3b", "--plan", "--cluster", str(CLUSTER_16),
            *LAYOUTS["qwen3.6-35b-a3b"]]  # fmt: skip
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert "cluster: 16 nodes, 128 GPUs" in out
    assert "trainer rank 24..31 (dp 24..31, pp 0) -> node-3 gpu0-7" in out
    assert "sampler 47: placement group STRICT_PACK {GPU: 2} -> node-15 gpu6,gpu7" in out
    # Too small a cluster: exit 2, the error names what is short.
    small = ["--config", "qwen3.6-35b-a3b", "--plan", "--cluster", str(CLUSTER_16),
             "backend.local.megatron.ep=16", "backend.local.megatron.dp=16",
             "backend.local.gpus_per_trainer=16"]  # fmt: skip
    assert train_main(small) == 2
    err = capsys.readouterr().err
    assert "trainer needs 16 GPUs packed on one node for tp·lcm(cp,ep)=16" in err
    assert "largest node has 8" in err


def nodes(count: int, gpus: int, cpus: float = 16) -> list[ClusterNode]:
    return [ClusterNode(f"n{i}", gpus, cpus) for i in range(count)]


def test_refusals_name_what_is_short():
    mega = {"trainer_engine": "megatron", "sampler_engine": "vllm"}
    with pytest.raises(PlacementError, match="largest node has 4"):
        plan_placement(
            LocalBackendConfig(**mega, megatron={"ep": 8}, gpus_per_trainer=8), nodes(4, 4)
        )
    with pytest.raises(PlacementError, match=r"room for only 2 engine\(s\)") as error:
        plan_placement(
            LocalBackendConfig(**mega, megatron={"tp": 2}, gpus_per_trainer=2,
                               vllm={"tp": 2}, samplers_per_model=3),  # fmt: skip
            nodes(1, 6),
        )
    assert "local.samplers_per_model" in str(error.value)
    with pytest.raises(PlacementError, match="local.vllm.tp=8; largest node has 4"):
        plan_placement(LocalBackendConfig(**mega, vllm={"tp": 8}), nodes(2, 4))
    with pytest.raises(PlacementError, match="local.gpus_per_trainer=0: .* needs local.gpus_per"):
        plan_placement(LocalBackendConfig(**mega, megatron={"dp": 2}), nodes(1, 8))
    # vLLM TP > 1 with a sync path that writes one worker's layout: refused at parse time.
    with pytest.raises(ValueError, match="local.vllm.tp=2 shards each engine"):
        LocalBackendConfig(**mega, vllm={"tp": 2}, weight_sync="nccl")


def test_colocated_and_cpu_layouts():
    # demo-gpu: trainer and sampler on halves of one GPU.
    p = plan_placement(
        LocalBackendConfig(trainer_engine="megatron", sampler_engine="vllm",
                           gpus_per_trainer=0.5, gpus_per_sampler=0.5),  # fmt: skip
        nodes(1, 1),
    )
    assert p.trainer.strategy == "ACTOR" and p.node_roles() == {"n0": "train+sample"}
    assert [(s.node, s.gpu, s.share) for s in p.trainer.seats] == [("n0", 0, 0.5)]
    assert [(s.gpu, s.share) for s in p.samplers[0].seats] == [(0, 0.5)]
    # CPU torch engines are spread: two engines on two nodes (the two-node sync test's layout).
    p = plan_placement(LocalBackendConfig(samplers_per_model=2), nodes(2, 0, cpus=2))
    assert sorted(g.bundle_nodes[0] for g in p.samplers) == ["n0", "n1"]


def test_cluster_file_errors_name_the_entry(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes:\n  - {name: a, gpus: 8}\n  - {name: b, gpus: -1}\n")
    with pytest.raises(ConfigError, match=r"c.yaml: nodes\[1\].gpus: expected an integer >= 0"):
        read_cluster_file(bad)
    bad.write_text("nodes:\n  - {name: a, gpu: 8}\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['gpu'\]"):
        read_cluster_file(bad)
    assert [n.name for n in read_cluster_file(CLUSTER_16)][:2] == ["node-0", "node-1"]


def test_trainer_bundles_follow_the_rank_groups_rule():
    """The planner's bundles and strategy are the ones `MegatronRayGroup` reserves."""
    from oneloop.backends.megatron_local.engines.megatron.group import rank_bundles
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel

    for sizes, cluster in (
        ({"tp": 2, "dp": 4}, nodes(2, 8)),
        ({"tp": 2, "dp": 4}, nodes(4, 4)),
        ({"tp": 4, "cp": 2, "dp": 2}, nodes(2, 8)),
    ):
        ranks = sizes["tp"] * sizes.get("cp", 1) * sizes["dp"]
        local = LocalBackendConfig(
            trainer_engine="megatron", megatron=sizes, gpus_per_trainer=ranks
        )
        p = plan_placement(local, cluster)
        resources = [{"GPU": float(n.gpus), "CPU": n.cpus} for n in cluster]
        bundles, strategy = rank_bundles(MegatronParallel(**sizes), nodes=resources)
        assert (list(p.trainer.bundles), p.trainer.strategy) == (bundles, strategy)


def test_cluster_launch_scripts_parse():
    """scripts/cluster/: the shell launchers parse (`bash -n`) and the node wait has its CLI."""
    import subprocess
    import sys

    scripts = CLUSTERS.parents[2] / "scripts" / "cluster"
    for name in ("head.sh", "worker.sh", "train.sbatch"):
        subprocess.run(["bash", "-n", str(scripts / name)], check=True, timeout=30)
    usage = subprocess.run(
        [sys.executable, str(scripts / "wait_nodes.py"), "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "alive nodes to wait for" in usage.stdout
    assert "backend.local.ray_address=auto" in (scripts / "train.sbatch").read_text()


def test_an_unreachable_cluster_address_is_refused_at_once():
    """`ray.init` retries a silent GCS without end; `--plan` and the backend dial it first and name
    the address instead of hanging. `--plan` runs in a process of its own (this one may already
    be on a Ray runtime, which `init_ray` then keeps)."""
    from oneloop.backends.megatron_local.ports import free_port
    from oneloop.backends.ray_runtime import check_reachable

    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", "demo-cpu", "--plan",
         f"backend.local.ray_address={closed}"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "no Ray cluster answers at" in done.stderr, done.stderr[-3000:]
    assert f"backend.local.ray_address='{closed}'" in done.stderr
    assert "Traceback" not in done.stderr
    with pytest.raises(ConfigError, match=r"no Ray cluster answers at 192\.0\.2\.1:6379 .*0\.5 s"):
        check_reachable("192.0.2.1:6379", timeout_s=0.5)  # TEST-NET-1: nothing answers


OTHER_RUNTIME = """
import sys, ray
ray.init(address="local", num_cpus=1, include_dashboard=False)
gcs = ray.get_runtime_context().gcs_address
ray._private.utils.write_ray_address(gcs)  # as `ray start` and ray.cluster_utils.Cluster do
print(gcs, flush=True)
sys.stdin.read()  # up until the test closes our stdin
"""
OWN_RUNTIME = """
import ray
from oneloop.backends.ray_runtime import init_ray
init_ray(num_cpus=1, include_dashboard=False, configure_logging=False)
print(ray.get_runtime_context().gcs_address, flush=True)
"""


def test_no_address_starts_an_own_runtime_while_another_is_up():
    """Plain `ray.init()` joins the runtime `ray start` (or a test's `Cluster`) last recorded in
    Ray's temp dir (CI saw a run join a concurrent two-node test's cluster and die with it);
    `init_ray` with no address starts a runtime of its own. Both processes get a private Ray temp
    dir, so the recorded address reaches no other test."""
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths are bounded
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": temp}
    other = subprocess.Popen([sys.executable, "-c", OTHER_RUNTIME], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        other_gcs = other.stdout.readline().strip()
        assert other_gcs, "the other runtime did not start"
        own = subprocess.run([sys.executable, "-c", OWN_RUNTIME], capture_output=True, text=True,
                             timeout=300, env=env, stdin=subprocess.DEVNULL)  # fmt: skip
        assert own.returncode == 0, own.stderr[-3000:]
        own_gcs = own.stdout.strip().splitlines()[-1]
        assert own_gcs != other_gcs
        assert "Found multiple active Ray instances" not in own.stderr
        assert "Connecting to existing Ray cluster" not in own.stderr
    finally:
        other.stdin.close()
        other.wait(timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
