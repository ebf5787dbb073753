"""The megatron trainer's data parallelism and Ray rank actors on real megatron-core (gloo, CPU).

dp_gloo_phases.py runs in its own process (its own Ray runtime: a real two-node cluster on this
host; the CUDA-on-CPU shims stay there): dp = 2 (one rank actor on each node) and dp = 2 × tp = 2
equal the one-process engine's loss, grad norm, logprobs and weights over two optim_steps (fp32);
a rank killed in the middle of a call fails it at once, naming the rank and its node, and the group
refuses further calls; a new group rebuilt from the step-1 checkpoint continues to step 2 with the
uninterrupted run's weights; the dp = 2 checkpoint's weights load at dp = 1, its optimizer state is
refused there.
"""

import json

import pytest
from cpu_megatron import megatron_core_installed, run_phases

pytestmark = [pytest.mark.megatron_cpu, pytest.mark.timeout(900)]


def test_dp2_ray_ranks_match_dp1_across_two_nodes(tmp_path) -> None:
    assert megatron_core_installed(), "megatron-core missing: `uv sync` (group megatron-cpu)"
    run_phases("dp_gloo_phases.py", tmp_path, [[]])
    figures = json.loads((tmp_path / "figures.json").read_text())
    for key, value in figures.items():
        print(f"RESULT {key} = {value}")
    assert sorted(figures["dp2_nodes"]) == ["head", "worker"], figures  # one rank on each node
    assert sorted(figures["dp2tp2_nodes"]) == ["head", "head", "worker", "worker"], figures
    assert figures["dp2tp2_nodes"][0] == figures["dp2tp2_nodes"][1], figures  # a TP block: 1 node
    assert figures["ref_weights_moved"] > 1e-4, figures
    for tag in ("dp2", "dp2tp2"):
        for step in range(2):
            assert figures[f"{tag}_loss{step}_rel_gap"] < 1e-6, (tag, step, figures)
            assert figures[f"{tag}_grad_norm{step}_rel_gap"] < 1e-6, (tag, step, figures)
            assert figures[f"{tag}_logprob{step}_gap"] < 1e-5, (tag, step, figures)
            assert figures[f"{tag}_weights{step}_gap"] < 1e-6, (tag, step, figures)
    message = figures["kill_message"]
    assert "rank 3 (dp 1, pp 0, cp 0, tp 1) on node " + figures["kill_node_ip"] in message, figures
    assert "killed by `ray.kill`" in message, figures
    assert figures["kill_failed_after_s"] < 30, figures  # at once, not after the 120 s bound
    assert "broken by an earlier failure" in figures["kill_refused"], figures
    assert figures["resumed_steps_after_load"] == 1 and figures["resumed_steps_after_step2"] == 2
    assert figures["resumed_weights1_gap_vs_dp2"] == 0.0, figures  # nothing trained twice
    assert "saved at local.megatron tp=1 pp=1 cp=1 dp=2" in figures["dp1_loads_dp2_optimizer"]
    assert figures["dp1_loads_dp2_weights_gap"] == 0.0, figures
