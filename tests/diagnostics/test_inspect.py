"""`oneloop inspect RUN_DIR` on real runs: an `oneloop eval` run with injected faults (shared with
test_eval through eval_support) and a one-step training run of the real loop. Numbers are checked
against counts made here from the files the runs wrote."""

import asyncio
import json
from pathlib import Path

import pytest
from eval_support import ERROR_TOOL, TRACEBACK_TOOL, eval_run

from oneloop.diagnostics.inspect_cli import main


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def hand_repairs(records: list[dict]) -> tuple[int, int]:
    """(failed calls, failed calls followed later by an ok call of the same tool)."""
    failed = repaired = 0
    for record in records:
        calls = record["tool_calls"]
        for i, call in enumerate(calls):
            if call["failed"]:
                failed += 1
                repaired += any(
                    c["tool"] == call["tool"] and not c["failed"] for c in calls[i + 1 :]
                )
    return failed, repaired


@pytest.mark.timeout(1800)
def test_inspect_eval_run_names_the_worst_tools_and_re_judges_patterns(
    local_service, tmp_path_factory, capsys
):
    run_dir, _ = eval_run(local_service, tmp_path_factory.getbasetemp(), "faults")
    records = read_jsonl(run_dir / "trajectories.jsonl")
    assert main([str(run_dir)]) == 0
    assert "inspect.md" in capsys.readouterr().out
    data = json.loads((run_dir / "inspect.json").read_text())
    assert data["kind"] == "eval" and data["k"] == 2
    (step,) = data["steps"].values()  # an eval run is one step
    assert step["trajectories"] == len(records)
    assert step["non_model_error_rate"] == pytest.approx(0.5)
    calls = [c for r in records for c in r["tool_calls"]]
    assert step["tool_calls"] == len(calls)
    worst = {w["tool"]: w for w in data["worst_tools"]}
    assert worst[ERROR_TOOL]["success_rate"] == 0.0
    assert worst[TRACEBACK_TOOL]["success_rate"] == 0.0
    assert list(worst)[:2] == sorted([ERROR_TOOL, TRACEBACK_TOOL], key=lambda t: (
        -worst[t]["failed"], t
    ))  # fmt: skip
    assert "Traceback (most recent call last)" in worst[TRACEBACK_TOOL]["example"]["result"]
    assert (run_dir / "trials" / worst[ERROR_TOOL]["example_trial"]).is_dir()
    failed, repaired = hand_repairs(records)
    assert data["summary"]["repairs"]["failed_calls"] == failed
    assert data["summary"]["repairs"]["repaired"] == repaired
    assert data["largest_gaps"] is None
    text = (run_dir / "inspect.md").read_text()
    assert "## Worst tools" in text and f"| {ERROR_TOOL} |" in text
    assert "Not available for an eval run" in text
    # Without the traceback pattern the hidden failure is invisible: the tool looks healthy.
    assert main([str(run_dir), "--error-pattern", ""]) == 0
    data = json.loads((run_dir / "inspect.json").read_text())
    assert data["summary"]["tools"][TRACEBACK_TOOL]["failed"] == 0
    assert data["summary"]["tools"][ERROR_TOOL]["success_rate"] == 0.0


@pytest.mark.timeout(1800)
def test_inspect_training_run_joins_logprob_gaps_to_trials(tmp_path, capsys):
    from oneloop.loop.config import load_config
    from oneloop.loop.train import train

    run_dir = tmp_path / "run"
    cfg = load_config("demo-cpu", [
        f"run_dir={run_dir}", f"backend.run_dir={tmp_path / 'backend'}",
        "backend.local.torch_threads=1", "model.base_model=oneloop/tiny-qwen3", "sft=null",
        "eval=null", "tasks.demo.n_train=2", "tasks.demo.n_eval=1", "algo.max_steps=1",
        "algo.groups_per_step=1", "algo.group_size=2", "algo.max_staleness=0",
        "algo.filter_zero_variance=false", "agent.max_turns=1", "agent.max_tokens_per_turn=8",
        "checkpoint.every_steps=1", "logging.console=false",
    ])  # fmt: skip
    asyncio.run(train(cfg))
    gaps = read_jsonl(run_dir / "logprob_gaps.jsonl")
    assert [g["step"] for g in gaps] == [1, 1]  # one trained group of 2
    # The per-trajectory gaps reproduce the loop's own token-weighted step metric.
    (metrics,) = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    weighted = sum(g["gap_mean"] * g["tokens"] for g in gaps) / sum(g["tokens"] for g in gaps)
    assert weighted == pytest.approx(metrics["train/logprob_gap_mean"], rel=1e-6, abs=1e-9)

    assert main([str(run_dir)]) == 0
    data = json.loads((run_dir / "inspect.json").read_text())
    assert data["kind"] == "train"
    trials = sorted((run_dir / "trials").glob("*/result.json"))
    # Two trials sampled on version 0 were trained. The producers may already have started the
    # next group on version 1 when the run ended (async by design), so more trials can exist.
    assert data["steps"]["0"]["trajectories"] == 2 and len(trials) >= 2
    # Each gap row is joined to the Harbor trial that sampled it (by the TITO digest).
    digests = {}
    for path in trials:
        metadata = (json.loads(path.read_text()).get("agent_result") or {}).get("metadata") or {}
        segments = (metadata.get("tito") or {}).get("segments", [])
        sampled = [s for s in segments if s["kind"] == "sampled"]
        if sampled:
            digests[sampled[0]["digest"]] = path.parent.name
    largest = data["largest_gaps"]
    assert [g["gap_mean"] for g in largest] == sorted((g["gap_mean"] for g in gaps), reverse=True)
    assert {g["trial_name"] for g in largest} == {digests[g["digest"]] for g in gaps}
    assert [row["step"] for row in data["train_steps"]] == [1]
    text = (run_dir / "inspect.md").read_text()
    assert "## Largest trainer-vs-sampler logprob gaps" in text
    assert all(f"| {digests[g['digest']]} |" in text for g in gaps)
    assert (run_dir / "plots" / "inspect_steps.png").is_file()
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "not a directory" in capsys.readouterr().err
