"""The loop trains on gateway trajectories: `agent.kind: openai_gateway` end to end (the train
script as a subprocess), and the gateway's counters reach metrics.jsonl and `oneloop inspect`."""

import pytest

from oneloop.diagnostics.inspect_cli import main as inspect_main
from tests.loop.test_train_script import SMALL

GATEWAY_RUN = [o for o in SMALL if not o.startswith(("sft.", "eval."))] + [
    "agent.kind=openai_gateway", "sft=null", "eval=null", "checkpoint.every_steps=2",
]  # fmt: skip


@pytest.mark.slow
def test_loop_trains_two_rl_steps_on_gateway_trajectories(tmp_path, train_script):
    run_dir = tmp_path / "run"
    train_script.run(run_dir, tmp_path / "backend", *GATEWAY_RUN, timeout=600)
    steps = train_script.steps(run_dir)
    assert sorted(steps) == [1, 2]
    for row in steps.values():
        assert row["train/datums"] >= 2
        assert row["staleness/violations"] == 0
        # S = 0: sampled on the weights trained from, so trainer and sampler agree on the tokens.
        assert row["train/logprob_gap_mean"] < 1e-3
        assert row["rollout/gateway_requests"] >= row["train/datums"]
        assert row["rollout/gateway_new_segments"] >= row["train/datums"]
    assert inspect_main([str(run_dir)]) == 0
    assert "rollout/gateway_new_segments" in (run_dir / "inspect.md").read_text()
