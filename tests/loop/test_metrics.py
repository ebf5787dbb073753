"""MetricsLogger / read_metrics / truncate_after and write_plots on real files."""

import json
import sys

import numpy as np
import pytest

from oneloop.errors import ConfigError
from oneloop.loop.metrics import MetricsLogger, read_metrics, truncate_after
from oneloop.loop.plots import write_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _log_steps(run_dir, steps, **kwargs):
    with MetricsLogger(run_dir, console=False, **kwargs) as logger:
        for step in steps:
            logger.log(step, {"train/loss": 1.0 / (step + 1), "rollout/reward_mean": 0.1 * step})


def test_jsonl_round_trip_keeps_namespaced_keys(tmp_path):
    metrics = {
        "rollout/reward_mean": 0.25,
        "train/loss": 1.5,
        "time/wait_for_rollouts": 0.0,
        "staleness/hist_0": 4,
        "rollout/in_flight": np.int64(7),
        "train/lr": np.float32(0.5),
    }
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(0, metrics)
        logger.log(1, {"train/loss": 1.25})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records == [
        {
            "step": 0,
            "rollout/reward_mean": 0.25,
            "train/loss": 1.5,
            "time/wait_for_rollouts": 0.0,
            "staleness/hist_0": 4,
            "rollout/in_flight": 7,
            "train/lr": 0.5,
        },
        {"step": 1, "train/loss": 1.25},
    ]
    assert isinstance(records[0]["staleness/hist_0"], int)


def test_each_log_line_is_on_disk_before_close(tmp_path):
    logger = MetricsLogger(tmp_path, console=False)
    logger.log(3, {"train/loss": 2.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 3, "train/loss": 2.0}]
    logger.close()
    logger.close()  # idempotent


@pytest.mark.parametrize(
    ("metrics", "match"),
    [
        ({"loss": 1.0}, "'loss' is not namespaced"),
        ({"/loss": 1.0}, "not namespaced"),
        ({"train/": 1.0}, "not namespaced"),
        ({"train/loss": "1.0"}, "'train/loss' must be a real number"),
        ({"train/ok": True}, "'train/ok' must be a real number"),
        ({"train/loss": None}, "'train/loss' must be a real number"),
    ],
)
def test_bad_metrics_are_rejected_naming_the_key(tmp_path, metrics, match):
    with MetricsLogger(tmp_path, console=False) as logger:
        with pytest.raises(ValueError, match=match):
            logger.log(0, metrics)
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_steps_must_increase(tmp_path):
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(2, {"train/loss": 1.0})
        with pytest.raises(ValueError, match="step 2 <= last logged step 2"):
            logger.log(2, {"train/loss": 1.0})
        with pytest.raises(ValueError, match="step must be an int"):
            logger.log(-1, {"train/loss": 1.0})


def test_torn_last_line_is_skipped(tmp_path):
    _log_steps(tmp_path, range(3))
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 3, "train/lo')  # crash mid-write
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]


def test_complete_last_line_without_newline_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "train/loss": 1.0}\n{"step": 1, "train/loss": 0.5}')
    assert [r["step"] for r in read_metrics(path)] == [0, 1]


def test_corrupt_middle_line_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "tr\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(path)
    path.write_text('{"step": 0}\n{"train/loss": 1.0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2.*int 'step'"):
        read_metrics(path)


def test_truncate_after_drops_later_steps_atomically(tmp_path):
    _log_steps(tmp_path, range(6))
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 6, "tr')
    truncate_after(path, 3)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    assert path.read_text().endswith("\n")
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    truncate_after(tmp_path / "missing.jsonl", 3)  # nothing logged yet: nothing to do
    assert not (tmp_path / "missing.jsonl").exists()


def test_resume_appends_and_fresh_start_replaces(tmp_path):
    _log_steps(tmp_path, range(4))
    path = tmp_path / "metrics.jsonl"
    truncate_after(path, 1)
    _log_steps(tmp_path, [2, 3], resume=True)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    _log_steps(tmp_path, [0], resume=False)
    assert [r["step"] for r in read_metrics(path)] == [0]


def test_resume_without_truncating_refuses_an_old_step(tmp_path):
    _log_steps(tmp_path, range(4))
    with MetricsLogger(tmp_path, console=False, resume=True) as logger:
        with pytest.raises(ValueError, match="truncate_after"):
            logger.log(2, {"train/loss": 1.0})


def test_resume_after_a_torn_line_does_not_glue_records(tmp_path):
    """Regression: appending after a torn last line would merge it with the next record."""
    _log_steps(tmp_path, range(2))
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 2, "train/lo')
    _log_steps(tmp_path, [2], resume=True)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]


