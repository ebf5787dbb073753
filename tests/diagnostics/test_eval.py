"""`oneloop eval` on real trials: a tiny model taught the demo tools, the demo task family, the
local backend, Harbor trials in the no-container environment. Report numbers are checked against
counts made here from the written trajectories.jsonl (and Harbor's own trial results), and
injected faults (an always-erroring tool, a tool that hides a traceback in a success, an
environment whose every other start fails) are attributed to that tool / to infrastructure."""

import json
import re
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from eval_support import ERROR_TOOL, TRACEBACK_TOOL, eval_run

from oneloop.diagnostics.eval_cli import main
from oneloop.diagnostics.stats import pass_at_k

TRACEBACK = re.compile(r"Traceback \(most recent call last\)")


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "trajectories.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def hand_failed(call: dict) -> bool:
    return call["status"] != "ok" or bool(TRACEBACK.search(call["result"]))


def test_pass_at_k_matches_hand_computed_values():
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(3, 3, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_bad_flags_and_unavailable_environment_fail_before_any_trial(tmp_path, capsys):
    assert main(["--samples-per-task", "0", "--run-dir", str(tmp_path / "a")]) == 2
    assert "--samples-per-task" in capsys.readouterr().err
    assert main(["--model-path", "runs/x", "--run-dir", str(tmp_path / "b")]) == 2
    assert "tinker://" in capsys.readouterr().err
    assert main(["--error-pattern", "(", "--run-dir", str(tmp_path / "c")]) == 2
    assert "--error-pattern '('" in capsys.readouterr().err
    # A production environment without its credentials: the preflight names them, no trial ran.
    code = main([
        "--run-dir", str(tmp_path / "d"), "rollout.environment_type=daytona",
    ])  # fmt: skip
    assert code == 2
    assert "DAYTONA_API_KEY" in capsys.readouterr().err
    assert not (tmp_path / "d" / "trials").exists()


@pytest.mark.timeout(1800)
def test_report_matches_a_hand_count_of_trajectories(local_service, tmp_path_factory):
    run_dir, info = eval_run(local_service, tmp_path_factory.getbasetemp(), "plain")
    records, report = rows(run_dir), summary(run_dir)
    assert len(records) == 2 * 2  # 2 tasks x k=2
    # Scores: per task c passes out of n scored samples (k = n = 2, so pass@2 = any pass).
    per_task: dict[str, list[int]] = {}
    for r in records:
        if not r["masked"]:
            per_task.setdefault(r["task"], []).append(int(r["reward"] >= 1.0))
    assert report["scores"]["pass@1"] == pytest.approx(
        sum(sum(v) / len(v) for v in per_task.values()) / len(per_task)
    )
    assert report["scores"]["pass@2"] == pytest.approx(
        sum(any(v) for v in per_task.values()) / len(per_task)
    )
    # Categories come from each task's task.toml metadata.
    categories = {
        r["task"]: tomllib.loads((Path(r["task_path"]) / "task.toml").read_text())["metadata"][
            "category"
        ]
        for r in records
    }
    for category, entry in report["categories"].items():
        names = {t for t, c in categories.items() if c == category}
        values = [v for t in names for v in per_task.get(t, [])]
        assert entry["tasks"] == len(names)
        assert entry["pass@1"] == pytest.approx(
            sum(sum(per_task[t]) / len(per_task[t]) for t in names) / len(names)
        )
        assert entry["reward_mean"] == pytest.approx(sum(values) / len(values))
    # Outcome classes and the non-model error rate.
    outcomes = Counter(r["outcome"] for r in records)
    assert {k: v for k, v in report["outcomes"]["final"].items() if v} == dict(outcomes)
    attempts = sum(r["attempts"] for r in records)
    infra = sum(r["attempts"] - 1 + (r["outcome"] == "infra_error") for r in records)
    assert report["outcomes"]["attempts"] == attempts
    assert report["outcomes"]["non_model_error_rate"] == pytest.approx(infra / attempts)
    # Tools: the taught model really called tools; per-tool and per-server counts by hand.
    calls = [c for r in records for c in r["tool_calls"]]
    assert calls, "the taught model made no tool call"
    for tool, entry in report["tools"].items():
        mine = [c for c in calls if c["tool"] == tool]
        assert entry["calls"] == len(mine)
        assert entry["failed"] == sum(hand_failed(c) for c in mine)
    assert sum(e["calls"] for e in report["tools"].values()) == len(calls)
    assert report["servers"]["calculator"]["calls"] == len(calls)
    # The per-call records agree with the agent's own counters in Harbor's result.json.
    for r in records:
        result = json.loads((run_dir / "trials" / r["trial_name"] / "result.json").read_text())
        stats = result["agent_result"]["metadata"]["tool_stats"]
        assert {t: s["calls"] for t, s in stats.items() if s["calls"]} == dict(
            Counter(c["tool"] for c in r["tool_calls"])
        )
        # Turns = sampled segments; the mask marks exactly the sampled segments.
        sampled = [s for s in r["segments"] if s["kind"] == "sampled"]
        assert r["turns"] == len(sampled)
        assert all(s["trained"] == (s["kind"] == "sampled") for s in r["segments"])
    agent = report["agent"]
    assert agent["turns_mean"] == pytest.approx(sum(r["turns"] for r in records) / len(records))
    assert agent["sampled_tokens"] == sum(
        s["tokens"] for r in records for s in r["segments"] if s["kind"] == "sampled"
    )
    assert report["time"]["llm_sec"] == pytest.approx(sum(r["timings"]["llm_sec"] for r in records))
    text = (run_dir / "report.md").read_text()
    assert "| Pass@1 |" in text and "Non-model error rate" in text
    for tool in report["tools"]:
        assert f"| {tool} |" in text
    for plot in ("outcomes", "tools", "categories", "time"):
        assert (run_dir / "plots" / f"{plot}.png").stat().st_size > 1000


@pytest.mark.timeout(1800)
def test_injected_faults_are_attributed_to_the_tool_and_to_infrastructure(
    local_service, tmp_path_factory
):
    base = tmp_path_factory.getbasetemp()
    run_dir, _ = eval_run(local_service, base, "faults")
    records, report = rows(run_dir), summary(run_dir)
    assert len(records) == 2 * 2
    # Every other environment start failed (the env's own counter); all were retried to success.
    starts = int((base / "flaky-starts.txt").read_text())
    injected = (starts + 1) // 2
    assert all(r["outcome"] != "infra_error" for r in records)
    assert report["outcomes"]["attempts"] == sum(r["attempts"] for r in records) == starts
    assert report["outcomes"]["infra_attempts"] == injected
    assert report["outcomes"]["non_model_error_rate"] == pytest.approx(0.5)
    errors = [e for r in records for e in r["attempt_errors"]]
    assert len(errors) == injected and all("injected flaky start" in e for e in errors)
    (error_class,) = report["outcomes"]["infra_error_classes"]
    assert error_class.startswith("EnvironmentStartError: injected flaky start")
    # The always-erroring tool: every call failed by the is_error flag.
    calls = [c for r in records for c in r["tool_calls"]]
    broken = [c for c in calls if c["tool"] == ERROR_TOOL]
    assert broken, f"the taught model never called {ERROR_TOOL}"
    assert all(c["status"] == "is_error" and c["failure"] == "is_error" for c in broken)
    tools = report["tools"]
    assert tools[ERROR_TOOL]["failed"] == tools[ERROR_TOOL]["calls"] == len(broken)
    assert tools[ERROR_TOOL]["success_rate"] == 0.0
    assert tools[ERROR_TOOL]["failures"] == {"is_error": len(broken)}
    # The tool that hides a traceback in a success: caught only by the error pattern.
    hidden = [c for c in calls if c["tool"] == TRACEBACK_TOOL]
    assert hidden, f"the taught model never called {TRACEBACK_TOOL}"
    assert all(c["status"] == "ok" and TRACEBACK.search(c["result"]) for c in hidden)
    assert tools[TRACEBACK_TOOL]["failures"] == {f"pattern:{TRACEBACK.pattern}": len(hidden)}
    # Other tools are not blamed.
    for tool, entry in tools.items():
        if tool not in (ERROR_TOOL, TRACEBACK_TOOL):
            assert entry["failed"] == sum(hand_failed(c) for c in calls if c["tool"] == tool)
    text = (run_dir / "report.md").read_text()
    assert re.search(rf"\| {ERROR_TOOL} \| {len(broken)} \| {len(broken)} \| 0 \| is_error", text)
    assert "**Non-model error rate: 0.5**" in text


@pytest.mark.timeout(1200)
def test_eval_on_the_tinker_backend_through_the_official_sdk(
    local_service, tmp_path, tmp_path_factory
):
    """`--backend tinker`: the SDK's clients against `oneloop serve` (only the URL differs from
    a hosted Tinker service); the taught checkpoint is sampled by path, greedily."""
    from eval_support import taught

    from oneloop.backends.megatron_local.serve import ServeConfig, ServerThread

    info = taught(local_service, tmp_path_factory.getbasetemp())
    with ServerThread(ServeConfig(port=0), local_service) as server:
        code = main([
            "--backend", "tinker", "--base-url", server.base_url, "--api-key", "tml-loopback",
            "--model-path", info["checkpoint"], "--run-dir", str(tmp_path / "run"),
            "--samples-per-task", "1", "--temperature", "0", "--tasks", "1",
            "model.base_model=oneloop/tiny-qwen3", f"tasks.dir={info['tasks_dir']}", "sft=null",
            "agent.max_turns=1", "agent.max_tokens_per_turn=40", "logging.console=false",
        ])  # fmt: skip
    assert code == 0
    (record,) = rows(tmp_path / "run")
    settings = summary(tmp_path / "run")["settings"]
    assert settings["backend"] == "tinker" and settings["model"] == info["checkpoint"]
    # The taught first turn is a tool call, sampled through the SDK and executed by the agent.
    assert record["outcome"] == "ok" and record["turns"] == 1
    assert [c["status"] for c in record["tool_calls"]] == ["ok"]
