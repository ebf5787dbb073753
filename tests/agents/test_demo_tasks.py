"""The demo task family: generator, shipped MCP server (real stdio sessions), Harbor verifier."""

import asyncio
import io
import json
import os
import random
import subprocess
import sys
import tomllib
from collections import Counter
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from harbor.models.task.config import EnvironmentConfig as TaskEnvironmentConfig
from harbor.models.task.task import Task
from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.models.trial.paths import TrialPaths
from harbor.trial.trial import Trial
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from oneloop.agents.demo_tasks import Difficulty, Fault, generate_tasks
from oneloop.agents.demo_tasks.demonstrations import (
    demo_tool_specs,
    demonstration,
    mistaken_questions,
)
from oneloop.agents.demo_tasks.generator import make_question
from oneloop.agents.demo_tasks.server import (
    CRASH_EXIT_CODE,
    HUGE_RESULT_CHARS,
    ExitAfterToolReplies,
)
from oneloop.agents.environment import (
    NO_CONTAINER_IMPORT_PATH,
    STDIO_EXIT_PREFIX,
    NoContainerEnvironment,
)
from oneloop.agents.renderer import ChatRenderer
from oneloop.errors import ConfigError

MCP_TIMEOUT_SEC = 30.0


def test_generation_is_deterministic_split_and_correct(tmp_path: Path) -> None:
    a = generate_tasks(tmp_path / "a", n_train=12, n_eval=6, seed=7)
    b = generate_tasks(tmp_path / "b", n_train=12, n_eval=6, seed=7)
    c = generate_tasks(tmp_path / "c", n_train=12, n_eval=6, seed=8)
    assert [t.question for t in a.train + a.eval] == [t.question for t in b.train + b.eval]
    assert [t.question for t in a.train] != [t.question for t in c.train]
    for ta, tb in zip(a.train + a.eval, b.train + b.eval, strict=True):
        for name in ("instruction.md", "task.toml", "tests/test.sh", "solution/solve.sh"):
            assert (ta.path / name).read_bytes() == (tb.path / name).read_bytes()
    assert not {t.question.text for t in a.train} & {t.question.text for t in a.eval}
    assert [t.question.difficulty for t in a.train[:3]] == list(Difficulty)
    for task in a.train + a.eval:
        # An independent oracle: Python's own arithmetic on the question text.
        assert eval(task.question.text) == task.question.answer  # noqa: S307
        assert f"What is {task.question.text}?" in (task.path / "instruction.md").read_text()
    with pytest.raises(ConfigError, match="n_train"):
        generate_tasks(tmp_path / "bad", n_train=-1, n_eval=0, seed=0)


def test_demonstration_tasks_are_drawn_apart_and_leave_train_and_eval_as_they_were(
    tmp_path: Path,
) -> None:
    """`n_demonstrations` draws the warm start's questions after train and eval: the same seed
    gives the same train and eval tasks with or without them, and no question is in two splits."""
    plain = generate_tasks(tmp_path / "plain", n_train=12, n_eval=6, seed=7)
    more = generate_tasks(tmp_path / "more", n_train=12, n_eval=6, seed=7, n_demonstrations=9)
    assert plain.demonstrations == ()
    assert [t.question for t in more.train + more.eval] == [
        t.question for t in plain.train + plain.eval
    ]
    texts = [t.question.text for t in more.train + more.eval + more.demonstrations]
    assert len(more.demonstrations) == 9 and len(set(texts)) == len(texts)
    for task in more.demonstrations:
        assert task.split == "demonstrations" and (task.path / "instruction.md").is_file()
        assert eval(task.question.text) == task.question.answer  # noqa: S307
    with pytest.raises(ConfigError, match="n_demonstrations"):
        generate_tasks(tmp_path / "bad", n_train=1, n_eval=0, seed=0, n_demonstrations=-1)


