"""The trial runner on real Ray tasks and real Harbor trials in the no-container environment."""

import asyncio
import json
import shutil
import uuid
from pathlib import Path

import pytest
import ray
from tinker import types

from oneloop.agents.demo_tasks import Fault, generate_tasks
from oneloop.agents.trials import (
    GroupResult,
    MaskReason,
    TrialOutcome,
    TrialRunner,
    TrialRunnerConfig,
    classify,
)
from oneloop.errors import ConfigError

GROUP_TIMEOUT_SEC = 300.0


@pytest.fixture(scope="session")
def ray_runtime():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def oracle_config(tmp_path: Path, **overrides) -> TrialRunnerConfig:
    return TrialRunnerConfig(
        trials_dir=tmp_path / "trials",
        agent_import_path=None,
        agent_name=overrides.pop("agent_name", "oracle"),
        environment_kwargs={"root_base_dir": str(tmp_path / "roots")},
        trials_per_second=50.0,
        **overrides,
    )


def run(runner: TrialRunner, task: Path, n: int) -> GroupResult:
    async def go() -> GroupResult:
        return await asyncio.wait_for(runner.run_group(task, n, None), GROUP_TIMEOUT_SEC)

    return asyncio.run(go())


def test_oracle_group_gets_reward_one_and_wrong_answer_zero(ray_runtime, tmp_path: Path) -> None:
    splits = generate_tasks(tmp_path / "tasks", n_train=2, n_eval=0, seed=11)
    runner = TrialRunner(oracle_config(tmp_path))
    group = run(runner, splits.train[0].path, 3)
    assert not group.masked
    assert [r.outcome for r in group.results] == [TrialOutcome.OK] * 3
    assert group.rewards == (1.0, 1.0, 1.0)
    assert all(r.attempts == 1 and r.error is None for r in group.results)
    assert all(r.timings.env_start_sec > 0 and r.timings.verifier_sec > 0 for r in group.results)
    assert len({r.trial_name for r in group.results}) == 3

    wrong = splits.train[1]
    solve = wrong.path / "solution" / "solve.sh"
    solve.write_text(solve.read_text().replace(
        f"echo {wrong.question.answer} ", f"echo {wrong.question.answer * 2 + 1} "
    ))  # fmt: skip
    group = run(runner, wrong.path, 2)
    assert not group.masked
    assert group.rewards == (0.0, 0.0)
    counts = runner.counters()
    assert counts["trials/final_ok"] == 5
    assert counts["trials/attempts_infra_error"] == 0
    assert counts["groups/total"] == 2


ISOLATION_SOLVE = """#!/bin/sh
set -e
marker=$(cat /proc/sys/kernel/random/uuid)
date +%s.%N > /logs/agent/started
for d in /app /tmp /tests /solution /logs/agent /installed-agent; do
  echo "$marker" > "$d/marker-$marker"
done
sleep 1
for d in /app /tmp /logs/agent /installed-agent; do
  [ "$(ls "$d" | grep -c '^marker-')" = 1 ] || { echo "$d shared: $(ls "$d")"; exit 1; }
  [ "$(cat "$d/marker-$marker")" = "$marker" ]
done
date +%s.%N > /logs/agent/finished
echo {answer} > /logs/agent/answer.txt
"""


def test_sixteen_concurrent_trials_never_see_each_others_files(ray_runtime, tmp_path) -> None:
    """Each trial writes a unique marker in every private dir and checks it sees only its own;
    a shared dir makes the solution exit before writing the answer (reward 0)."""
    (task,) = generate_tasks(tmp_path / "tasks", n_train=1, n_eval=0, seed=5).train
    (task.path / "solution" / "solve.sh").write_text(
        ISOLATION_SOLVE.replace("{answer}", str(task.question.answer))
    )
    runner = TrialRunner(oracle_config(tmp_path, max_concurrent_trials=16))
    group = run(runner, task.path, 16)
    assert [r.outcome for r in group.results] == [TrialOutcome.OK] * 16, [
        r.error for r in group.results
    ]
    assert group.rewards == (1.0,) * 16
    # The trials really overlapped: some trial started before another one finished.
    spans = []
    for result in group.results:
        agent_dir = tmp_path / "trials" / result.trial_name / "agent"
        start = float((agent_dir / "started").read_text())
        spans.append((start, float((agent_dir / "finished").read_text())))
    spans.sort()
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))


