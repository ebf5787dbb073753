"""The stdio fork server: MCP servers forked from a preloaded copy behave as freshly started
ones."""

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

from oneloop.agents import stdio_launch
from oneloop.agents.demo_tasks.generator import SERVER_MODULE
from oneloop.agents.environment import STDIO_EXIT_PREFIX, NoContainerEnvironment
from oneloop.agents.stdio_forkserver import FORK_SERVERS, StdioForkServers
from oneloop.errors import ConfigError
from tests.agents.test_environment import make_env

SERVER_ARGS = ["-m", SERVER_MODULE, "--answer-path", "/logs/agent/answer.txt"]
TIMEOUT_S = 60.0


async def _submit(env: NoContainerEnvironment, answer: str, extra: tuple[str, ...] = ()) -> str:
    """Start the calculator server through the environment, add 2+3, submit `answer`."""
    command, args = env.stdio_command(sys.executable, [*SERVER_ARGS, *extra])
    async with asyncio.timeout(TIMEOUT_S):
        async with Client(stdio_client(StdioServerParameters(command=command, args=args))) as c:
            added = await c.call_tool("add", {"a": 2, "b": 3})
            await c.call_tool("submit_answer", {"answer": answer})
    return added.content[0].text


def _agent_dir(env: NoContainerEnvironment) -> Path:
    return env.trial_paths.agent_dir


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def _fork_server_pid() -> int:
    proc, _ = FORK_SERVERS._servers[SERVER_MODULE]
    return proc.pid


def test_forked_servers_write_into_their_own_trial(tmp_path: Path) -> None:
    async def scenario() -> None:
        envs = [make_env(tmp_path, name) for name in ("a", "b", "c")]
        for env in envs:
            await env.start(force_build=False)
        try:
            # The first starts the fork server; then two run at once on the same fork server.
            assert await _submit(envs[0], "5") == "5"
            started = FORK_SERVERS.started
            await asyncio.gather(_submit(envs[1], "7"), _submit(envs[2], "11"))
            assert FORK_SERVERS.started == started  # reused, not restarted
        finally:
            for env in envs:
                await env.stop(delete=True)

    asyncio.run(scenario())
    answers = [(tmp_path / "trials" / n / "agent" / "answer.txt").read_text() for n in "abc"]
    assert answers == ["5\n", "7\n", "11\n"]


def test_a_crash_keeps_its_exit_status(tmp_path: Path) -> None:
    async def scenario() -> Path:
        env = make_env(tmp_path, "crash")
        await env.start(force_build=False)
        agent_dir = _agent_dir(env)
        try:
            with pytest.raises(Exception):  # noqa: B017 - the SDK's error type for a dead server
                await _submit(env, "1", ("--crash-after", "1"))
            async with asyncio.timeout(TIMEOUT_S):
                while not list(agent_dir.glob(f"{STDIO_EXIT_PREFIX}*.txt")):
                    await asyncio.sleep(0.05)
        finally:
            await env.stop(delete=False)
        return agent_dir

    agent_dir = asyncio.run(scenario())
    [record] = list(agent_dir.glob(f"{STDIO_EXIT_PREFIX}*.txt"))
    assert record.read_text().split()[0] == "3"  # the server's CRASH_EXIT_CODE, not the launcher's


def test_killing_the_launcher_kills_the_forked_program(tmp_path: Path) -> None:
    async def scenario() -> None:
        env = make_env(tmp_path, "kill")
        await env.start(force_build=False)
        try:
            await _submit(env, "0")  # the fork server is running now
            server_pid = _fork_server_pid()
            before = _children(server_pid)
            command, args = env.stdio_command(sys.executable, SERVER_ARGS)
            proc = await asyncio.create_subprocess_exec(
                command, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                start_new_session=True,
            )  # fmt: skip
            async with asyncio.timeout(TIMEOUT_S):
                while not (_children(server_pid) - before):
                    await asyncio.sleep(0.02)
            [forked] = _children(server_pid) - before
            os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.wait_for(proc.wait(), TIMEOUT_S)
            async with asyncio.timeout(TIMEOUT_S):
                while forked in _children(server_pid) or Path(f"/proc/{forked}").exists():
                    await asyncio.sleep(0.02)
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def test_a_dead_fork_server_is_restarted_and_the_launcher_reports_a_lost_one(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        env = make_env(tmp_path, "restart")
        await env.start(force_build=False)
        try:
            await _submit(env, "1")
            server_pid, started = _fork_server_pid(), FORK_SERVERS.started
            # A program running while its fork server dies: its launcher exits LOST_EXIT.
            command, args = env.stdio_command(sys.executable, SERVER_ARGS)
            proc = await asyncio.create_subprocess_exec(
                command, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            async with asyncio.timeout(TIMEOUT_S):
                while not _children(server_pid):
                    await asyncio.sleep(0.02)
            os.kill(server_pid, signal.SIGKILL)
            assert await asyncio.wait_for(proc.wait(), TIMEOUT_S) == stdio_launch.LOST_EXIT
            # The next start notices the dead fork server and starts a new one.
            assert await _submit(env, "2") == "5"
            assert FORK_SERVERS.started == started + 1
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())
    assert (tmp_path / "trials" / "restart" / "agent" / "answer.txt").read_text() == "2\n"


def test_an_unreachable_fork_server_means_a_direct_start(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(stdio_launch.CONNECT_TIMEOUT_ENV, "0.2")
    answer = tmp_path / "answer.txt"
    launch = [sys.executable, "-I", "-S", str(stdio_launch.__file__), "oneloop-no-such-server"]

    async def scenario() -> str:
        params = StdioServerParameters(
            command=launch[0],
            args=[*launch[1:], SERVER_MODULE, "--answer-path", str(answer)],
            env=dict(os.environ),
        )
        async with asyncio.timeout(TIMEOUT_S):
            async with Client(stdio_client(params)) as client:
                await client.call_tool("submit_answer", {"answer": "9"})
                return "ok"

    assert asyncio.run(scenario()) == "ok"
    assert answer.read_text() == "9\n"


def test_only_this_interpreters_modules_go_through_a_fork_server(tmp_path: Path) -> None:
    servers = StdioForkServers()
    assert servers.command(sys.executable, ["script.py"]) is None
    assert servers.command(sys.executable, ["-c", "pass"]) is None
    assert servers.command("/bin/sh", ["-m", "x"]) is None
    assert servers.started == 0
    with pytest.raises(ConfigError, match="environment.kwargs.stdio_forkserver"):
        make_env(tmp_path, "bad", stdio_forkserver="yes")


def test_turned_off_the_command_is_started_directly(tmp_path: Path) -> None:
    env = make_env(tmp_path, "off", stdio_forkserver=False)

    async def scenario() -> tuple[str, list[str]]:
        await env.start(force_build=False)
        try:
            return env.stdio_command(sys.executable, SERVER_ARGS)
        finally:
            await env.stop(delete=True)

    _, args = asyncio.run(scenario())
    assert str(stdio_launch.__file__) not in " ".join(args)
    assert args[-len(SERVER_ARGS) :] == SERVER_ARGS