def test_no_intermediate_result_is_negative_and_every_operator_is_as_likely() -> None:
    """Every intermediate result of every difficulty is a whole number >= 0 (the demo model
    miscopies negative numbers under greedy decoding, see `make_question`), and on easy questions
    each operator is drawn about a quarter of the time (`/` used to be about one in ten)."""
    rng = random.Random(0)
    counts: Counter[str] = Counter()
    for difficulty in Difficulty:
        for _ in range(2000):
            question = make_question(rng, difficulty)
            # Python's arithmetic on each left-nested prefix "(..(a op b) op c ..)" in turn.
            first, *rest = question.text.replace("(", "").split(")")
            value = eval(first)  # noqa: S307
            assert value >= 0 and value == int(value), question.text
            for part in rest:
                value = eval(f"{value}{part}")  # noqa: S307
                assert value >= 0 and value == int(value), question.text
            assert value == question.answer
            if difficulty is Difficulty.EASY:
                counts[question.text.split()[1]] += 1
    assert set(counts) == {"+", "-", "*", "/"}
    assert min(counts.values()) > 0.2 * sum(counts.values()), counts


def test_every_split_holds_each_operator_a_quarter_of_the_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The innermost operator cycles + - * / within each split (a repeated question is redrawn
    with the same operator, not another), so `/`, whose easy questions are the fewest (102), is
    as common as the others, in both demo presets' sizes. Past 102 `/` questions the rest of
    `/`'s turns take other operators, with a warning that counts them; when no new question can
    be drawn at all the error names the split and the task."""
    easy = (Difficulty.EASY,)

    def operators(tasks: tuple) -> Counter[str]:
        return Counter(t.question.text.replace("(", "").split()[1] for t in tasks)

    for n_train, n_eval in ((200, 64), (256, 128)):  # demo-cpu, demo-gpu
        splits = generate_tasks(tmp_path / f"{n_train}", n_train, n_eval, 0, difficulties=easy)
        assert operators(splits.train) == dict.fromkeys("+-*/", n_train // 4)
        assert operators(splits.eval) == dict.fromkeys("+-*/", n_eval // 4)
    mixed = generate_tasks(tmp_path / "mixed", n_train=24, n_eval=0, seed=1)
    assert operators(mixed.train) == dict.fromkeys("+-*/", 6)
    assert not caplog.records
    more = generate_tasks(tmp_path / "more", n_train=440, n_eval=0, seed=0, difficulties=easy)
    assert operators(more.train)["/"] == 102 and sum(operators(more.train).values()) == 440
    assert len({t.question.text for t in more.train}) == 440
    (warning,) = caplog.records
    assert "every easy question with '/' first was taken; 8 train tasks" in warning.getMessage()

    def always_the_same(*args: object) -> object:
        return make_question(random.Random(0), Difficulty.EASY)

    monkeypatch.setattr("oneloop.agents.demo_tasks.generator.make_question", always_the_same)
    with pytest.raises(ConfigError, match="could not draw eval task 1: nearly every easy"):
        generate_tasks(tmp_path / "bad", n_train=0, n_eval=2, seed=0, difficulties=easy)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="first_op"):
        make_question(random.Random(0), Difficulty.EASY, first_op="%")


def test_task_toml_is_valid_for_harbor(tmp_path: Path) -> None:
    splits = generate_tasks(tmp_path, n_train=1, n_eval=1, seed=0, agent_timeout_sec=42.0)
    task = Task(splits.train[0].path)
    config = task.config
    assert config.agent.timeout_sec == 42.0
    assert config.verifier.timeout_sec > 0
    assert config.metadata["difficulty"] == splits.train[0].question.difficulty.value
    assert config.metadata["split"] == "train"
    (server,) = config.environment.mcp_servers
    assert server.transport == "stdio"
    assert server.command == sys.executable
    assert server.args[:2] == ["-m", "oneloop.agents.demo_tasks.server"]
    assert tomllib.loads((splits.eval[0].path / "task.toml").read_text())["metadata"]["split"] == (
        "eval"
    )


def _environment(tmp_path: Path, name: str) -> NoContainerEnvironment:
    trial_paths = TrialPaths(tmp_path / "trials" / name)
    trial_paths.mkdir()
    return NoContainerEnvironment(
        environment_dir=tmp_path / "no-env-dir",
        environment_name="demo",
        session_id=name,
        trial_paths=trial_paths,
        task_env_config=TaskEnvironmentConfig(),
        root_base_dir=tmp_path / "roots",
    )


@asynccontextmanager
async def calculator_session(env: NoContainerEnvironment, *server_args: str):
    """A real stdio MCP session with the shipped server, started inside the environment."""
    command, args = env.stdio_command(
        sys.executable, ["-m", "oneloop.agents.demo_tasks.server", *server_args]
    )
    params = StdioServerParameters(command=command, args=args)
    with open(os.devnull, "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write, read_timeout_seconds=MCP_TIMEOUT_SEC) as session:
                await asyncio.wait_for(session.initialize(), MCP_TIMEOUT_SEC)
                yield session


def _text(result) -> str:
    return "".join(block.text for block in result.content)


def test_mcp_server_tools_and_submit_answer_land_in_the_trial(tmp_path: Path) -> None:
    async def scenario() -> None:
        env = _environment(tmp_path, "mcp")
        await env.start(False)
        try:
            async with calculator_session(env) as session:
                tools = await session.list_tools()
                assert {t.name for t in tools.tools} == {
                    "add", "subtract", "multiply", "divide", "submit_answer",
                }  # fmt: skip
                assert _text(await session.call_tool("add", {"a": 17, "b": "25"})) == "42"
                assert _text(await session.call_tool("subtract", {"a": "3", "b": "10"})) == "-7"
                assert _text(await session.call_tool("multiply", {"a": "42", "b": "3"})) == "126"
                assert _text(await session.call_tool("divide", {"a": 126, "b": 4.0})) == "31.5"
                bad = await session.call_tool("divide", {"a": "1", "b": "0"})
                assert bad.is_error and "division by zero" in _text(bad)
                nan = await session.call_tool("add", {"a": "x", "b": "1"})
                assert nan.is_error and "not a number" in _text(nan)
                await session.call_tool("submit_answer", {"answer": " 126 "})
            # The server ran in the trial's namespace: the answer is in this trial's agent dir.
            assert (env.trial_paths.agent_dir / "answer.txt").read_text() == "126\n"
            assert not Path("/logs/agent/answer.txt").exists()
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def test_mcp_server_fault_knobs(tmp_path: Path) -> None:
    async def scenario() -> None:
        env = _environment(tmp_path, "faults")
        await env.start(False)
        try:
            async with calculator_session(env, "--huge-tool", "add") as session:
                huge = await session.call_tool("add", {"a": "1", "b": "2"})
                assert len(_text(huge)) == HUGE_RESULT_CHARS
            async with calculator_session(env, "--hang-tool", "add") as session:
                with pytest.raises(MCPError, match="[Tt]imed out"):
                    await session.call_tool("add", {"a": "1", "b": "2"}, read_timeout_seconds=0.5)
                # The server still answers other tools while one call hangs.
                assert _text(await session.call_tool("multiply", {"a": "2", "b": "3"})) == "6"
            with pytest.raises(ExceptionGroup) as crashed:
                async with calculator_session(env, "--crash-after", "1") as session:
                    await session.call_tool("add", {"a": "1", "b": "2"})
            closed = crashed.value.subgroup(
                lambda e: isinstance(e, MCPError) and "Connection closed" in str(e)
            )
            assert closed is not None
            # The environment recorded the crash (status 3) for the trial runner; the servers
            # the client closed normally left no record.
            (record,) = env.trial_paths.agent_dir.glob(f"{STDIO_EXIT_PREFIX}*.txt")
            assert record.read_text().startswith(f"{CRASH_EXIT_CODE} ")
            record.unlink()
            # Tool reply 1 lists the tools, 2 answers the first call (the handshake is not
            # counted); then the process is gone and the next call gets no answer.
            with pytest.raises(ExceptionGroup) as crashed:
                async with calculator_session(env, "--exit-after-tool-replies", "2") as session:
                    assert len((await session.list_tools()).tools) == 5
                    assert _text(await session.call_tool("add", {"a": "1", "b": "2"})) == "3"
                    await session.call_tool("add", {"a": "2", "b": "2"})
            assert crashed.value.subgroup(
                lambda e: isinstance(e, MCPError) and "Connection closed" in str(e)
            )
            (record,) = env.trial_paths.agent_dir.glob(f"{STDIO_EXIT_PREFIX}*.txt")
            assert record.read_text().startswith(f"{CRASH_EXIT_CODE} ")
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def test_the_injected_crash_does_not_count_the_handshake(monkeypatch) -> None:
    """Whatever the client negotiates (a `server/discover` probe, the `initialize` fallback, a
    -32022 answer to an initialize sent after a probe that timed out under load), the server dies
    right after the N-th tools reply, so a trial's crash lands at the same point every time."""

    class Crashed(Exception):
        pass

    def crash(code: int) -> None:
        raise Crashed(code)

    monkeypatch.setattr(os, "_exit", crash)
    sink = io.BytesIO()
    out = ExitAfterToolReplies(sink, 2)
    handshake = [
        {"jsonrpc": "2.0", "id": 0, "result": {"supportedVersions": ["2026-07-28"]}},
        {"jsonrpc": "2.0", "id": 1, "error": {"code": -32022, "message": "unsupported"}},
        {
            "jsonrpc": "2.0",
            "id": 2,
            "result": {"protocolVersion": "2025-06-18", "capabilities": {}},
        },
        {"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": "x"}},
    ]
    listed = {"jsonrpc": "2.0", "id": 3, "result": {"tools": []}}
    called = {"jsonrpc": "2.0", "id": 4, "result": {"content": [], "isError": False}}
    for message in (*handshake, listed):
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()
    assert out.replies == 1
    out.write(json.dumps(called).encode() + b"\n")
    with pytest.raises(Crashed) as crashed:
        out.flush()
    assert crashed.value.args == (CRASH_EXIT_CODE,)
    assert sink.getvalue().count(b"\n") == 6  # the last reply was written out before the exit