def test_environment_start_failure_is_retried_then_masks_the_group(ray_runtime, tmp_path) -> None:
    (task,) = generate_tasks(tmp_path / "tasks", 1, 0, seed=0, fault=Fault.ENV_START_FAIL).train
    runner = TrialRunner(oracle_config(tmp_path, max_infra_retries=2))
    group = run(runner, task.path, 2)
    assert group.mask_reason is MaskReason.INFRA
    for result in group.results:
        assert result.outcome is TrialOutcome.INFRA_ERROR
        assert result.masked and result.reward is None
        assert result.attempts == 3
        assert "EnvironmentStartError" in result.error
        assert "injected start failure" in result.error
    counts = runner.counters()
    assert counts["trials/attempts_infra_error"] == 6
    assert counts["trials/retries"] == 4
    assert counts["trials/final_infra_error"] == 2
    assert counts["groups/masked_infra_error_after_retries"] == 1


def test_missing_reward_is_an_infra_error(ray_runtime, tmp_path) -> None:
    (task,) = generate_tasks(tmp_path / "tasks", 1, 0, seed=0, fault=Fault.NO_REWARD).train
    runner = TrialRunner(oracle_config(tmp_path, max_infra_retries=1))
    group = run(runner, task.path, 1)
    (result,) = group.results
    assert result.outcome is TrialOutcome.INFRA_ERROR
    assert result.attempts == 2
    assert "RewardFileNotFoundError" in result.error
    assert group.mask_reason is MaskReason.INFRA
    assert runner.counters()["trials/attempts_infra_error"] == 2


def _slow_solution(task_path: Path) -> None:
    solve = task_path / "solution" / "solve.sh"
    solve.write_text("#!/bin/sh\nsleep 120\n")


def test_agent_timeouts_mask_the_trajectory_and_two_mask_the_group(ray_runtime, tmp_path) -> None:
    splits = generate_tasks(tmp_path / "tasks", 2, 0, seed=2)
    _slow_solution(splits.train[0].path)
    runner = TrialRunner(oracle_config(tmp_path, agent_timeout_sec=1.0))
    single = run(runner, splits.train[0].path, 1)
    (result,) = single.results
    assert result.outcome is TrialOutcome.AGENT_TIMEOUT
    assert result.masked and result.reward is None and result.attempts == 1
    assert not single.masked  # one timeout masks only its own trajectory

    group = run(runner, splits.train[0].path, 2)
    assert group.mask_reason is MaskReason.AGENT_TIMEOUTS
    counts = runner.counters()
    assert counts["trials/final_agent_timeout"] == 3
    assert counts["trials/retries"] == 0
    assert counts["groups/masked_agent_timeouts"] == 1


def test_truncated_outcome_from_agent_metadata_keeps_reward_zero(ray_runtime, tmp_path) -> None:
    """`classify` on a real Harbor result whose agent metadata reports a length-capped turn."""
    (task,) = generate_tasks(tmp_path / "tasks", 1, 0, seed=4).train
    shutil.rmtree(tmp_path / "trials", ignore_errors=True)
    runner = TrialRunner(oracle_config(tmp_path))
    (ok,) = run(runner, task.path, 1).results
    from harbor.models.trial.result import TrialResult

    harbor_result = TrialResult.model_validate_json(
        (tmp_path / "trials" / ok.trial_name / "result.json").read_text()
    )
    assert classify(harbor_result) == (TrialOutcome.OK, 1.0, None)
    capped = {"metadata": {"outcome": "length_cap"}}
    agent_result = harbor_result.agent_result.model_copy(update=capped)
    truncated = harbor_result.model_copy(update={"agent_result": agent_result})
    assert classify(truncated) == (TrialOutcome.TRUNCATED, 0.0, None)


def test_bad_input_names_the_field(ray_runtime, tmp_path) -> None:
    with pytest.raises(ConfigError, match="max_concurrent_trials"):
        oracle_config(tmp_path, max_concurrent_trials=0)
    with pytest.raises(ConfigError, match="agent_name and agent_import_path"):
        TrialRunnerConfig(trials_dir=tmp_path, agent_name="oracle")
    runner = TrialRunner(oracle_config(tmp_path))
    with pytest.raises(ConfigError, match="task="):
        run(runner, tmp_path / "no-such-task", 1)
    (task,) = generate_tasks(tmp_path / "tasks", 1, 0, seed=4).train
    with pytest.raises(ConfigError, match="n must be"):
        run(runner, task.path, 0)


# ----------------------------------------------------------------------------------------------
# With oneloop's MCP tool agent and the tiny model on the local backend. The model is taught one
# reply by a short SFT through the same Tinker seam the loop uses, so the faults are reached by a
# real sampler, a real agent, a real MCP server and a real verifier.
# ----------------------------------------------------------------------------------------------

