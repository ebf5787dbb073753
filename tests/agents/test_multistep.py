"""Multi-step Harbor tasks (`[[steps]]`) through the trial runner and the records."""

import asyncio
from pathlib import Path

import pytest
import ray

from oneloop.agents.demo_tasks import generate_tasks
from oneloop.agents.tito import Trajectory
from oneloop.agents.trials import TrialOutcome, TrialRunner, TrialRunnerConfig
from oneloop.diagnostics.records import records_from_trials_dir

GROUP_TIMEOUT_SEC = 300.0
STEPS = ("first", "second")


@pytest.fixture(scope="module")
def ray_runtime():
    """A local Ray runtime, left running: the session's `local_service` may live on it (Ray's
    exit hook shuts it down), and later modules reuse it instead of paying a start."""
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)


def two_step_task(root: Path) -> Path:
    """A demo calculator task rewritten in Harbor's multi-step layout: `[[steps]]` in task.toml,
    `steps/<name>/instruction.md`, each step verified by the shared `tests/test.sh`."""
    (task,) = generate_tasks(root, n_train=1, n_eval=0, seed=3).train
    path = task.path
    instruction = (path / "instruction.md").read_text()
    for index, name in enumerate(STEPS):
        step = path / "steps" / name
        step.mkdir(parents=True)
        (step / "instruction.md").write_text(f"Part {index + 1}. {instruction}")
    (path / "instruction.md").unlink()
    toml = (path / "task.toml").read_text()
    toml += "".join(f'\n[[steps]]\nname = "{name}"\n' for name in STEPS)
    (path / "task.toml").write_text(toml)
    return path


def test_two_step_task_counts_both_steps_and_each_step_trajectory_trains(
    ray_runtime, local_service, tiny_model_path, tmp_path
):
    """Regression: Harbor 0.25 keeps a multi-step trial's agent results under `step_results`;
    the runner read only the top level and counted the trial `ok` with 0 turns and no
    trajectory."""
    from oneloop.tiny.model import TINY_MODEL_NAME

    task = two_step_task(tmp_path / "tasks")
    client = local_service.create_sampling_client(base_model=TINY_MODEL_NAME).result()
    runner = TrialRunner(
        TrialRunnerConfig(
            trials_dir=tmp_path / "trials",
            agent_kwargs={
                "tokenizer_path": str(tiny_model_path),
                "max_turns": 1,
                "max_tokens_per_turn": 8,
                "context_window": 2048,
                "temperature": 1.0,
            },
            environment_kwargs={"root_base_dir": str(tmp_path / "roots")},
            trials_per_second=50.0,
        )
    )

    async def go():
        return await asyncio.wait_for(runner.run_group(task, 1, client), GROUP_TIMEOUT_SEC)

    (result,) = asyncio.run(go()).results
    # An untrained model hits the 8-token cap without a tool call: truncated, reward 0, trains.
    assert result.outcome in (TrialOutcome.TRUNCATED, TrialOutcome.OK), result.error
    assert not result.masked and result.trajectory is None
    assert len(result.step_trajectories) == len(result.trajectories) == 2
    stats = result.agent_stats or {}
    assert [s["step_name"] for s in stats["steps"]] == list(STEPS)
    assert stats["turns"] == 2 == sum(s["turns"] for s in stats["steps"])
    for trajectory in result.trajectories:  # the TITO digest check runs in to_datum
        datum = Trajectory.from_json(trajectory).to_datum(1.0)
        assert sum(datum.loss_fn_inputs["weights"].data) > 0
    sampled = sum(Trajectory.from_json(t).num_sampled_tokens for t in result.trajectories)
    # Timings are the sums of the steps' phases.
    from harbor.models.trial.result import TrialResult

    harbor = TrialResult.model_validate_json(
        (tmp_path / "trials" / result.trial_name / "result.json").read_text()
    )
    assert harbor.agent_execution is None and len(harbor.step_results or []) == 2

    def span(t):
        return (t.finished_at - t.started_at).total_seconds()

    agent_sum = sum(span(s.agent_execution) for s in harbor.step_results)
    verifier_sum = sum(span(s.verifier) for s in harbor.step_results)
    assert result.timings.agent_sec == pytest.approx(agent_sum) and agent_sum > 0
    assert result.timings.verifier_sec == pytest.approx(verifier_sum) and verifier_sum > 0

    # `oneloop inspect` rebuilds the same counts from the trial directory.
    (record,) = records_from_trials_dir(
        tmp_path / "trials", patterns=[], decode=None, pass_threshold=1.0
    )
    assert record["outcome"] == str(result.outcome) and record["steps"] == list(STEPS)
    assert record["turns"] == 2 and record["tokens"]["sampled"] == sampled > 0
    assert {s["step_name"] for s in record["segments"]} == set(STEPS)
    assert record["timings"]["agent_sec"] == pytest.approx(agent_sum)