def test_console_line_shows_progress_fields(tmp_path, capsys):
    with MetricsLogger(tmp_path) as logger:
        logger.log(
            7,
            {
                "rollout/reward_mean": 0.5,
                "staleness/max": 2,
                "rollout/in_flight": 12,
                "time/trainer_busy_frac": 0.875,
                "train/loss": 3.0,
            },
        )
        logger.log(8, {"train/loss": 3.0})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("step 7 | reward 0.500 | stale max 2 | in flight 12 | trainer busy 88%")
    assert lines[1] == "step 8"


def test_console_off_prints_nothing(tmp_path, capsys):
    _log_steps(tmp_path, range(2))
    assert capsys.readouterr().out == ""


def test_wandb_enabled_but_not_installed_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ConfigError, match="logging.wandb"):
        MetricsLogger(tmp_path, console=False, wandb={"project": "p"})
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_enabled_but_not_installed_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="logging.tensorboard"):
        MetricsLogger(tmp_path, console=False, tensorboard=True)


# -- plots -----------------------------------------------------------------------------------


def _write_records(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(text)


def test_all_plots_written_as_png(tmp_path):
    records = [
        {
            "step": step,
            "rollout/reward_mean": 0.1 * step,
            "eval/reward_mean": 0.2 * step,
            "staleness/mean": 1.0,
            "staleness/max": 2,
            "train/logprob_gap_mean": 0.01,
            "train/logprob_gap_max": 0.1,
            "train/kl_sample_train": 0.001,
            "time/wait_for_rollouts": 0.5,
            "time/train": 2.0,
            "time/trainer_busy_frac": 0.8,
        }
        for step in range(5)
    ]
    _write_records(tmp_path, records)
    paths = write_plots(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["logprob_gap.png", "reward.png", "staleness.png", "timings.png"]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        assert path.read_bytes().startswith(PNG_MAGIC)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == names  # no temp files


def test_plot_with_absent_keys_is_skipped(tmp_path):
    records = [
        {"step": 0, "rollout/reward_mean": 0.0, "time/train": 1.0},
        {"step": 1, "rollout/reward_mean": float("nan"), "time/train": 1.5, "train/loss": 2.0},
    ]
    _write_records(tmp_path, records)
    paths = write_plots(tmp_path)
    assert sorted(p.name for p in paths) == ["reward.png", "timings.png"]
    assert not (tmp_path / "plots" / "staleness.png").exists()
    assert not (tmp_path / "plots" / "logprob_gap.png").exists()


def test_eval_only_still_draws_the_reward_plot(tmp_path):
    _write_records(tmp_path, [{"step": 0, "eval/accuracy": 0.5}])
    assert [p.name for p in write_plots(tmp_path)] == ["reward.png"]


def test_plots_from_a_logger_written_file(tmp_path):
    _log_steps(tmp_path, range(3))
    assert [p.name for p in write_plots(tmp_path)] == ["reward.png"]


def test_empty_metrics_writes_nothing_and_missing_file_is_an_error(tmp_path):
    _write_records(tmp_path, [])
    assert write_plots(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_plots(tmp_path / "nope")


def test_backend_counters_give_per_step_restarts_on_local_and_nothing_on_tinker(local_service):
    """`backend/sampler_restarts` per step from the local backend's hook (a real Ray restart of
    its sampler actor); the tinker SDK's ServiceClient has no hook, so no `backend/` keys."""
    import asyncio
    import time

    import ray
    import tinker

    from oneloop.loop.metrics import BackendCounters, ReportsBackendMetrics

    assert not issubclass(tinker.ServiceClient, ReportsBackendMetrics)
    assert asyncio.run(BackendCounters(object()).step_metrics(5.0)) == {}
    (actor,) = local_service.sampler_pool(local_service.resolve_model("oneloop/tiny-qwen3")).actors
    ray.get(actor.ready.remote(), timeout=300)
    counters = BackendCounters(local_service)
    asyncio.run(counters.step_metrics(30.0))  # restarts before now (other tests) are not ours
    ray.kill(actor, no_restart=False)  # a crash: Ray restarts the actor
    deadline = time.monotonic() + 300
    # The kill is asynchronous: a `ready` may still be answered by the dying actor, and the GCS
    # records the restart when it happens. Sum the per-step deltas until the restart shows.
    seen = 0.0
    while seen < 1.0:
        assert time.monotonic() < deadline, "the restart never showed in the counters"
        try:
            ray.get(actor.ready.remote(), timeout=300)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            time.sleep(0.5)  # still restarting
        seen += asyncio.run(counters.step_metrics(30.0))["backend/sampler_restarts"]
    assert seen == 1.0
    assert asyncio.run(counters.step_metrics(30.0)) == {"backend/sampler_restarts": 0.0}
