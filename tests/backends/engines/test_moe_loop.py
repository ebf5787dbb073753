"""The training loop runs two RL steps on the tiny Qwen3-MoE model with rollout routing replay on
(local backend, torch engines): the sampler's routed experts travel with each trajectory (through
the trials' JSON) to forward_backward, and the replay metrics reach metrics.jsonl and
`oneloop inspect`."""

import pytest

from oneloop.diagnostics.inspect_cli import ROUTING_COLUMNS, train_steps
from oneloop.tiny.model import TINY_QWEN3_MOE

MOE_RUN = [
    "algo.max_steps=2",
    "algo.groups_per_step=2",
    "algo.group_size=2",
    "algo.max_staleness=0",
    "algo.filter_zero_variance=false",
    "algo.routing_replay=true",
    "tasks.demo.n_train=4",
    "agent.max_turns=2",
    "agent.max_tokens_per_turn=12",
    f"model.base_model={TINY_QWEN3_MOE}",
    "sft=null",
    "eval=null",
    "logging.console=false",
]


@pytest.mark.timeout(900)
def test_loop_runs_two_rl_steps_on_tiny_moe_with_routing_replay(tmp_path, train_script):
    run_dir = tmp_path / "run"
    train_script.run(run_dir, tmp_path / "backend", *MOE_RUN)
    steps = list(train_script.steps(run_dir).values())
    assert [x["step"] for x in steps] == [1, 2]
    for step in steps:
        # replay reached the trainer: every trained position had a recorded routing
        assert 0.0 <= step["train/routing_differ_frac"] <= 1.0
        # fp32, S = 0: sampler and trainer agree to float noise, with and without replay
        assert step["train/logprob_gap_replay_mean"] < 1e-5
        assert step["train/logprob_gap_free_mean"] < 1e-5
        assert step["train/logprob_gap_mean"] == pytest.approx(
            step["train/logprob_gap_replay_mean"], abs=1e-6
        )
    shown = train_steps(run_dir)
    assert all(row[c] is not None for row in shown for c in ROUTING_COLUMNS)