SFT_STEPS = 120
AGENT_TASK_SEED = 1
SFT_LEARNING_RATE = 5e-3


def _tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


REPLIES = {
    "add": _tool_call("add", {"a": 1, "b": 2}),
    "invalid_json": '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',
}


async def _tool_specs(task: Path, work: Path) -> list[dict]:
    """The tool specs the agent shows the model for a demo task, from the real MCP server."""
    from harbor.models.task.task import Task
    from harbor.models.trial.paths import TrialPaths

    from oneloop.agents.environment import NoContainerEnvironment
    from oneloop.agents.mcp_agent import McpAgentConfig, McpToolbox

    config = Task(task).config
    paths = TrialPaths(work / "specs-trial")
    paths.mkdir()
    env = NoContainerEnvironment(
        environment_dir=task / "environment",
        environment_name="specs",
        session_id="specs",
        trial_paths=paths,
        task_env_config=config.environment,
        root_base_dir=work / "roots",
    )
    await env.start(False)
    try:
        agent_config = McpAgentConfig.from_kwargs({"sampler_key": "-", "tokenizer_path": "-"})
        async with McpToolbox(
            config.environment.mcp_servers, config=agent_config, stdio_command=env.stdio_command
        ) as toolbox:
            return list(toolbox.specs)
    finally:
        await env.stop(delete=True)


def _sft_sampling_client(
    service, model_dir: Path, reply: str, instructions: list[str], tools: list[dict]
):
    """A sampling client of the tiny model after SFT on `reply` for every instruction."""
    from oneloop.agents.renderer import ChatRenderer
    from oneloop.tiny.model import TINY_MODEL_NAME

    renderer = ChatRenderer.from_pretrained(model_dir)
    completion = renderer.encode(reply) + [renderer.stop_token_ids[0]]
    data = []
    first_prompt: list[int] = []
    for instruction in instructions:
        prompt = renderer.initial_prompt([{"role": "user", "content": instruction}], tools)
        first_prompt = first_prompt or prompt
        full = prompt + completion
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
            )
        )
    trainer = service.create_lora_training_client(TINY_MODEL_NAME, rank=32, seed=0).result()
    for _ in range(SFT_STEPS):
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=SFT_LEARNING_RATE)).result()
    client = trainer.save_weights_and_get_sampling_client(name=f"sft-{uuid.uuid4().hex[:8]}")
    client = client.result()
    # The fault tests only mean something if the model really sends this reply.
    stop = list(renderer.stop_token_ids)
    params = types.SamplingParams(max_tokens=64, temperature=0.0, stop=stop)
    prompt = types.ModelInput.from_ints(first_prompt)
    sampled = client.sample(prompt, 1, params).result().sequences[0].tokens
    assert renderer.decode(sampled) == renderer.decode(completion)
    return client


@pytest.fixture(scope="module")
def agent_setup(ray_runtime, local_service, tiny_model_path, tmp_path_factory):
    work = tmp_path_factory.mktemp("agent-tasks")
    # The tiny model memorises the reply for the tests' own task (seed AGENT_TASK_SEED); the
    # fault tests all use that task, so its prompt is the one to teach.
    (own,) = generate_tasks(work / "own-task", n_train=1, n_eval=0, seed=AGENT_TASK_SEED).train
    instructions = [(own.path / "instruction.md").read_text()]
    tools = asyncio.run(asyncio.wait_for(_tool_specs(own.path, work), 60))
    clients = {
        name: _sft_sampling_client(local_service, tiny_model_path, reply, instructions, tools)
        for name, reply in REPLIES.items()
    }
    return clients, tiny_model_path


def agent_runner(tmp_path: Path, model_dir: Path, **overrides) -> TrialRunner:
    kwargs = {
        "tokenizer_path": str(model_dir),
        "max_turns": overrides.pop("max_turns", 2),
        "max_tokens_per_turn": 48,
        "context_window": 2048,
        "temperature": 0.0,
        "tool_timeout_s": overrides.pop("tool_timeout_s", 5.0),
        "tool_result_max_chars": 600,
    }
    return TrialRunner(
        TrialRunnerConfig(
            trials_dir=tmp_path / "trials",
            agent_kwargs=kwargs,
            environment_kwargs={"root_base_dir": str(tmp_path / "roots")},
            **overrides,
        )
    )


def agent_task(tmp_path: Path, fault: Fault = Fault.NONE):
    """The one task the tiny model was taught on (same seed), with `fault` injected."""
    (task,) = generate_tasks(tmp_path / "tasks", 1, 0, seed=AGENT_TASK_SEED, fault=fault).train
    return task