def test_mcp_server_refuses_to_run_outside_an_environment(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "oneloop.agents.demo_tasks.server",
         "--answer-path", str(tmp_path / "missing" / "answer.txt")],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode != 0
    assert "start the server inside the trial's environment" in done.stderr


def _run_trial(task_path: Path, trials_dir: Path, agent: str):
    async def scenario():
        config = TrialConfig(
            task=TaskConfig(path=task_path),
            trials_dir=trials_dir,
            agent=AgentConfig(name=agent),
            environment=EnvironmentConfig(import_path=NO_CONTAINER_IMPORT_PATH),
        )
        trial = await asyncio.wait_for(Trial.create(config), 60)
        return await asyncio.wait_for(trial.run(), 120)

    return asyncio.run(scenario())


def test_verifier_rewards_right_wrong_and_missing_answers(tmp_path: Path) -> None:
    splits = generate_tasks(tmp_path / "tasks", n_train=2, n_eval=0, seed=3)
    right = _run_trial(splits.train[0].path, tmp_path / "trials", "oracle")
    assert right.exception_info is None
    assert right.verifier_result.rewards == {"reward": 1.0}

    wrong_task = splits.train[1]
    solve = wrong_task.path / "solution" / "solve.sh"
    solve.write_text(solve.read_text().replace(
        f"echo {wrong_task.question.answer} ", f"echo {wrong_task.question.answer + 1} "
    ))  # fmt: skip
    wrong = _run_trial(wrong_task.path, tmp_path / "trials", "oracle")
    assert wrong.exception_info is None
    assert wrong.verifier_result.rewards == {"reward": 0.0}

    nothing = _run_trial(splits.train[0].path, tmp_path / "trials", "nop")
    assert nothing.verifier_result.rewards == {"reward": 0.0}


