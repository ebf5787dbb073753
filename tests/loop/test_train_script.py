"""Contract tests of the one training script: it runs steps end to end, as a subprocess, and
rejects bad configs by dotted path before anything starts."""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from oneloop.backends.capabilities import TINKER_SERVICE, local_capabilities
from oneloop.errors import CapabilityError, ConfigError
from oneloop.loop.config import load_config, preset_names
from oneloop.loop.train import check_capabilities
from tests.loop.test_sft_data import conversation, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "algo.max_steps=2",
    "algo.groups_per_step=2",
    "algo.group_size=2",
    "algo.max_staleness=0",
    "algo.filter_zero_variance=false",
    "tasks.demo.n_train=4",
    "tasks.demo.n_eval=2",
    "sft.steps=2",
    "model.base_model=oneloop/tiny-qwen3",
    "sft.batch_size=2",
    "agent.max_turns=2",
    "agent.max_tokens_per_turn=16",
    "eval.n_tasks=2",
    "checkpoint.every_steps=1",
    "logging.console=false",
]


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ("algo.nope=1", "algo.nope"),
        ("algo.groups_per_step=many", "algo.groups_per_step"),
        ("algo.max_staleness=-1", "algo.max_staleness"),
        ("algo.loss_fn=cross_entropy", "algo.loss_fn"),
        ("backend.local.dtype=fp8", "backend.local.dtype"),
    ],
)
def test_config_errors_name_the_dotted_path(override, path):
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        load_config("demo-cpu", [override])


LORA = "model.lora_rank=8"


@pytest.mark.parametrize(
    ("row", "overrides", "kind", "path"),
    [
        # Thinking Machines' service trains LoRA only; demo-cpu fine-tunes fully (rank 0).
        (TINKER_SERVICE, [], "inflight", "model.lora_rank"),
        # The vllm sampler holds one live set of full weights: inflight clients only (LoRA runs
        # get snapshots too, each version its own LoRA module).
        (local_capabilities(64, sampler_engine="vllm"), [], "snapshot", "algo.sampler_kind"),
        # A Tinker-compatible server that implements fewer losses than Tinker's built-ins.
        (
            replace(TINKER_SERVICE, losses=frozenset({"cross_entropy"})),
            [LORA, "algo.loss_fn=ppo"],
            "inflight",
            "algo.loss_fn",
        ),
        (
            replace(TINKER_SERVICE, losses=frozenset({"ppo"})),
            [LORA, "algo.loss_fn=ppo"],
            "inflight",
            "sft",
        ),
    ],
)
def test_unsupported_knob_names_the_dotted_path(row, overrides, kind, path):
    """A loss, sampler kind, rank the backend cannot honour: CapabilityError led by the key."""
    cfg = load_config("demo-cpu", overrides)
    with pytest.raises(CapabilityError, match=f"^{re.escape(path)}: "):
        check_capabilities(row, cfg, kind)


def test_lora_runs_get_snapshots_on_vllm_full_fine_tuning_does_not():
    row = local_capabilities(64, sampler_engine="vllm")
    check_capabilities(row, load_config("demo-cpu", [LORA]), "snapshot")
    with pytest.raises(CapabilityError, match="full fine-tuning run"):
        check_capabilities(row, load_config("demo-cpu", []), "snapshot")


