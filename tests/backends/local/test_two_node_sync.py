"""Weight sync to two sampler engines on different nodes of a real two-node Ray cluster on one host
(issue 18): the local backend places its engines where the placement plan says
(`placement.sampler_actor_options`), both serve each new version, and their logprobs equal the
trainer's (fp32 CPU, torch engines, < 1e-5).

The cluster (`ray.cluster_utils.Cluster`: a head and a second raylet, each its own node id) is
started in a subprocess, so this test neither needs nor disturbs the session's local Ray runtime;
the child prints one JSON line of facts that the test asserts.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
CHILD_TIMEOUT_S = 420


def test_weight_sync_reaches_samplers_on_two_nodes(tmp_path, tiny_model_path):
    done = subprocess.run(
        [sys.executable, __file__, str(tmp_path), str(tiny_model_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(facts["cluster_nodes"]) == 2
    # The engines sit on two different nodes, the ones the plan named.
    assert len(set(facts["sampler_nodes"])) == 2, facts
    assert facts["sampler_nodes"] == facts["planned_nodes"], facts
    assert set(facts["sampler_nodes"]) == set(facts["cluster_nodes"])
    assert "cluster: 2 nodes, 2 GPUs" in facts["plan_text"]
    # GPU engines: each in a placement group on its planned node, one per node.
    assert [planned for planned, _ in facts["gpu_engines"]] == [
        got for _, got in facts["gpu_engines"]
    ]
    assert len({got for _, got in facts["gpu_engines"]}) == 2
    # Both serve the new version, and what they compute is the trainer's model.
    for version in facts["installed"]:
        assert version == facts["client_version"] >= 1
    assert min(facts["router_sessions"]) >= 1  # each engine served a session
    assert len(facts["max_gap"]) == 2
    # (a sampler still on the base weights would differ: lr 5e-2 moves the tiny model's logprobs
    # by far more than 1e-5)
    assert max(facts["max_gap"]) < 1e-5, facts


def child(run_dir: str, model_dir: str) -> dict:
    """Two-node cluster → local backend on it → train one step → publish → sample on each engine."""
    import ray
    from ray.cluster_utils import Cluster
    from test_local_backend import (
        make_datum,  # this file runs as a script: its folder is on the path
    )
    from tinker import types

    from oneloop.backends import BackendConfig, connect
    from oneloop.backends import plan as backend_plan
    from oneloop.backends.megatron_local.routing import PrefixRouter

    # One (accounting-only) GPU per node: the GPU engines' placement groups are checked too.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1})
    cluster.add_node(num_cpus=2, num_gpus=1)
    cluster.wait_for_nodes(timeout=120)
    name = "tiny"
    service = connect(
        BackendConfig(
            backend="local",
            run_dir=Path(run_dir),
            models={name: Path(model_dir)},
            local={"torch_threads": 1, "samplers_per_model": 2, "ray_address": cluster.address},
        )
    )
    try:
        plan = backend_plan(service.config)  # `oneloop train --plan` on the live cluster
        trainer = service.create_lora_training_client(name, rank=0, seed=3).result(timeout=300)
        tokens = np.random.default_rng(0).integers(10, 1000, 40).tolist()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 39},
        )
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=300)
        client = trainer.save_weights_and_get_sampling_client(kind="inflight").result(timeout=300)
        pool = client._pool
        node_of = [a.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
                   for a in pool.actors]  # fmt: skip
        installed = [
            a.__ray_call__.remote(lambda actor, key: actor.engine.version(key), client._key)
            for a in pool.actors
        ]
        gaps = []
        for engine in (0, 1):
            prompt = prompt_for_engine(PrefixRouter, pool.router.engines, engine)
            sampled = client.sample(
                types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=8, seed=4)
            ).result(timeout=300)
            data = [make_datum(prompt + s.tokens) for s in sampled.sequences]
            out = trainer.forward(data, "cross_entropy").result(timeout=300)
            gap = 0.0
            for seq, lp in zip(sampled.sequences, out.loss_fn_outputs, strict=True):
                trainer_lp = lp["logprobs"].to_numpy()[len(prompt) - 1 :]
                gap = max(gap, float(np.abs(trainer_lp - np.asarray(seq.logprobs)).max()))
            gaps.append(gap)
        facts = {
            "gpu_engines": gpu_engine_nodes(),
            "cluster_nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
            "sampler_nodes": ray.get(node_of, timeout=60),
            "planned_nodes": [plan.node_ids[g.bundle_nodes[0]] for g in plan.samplers],
            "plan_text": plan.format(),
            "installed": ray.get(installed, timeout=60),
            "client_version": client.version,
            "router_sessions": list(pool.router.sessions),
            "max_gap": gaps,
        }
    finally:
        service.close()
        ray.shutdown()
        cluster.shutdown()
    return facts


def gpu_engine_nodes() -> list[list[str]]:
    """[planned node id, node Ray reserved the engine's placement group on] of two vllm engines
    of one GPU each (the placement groups only; no vLLM here)."""
    import ray

    from oneloop.backends.config import LocalBackendConfig
    from oneloop.backends.megatron_local import placement

    local = LocalBackendConfig(sampler_engine="vllm", samplers_per_model=2)
    plan = placement.plan_placement(local, placement.live_cluster())
    options = [placement.sampler_options(plan, i) for i in range(2)]
    groups = placement.placement_groups(options)
    try:
        pairs = []
        for group, pg in zip(plan.samplers, groups, strict=True):
            reserved_on = ray.util.placement_group_table(pg)["bundles_to_node_id"][0]
            pairs.append([plan.node_ids[group.bundle_nodes[0]], reserved_on])
        return pairs
    finally:
        for pg in groups:
            ray.util.remove_placement_group(pg)


def prompt_for_engine(router_class, engines: int, engine: int) -> list[int]:
    """A fresh prompt (a new session) that the router sends to `engine`."""
    rng = np.random.default_rng(engine)
    while True:
        tokens = rng.integers(10, 1000, 80)
        if router_class(engines).route(tokens) == engine:
            return tokens.tolist()


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], sys.argv[2])))