def run_agent_group(runner: TrialRunner, task: Path, n: int, client) -> GroupResult:
    async def go() -> GroupResult:
        return await asyncio.wait_for(runner.run_group(task, n, client), GROUP_TIMEOUT_SEC)

    return asyncio.run(go())


def _agent_metadata(tmp_path: Path, result) -> dict:
    from harbor.models.trial.result import TrialResult

    path = tmp_path / "trials" / result.trial_name / "result.json"
    return TrialResult.model_validate_json(path.read_text()).agent_result.metadata


@pytest.mark.slow
def test_agent_tool_hang_times_out_the_call_and_the_trial_completes(agent_setup, tmp_path):
    clients, model_dir = agent_setup
    task = agent_task(tmp_path, Fault.TOOL_HANG)
    # One turn: the taught reply is the tool call; what the model says after it is untaught.
    runner = agent_runner(tmp_path, model_dir, tool_timeout_s=1.0, max_turns=1)
    (result,) = run_agent_group(runner, task.path, 1, clients["add"]).results
    assert result.outcome is TrialOutcome.OK, result.error
    assert result.reward == 0.0  # never submitted
    stats = _agent_metadata(tmp_path, result)["tool_stats"]["add"]
    assert stats["calls"] == 1 and stats["timeouts"] == 1
    assert result.trajectory is not None and result.trajectory["segments"]


@pytest.mark.slow
def test_agent_megabyte_tool_text_is_truncated(agent_setup, tmp_path):
    from oneloop.agents.renderer import ChatRenderer

    clients, model_dir = agent_setup
    task = agent_task(tmp_path, Fault.TOOL_HUGE)
    runner = agent_runner(tmp_path, model_dir, max_turns=1)
    (result,) = run_agent_group(runner, task.path, 1, clients["add"]).results
    assert result.outcome is TrialOutcome.OK, result.error
    assert _agent_metadata(tmp_path, result)["tool_stats"]["add"]["successes"] == 1
    renderer = ChatRenderer.from_pretrained(model_dir)
    observations = [
        renderer.decode(s["tokens"])
        for s in result.trajectory["segments"]
        if s["kind"] == "observation"
    ]
    # The first observation holds the 1 MB tool result, cut to tool_result_max_chars.
    assert observations and "characters truncated" in observations[0]
    assert len(observations[0]) < 2000


@pytest.mark.slow
def test_agent_mcp_server_crash_is_infra_retried_then_masks_group(agent_setup, tmp_path):
    """The MCP server answers the agent's first tool call, then dies mid-trial: the trial is an
    `mcp_server_crash` (its own class and count, not a generic infra error), retried, then it
    masks the group."""
    clients, model_dir = agent_setup
    task = agent_task(tmp_path, Fault.SERVER_CRASH)
    runner = agent_runner(tmp_path, model_dir, max_infra_retries=1)
    group = run_agent_group(runner, task.path, 1, clients["add"])
    (result,) = group.results
    assert result.outcome is TrialOutcome.MCP_SERVER_CRASH, result.error
    assert result.masked and result.reward is None
    assert result.attempts == 2
    assert "MCP stdio server exited mid-trial: 3 " in result.error
    # It crashed mid-trial: the agent had its tools and got the answer to its first call.
    stats = _agent_metadata(tmp_path, result)["tool_stats"]["add"]
    assert stats["successes"] == 1, stats
    assert group.mask_reason is MaskReason.INFRA
    counts = runner.counters()
    assert counts["trials/attempts_mcp_server_crash"] == 2
    assert counts["trials/final_mcp_server_crash"] == 1
    assert counts["trials/attempts_infra_error"] == counts["trials/final_infra_error"] == 0
    assert counts["groups/masked_infra_error_after_retries"] == 1


@pytest.mark.slow
def test_agent_invalid_tool_call_json_gets_a_repair_and_the_trial_is_scored(agent_setup, tmp_path):
    clients, model_dir = agent_setup
    task = agent_task(tmp_path)
    runner = agent_runner(tmp_path, model_dir, max_turns=1)
    (result,) = run_agent_group(runner, task.path, 1, clients["invalid_json"]).results
    assert result.outcome is TrialOutcome.OK, result.error
    assert result.reward == 0.0
    metadata = _agent_metadata(tmp_path, result)
    assert metadata["repairs"] == 1
    assert metadata["tool_stats"]["add"]["calls"] == 0
    kinds = [s["kind"] for s in result.trajectory["segments"]]
    assert kinds[-2:] == ["sampled", "observation"]  # the repair message follows the bad call