@pytest.mark.timeout(300)
def test_unsupported_knob_stops_the_script_before_anything_starts(tmp_path, train_script):
    """The capability check runs in setup, before tasks, SFT, trials or metrics exist."""
    import subprocess

    run_dir = tmp_path / "run"
    overrides = ["backend.local.sampler_engine=vllm", "algo.sampler_kind=snapshot"]
    done = subprocess.run(
        train_script.command(run_dir, tmp_path / "backend", *overrides),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 2, done.stderr[-4000:]
    assert "config error: algo.sampler_kind: sampler kind 'snapshot'" in done.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == []


@pytest.mark.timeout(1500)
def test_train_script_runs_two_steps(tmp_path, train_script):
    """Two RL steps end to end, after a warm start from a conversation file the user wrote
    (`sft.data: <path>`): the warm start reads that file, not the demo generator's (the demo path
    runs in test_backend_parity)."""
    records = [conversation(a, a + 1, string_arguments=a == 2) for a in (1, 2, 3, 4, 5)]
    data = write_jsonl(tmp_path / "my-sft.jsonl", records)
    run_dir = tmp_path / "run"
    done = train_script.run(run_dir, tmp_path / "backend", *SMALL, "sft.lr_schedule=linear",
                            "sft.learning_rate=0.004", f"sft.data={data}")  # fmt: skip
    assert f"sft.data: 5 conversations from {data}" in done.stderr
    warm = [row for row in train_script.rows(run_dir) if "sft/steps" in row]
    # 5 conversations in the file; the demo generator would have given tasks.demo.n_train = 4.
    assert [(row["sft/examples"], row["sft/steps"]) for row in warm] == [(5.0, 2.0)]
    assert not (run_dir / "tasks" / "demonstrations.jsonl").exists()
    steps = list(train_script.steps(run_dir).values())
    assert [x["step"] for x in steps] == [1, 2]
    assert all(x["staleness/violations"] == 0 for x in steps)
    assert all("train/logprob_gap_mean" in x for x in steps)
    # S = 0: every group is sampled on the weights it is trained from, so the gap is numerics only.
    assert max(x["train/logprob_gap_mean"] for x in steps) < 1e-3
    checkpoints = [json.loads(c) for c in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    # The warm start is checkpointed (step 0), its line repeated with the eval's figures.
    assert [c["step"] for c in checkpoints] == [0, 0, 1, 2]
    assert checkpoints[0]["warm_start"]["sft/steps"] == 2.0 and not checkpoints[0]["eval_before"]
    assert "eval_before/success_rate" in checkpoints[1]["eval_before"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "eval_before/success_rate" in summary and "eval_after/success_rate" in summary
    phases = {k: v for k, v in summary.items() if k.startswith("time/phase_")}
    names = ("setup", "sft", "eval_before", "rl", "eval_after")
    assert sorted(phases) == sorted(f"time/phase_{n}_s" for n in names)
    assert all(v > 0 for v in phases.values())
    # Two warm-start steps decaying linearly from 0.004: the last ran at 0.004 * (1 - 1/2).
    sft = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["sft/learning_rate_last"] for m in sft if "sft/steps" in m] == [0.002]
    assert (run_dir / "trajectories.jsonl").is_file()

    # Regression: a run that died after its warm start redid the whole SFT on --resume (nothing
    # was checkpointed before RL step 1). Cut the run back to its warm-start checkpoint, resume.
    lines = (run_dir / "checkpoints.jsonl").read_text().splitlines()
    (run_dir / "checkpoints.jsonl").write_text(lines[0] + "\n")
    again = train_script.run(run_dir, tmp_path / "backend", *SMALL, "sft.lr_schedule=linear",
                             "sft.learning_rate=0.004", f"sft.data={data}", "--resume")  # fmt: skip
    assert "sft.data:" not in again.stderr  # the warm start's data was not even read
    rows = train_script.rows(run_dir)
    step0 = [row for row in rows if row["step"] == 0]
    assert len(step0) == 1 and step0[0]["sft/learning_rate_last"] == 0.002  # logged once, kept
    assert "eval_before/success_rate" in step0[0]
    assert sorted(train_script.steps(run_dir)) == [1, 2]


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_validates_on_both_backends(preset):
    for backend in ("local", "tinker"):
        cfg = load_config(preset, [f"backend.backend={backend}"])
        assert cfg.backend.backend == backend


@pytest.mark.timeout(300)
def test_demo_answers_bad_overrides_and_refused_knobs_with_one_line(tmp_path, capsys):
    """`oneloop demo` ends early as `oneloop train` does: exit 2 and a `config error:` line, for a
    bad dotted override (before anything starts) and for a knob the backend refuses in setup."""
    from oneloop.loop.cli import demo

    assert demo([f"run_dir={tmp_path / 'a'}", "algo.group_size=zero"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and "algo.group_size" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists()
    refused = ["backend.local.sampler_engine=vllm", "algo.sampler_kind=snapshot"]
    assert demo([f"run_dir={tmp_path / 'b'}", f"backend.run_dir={tmp_path / 'c'}", *refused]) == 2
    err = capsys.readouterr().err
    assert "config error: algo.sampler_kind: sampler kind 'snapshot'" in err, err
