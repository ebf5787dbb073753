"""Regression (issue 21): with a policy that solves nothing every group has zero reward
variance and is dropped, and the loop waited for `timeouts.wait_for_rollouts_s` (30 min) with
nothing on the console. Now, on the real loop (the untrained tiny model, which cannot answer in
four tokens: every trial scores 0), it prints progress while it waits, warns while the groups are
dropped, and stops at `algo.max_zero_variance_in_a_row` with the counts and the advice to run
`oneloop eval` first."""

import asyncio
import logging
import re

import pytest

from oneloop.loop.config import TrainConfig, load_config
from oneloop.loop.metrics import read_metrics
from oneloop.loop.rollouts import NoTrainableGroupsError
from oneloop.loop.train import train

BOUND = 6


@pytest.mark.timeout(600)
def test_a_policy_that_solves_nothing_stops_with_the_counts(
    tmp_path, local_service, capsys, caplog
):
    cfg = load_config(
        "demo-cpu",
        [
            f"run_dir={tmp_path / 'run'}",
            f"backend.run_dir={tmp_path / 'backend'}",
            "backend.local.torch_threads=1",
            "model.base_model=oneloop/tiny-qwen3",
            "sft=null",
            "eval=null",
            "tasks.demo.n_train=8",
            "algo.groups_per_step=2",
            "algo.group_size=2",
            "algo.max_staleness=0",
            f"algo.max_zero_variance_in_a_row={BOUND}",
            "agent.max_turns=1",
            "agent.max_tokens_per_turn=4",
            "logging.wait_progress_s=0.1",
        ],
    )
    with caplog.at_level(logging.WARNING), pytest.raises(NoTrainableGroupsError) as stopped:
        asyncio.run(train(cfg))
    message = str(stopped.value)
    assert message.startswith(
        f"algo.max_zero_variance_in_a_row: {BOUND} rollout groups in a row were dropped"
    ), message
    finished = int(re.search(r"(\d+) groups finished", message)[1])
    dropped = int(re.search(r"(\d+) dropped for zero variance", message)[1])
    assert finished == dropped >= BOUND and "0 accepted" in message, message
    assert "run `oneloop eval` on them first" in message
    # The bound is progress within 60 s of the wait starting: the default's interval.
    assert TrainConfig().logging.wait_progress_s <= 60
    waits = [line for line in capsys.readouterr().out.splitlines() if "waiting" in line]
    assert waits and waits[0].startswith("step 1 waiting"), waits
    assert re.search(r"0/2 ready; \d+ groups finished \(\d+ dropped for zero variance", waits[-1])
    warnings = [r.getMessage() for r in caplog.records if "zero reward variance" in r.getMessage()]
    assert warnings and "the run stops at 6" in warnings[-1], warnings
    # Nothing was trained or checkpointed.
    assert not [r for r in read_metrics(cfg.run_dir / "metrics.jsonl") if r["step"] > 0]
    assert not (cfg.run_dir / "checkpoints.jsonl").exists()