def test_no_reward_fault_makes_harbor_report_a_missing_reward(tmp_path: Path) -> None:
    splits = generate_tasks(tmp_path / "tasks", 1, 0, seed=0, fault=Fault.NO_REWARD)
    result = _run_trial(splits.train[0].path, tmp_path / "trials", "oracle")
    assert result.verifier_result is None
    assert result.exception_info.exception_type == "RewardFileNotFoundError"


def test_mcp_server_advertises_short_plain_schemas(tmp_path: Path) -> None:
    """Regression: the SDK's generated schemas (anyOf over int/float/str, titles) were 93 % of
    every demo prompt's tokens; each tool now shows a plain `number` schema."""
    tools = demo_tool_specs()
    for tool in tools:
        parameters = tool["function"]["parameters"]
        assert "title" not in json.dumps(parameters) and "anyOf" not in json.dumps(parameters)
        assert all(p == {"type": "number"} for p in parameters["properties"].values())
        assert set(parameters["required"]) == set(parameters["properties"])


INVERSE = {"+": ("add", "subtract"), "-": ("subtract", "add"), "*": ("multiply", "divide"),
           "/": ("divide", "multiply")}  # fmt: skip


def test_warm_start_demonstrations_use_the_right_or_the_inverse_tool(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    splits = generate_tasks(tmp_path, n_train=60, n_eval=0, seed=0, difficulties=(Difficulty.EASY,))
    renderer = ChatRenderer.from_pretrained(tiny_model_path)
    tools = demo_tool_specs()
    call = '{{"name": "{}", "arguments": {{"a": {}, "b": {}}}}}'
    submit = '{{"name": "submit_answer", "arguments": {{"answer": {}}}}}'
    for task in splits.train[:8]:
        a, op, b = task.question.text.split()
        right, wrong = INVERSE[op]
        tokens, weights = demonstration(task, renderer, tools, None)
        solved = renderer.decode(tokens)
        assert call.format(right, a, b) in solved
        assert submit.format(task.question.answer) in solved
        assert len(tokens) == len(weights) and 0 < sum(weights) < len(weights)
        mistaken = renderer.decode(demonstration(task, renderer, tools, None, True)[0])
        assert call.format(wrong, a, b) in mistaken and call.format(right, a, b) not in mistaken
        # The wrong tool's real result is submitted: an independent oracle, Python's arithmetic.
        other = {"+": "-", "-": "+", "*": "/", "/": "*"}[op]
        wrong_value = eval(f"{a} {other} {b}")  # noqa: S307
        wrong_value = int(wrong_value) if wrong_value == int(wrong_value) else wrong_value
        assert submit.format(wrong_value) in mistaken and wrong_value != task.question.answer
    minus = [t.question.text for t in splits.train if " - " in t.question.text]
    divide = [t.question.text for t in splits.train if " / " in t.question.text]
    picked = mistaken_questions(splits.train, {"-": 0.55, "/": 0.3})
    assert picked == mistaken_questions(list(reversed(splits.train)), {"-": 0.55, "/": 0.3})
    # Exactly the share of each operator's tasks (rounded), and only of the operators named.
    assert len(picked & set(minus)) == round(0.55 * len(minus))
    assert len(picked & set(divide)) == round(0.3 * len(divide))
    assert len(picked) == round(0.55 * len(minus)) + round(0.3 * len(divide))
    assert mistaken_questions(splits.train, {}) == frozenset()
