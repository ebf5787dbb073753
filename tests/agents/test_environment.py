"""The no-container Harbor environment: private paths, process groups, files, capabilities."""

import asyncio
import os
from pathlib import Path

import pytest
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from oneloop.agents.environment import (
    INJECT_START_FAILURE_ENV,
    EnvironmentStartError,
    ExecTimeoutError,
    NoContainerEnvironment,
)
from oneloop.errors import ConfigError


def make_env(tmp_path: Path, name: str, **kwargs) -> NoContainerEnvironment:
    trial_paths = TrialPaths(tmp_path / "trials" / name)
    trial_paths.mkdir()
    env_dir = tmp_path / "task-env"
    env_dir.mkdir(exist_ok=True)
    own = ("network_policy", "user_default", "stdio_forkserver")
    env_kwargs = {k: kwargs.pop(k) for k in own if k in kwargs}
    return NoContainerEnvironment(
        environment_dir=env_dir,
        environment_name="demo",
        session_id=f"{name}__env",
        trial_paths=trial_paths,
        task_env_config=EnvironmentConfig(**kwargs),
        root_base_dir=tmp_path / "roots",
        **env_kwargs,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of ours that nobody reaped yet is a zombie: dead for our purpose.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_exec_sees_private_fixed_paths_and_task_env(tmp_path: Path) -> None:
    async def scenario() -> None:
        env = make_env(tmp_path, "a", env={"TASK_VAR": "from-task"})
        await env.start(force_build=False)
        try:
            result = await env.exec(
                "pwd; echo $TASK_VAR $CALL_VAR; ls -d /logs/agent /logs/verifier /tests "
                "/solution /installed-agent; echo oops >&2; exit 3",
                env={"CALL_VAR": "from-call"},
            )
            assert result.return_code == 3
            lines = (result.stdout or "").splitlines()
            assert lines[0] == "/app"
            assert lines[1] == "from-task from-call"
            assert sorted(lines[2:]) == sorted(
                ["/logs/agent", "/logs/verifier", "/tests", "/solution", "/installed-agent"]
            )
            assert result.stderr == "oops\n"
            # /logs/agent is the trial's own agent dir: Harbor reads it without a download.
            await env.exec("echo hello > /logs/agent/note.txt; echo v > /logs/verifier/r.txt")
            assert (env.trial_paths.agent_dir / "note.txt").read_text() == "hello\n"
            assert (env.trial_paths.verifier_dir / "r.txt").read_text() == "v\n"
            assert env.is_path_mounted("/logs/agent", env.trial_paths.agent_dir)
            cwd = await env.exec("pwd", cwd="/tmp")
            assert cwd.stdout == "/tmp\n"
        finally:
            await env.stop(delete=True)
        # Nothing was created on the host's own fixed paths.
        assert not Path("/logs/agent/note.txt").exists()

    asyncio.run(scenario())


def test_two_environments_never_share_files(tmp_path: Path) -> None:
    async def scenario() -> None:
        one, two = make_env(tmp_path, "one"), make_env(tmp_path, "two")
        await asyncio.gather(one.start(False), two.start(False))
        try:
            for env, mark in ((one, "1"), (two, "2")):
                await env.exec(
                    f"echo {mark} > /app/m; echo {mark} > /tmp/m; echo {mark} > /tests/m; "
                    f"echo {mark} > /solution/m; echo {mark} > /installed-agent/m"
                )
            for env, mark in ((one, "1"), (two, "2")):
                seen = await env.exec("cat /app/m /tmp/m /tests/m /solution/m /installed-agent/m")
                assert seen.stdout == f"{mark}\n" * 5
        finally:
            await asyncio.gather(one.stop(True), two.stop(True))

    asyncio.run(scenario())


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    async def scenario() -> None:
        env = make_env(tmp_path, "t")
        await env.start(False)
        try:
            with pytest.raises(ExecTimeoutError, match="timed out"):
                await env.exec("sleep 300 & echo $! > /tmp/child; sleep 300", timeout_sec=1)
            child = int(env.host_path("/tmp/child").read_text())
            for _ in range(100):  # SIGTERM was delivered; give the kernel a moment to reap
                if not _alive(child):
                    break
                await asyncio.sleep(0.05)
            assert not _alive(child)
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def test_cancelled_exec_kills_its_group(tmp_path: Path) -> None:
    async def scenario() -> None:
        env = make_env(tmp_path, "c")
        await env.start(False)
        try:
            task = asyncio.create_task(env.exec("echo $$ > /tmp/pid; sleep 300"))
            pid_file = env.host_path("/tmp/pid")
            while not pid_file.exists() or not pid_file.read_text().strip():
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            pid = int(pid_file.read_text())
            for _ in range(100):
                if not _alive(pid):
                    break
                await asyncio.sleep(0.05)
            assert not _alive(pid)
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def test_stop_kills_background_processes_and_deletes_the_root(tmp_path: Path) -> None:
    async def scenario() -> None:
        env = make_env(tmp_path, "s")
        await env.start(False)
        result = await env.exec("nohup sleep 300 > /dev/null 2>&1 & echo $!")
        assert result.return_code == 0
        daemon = int((result.stdout or "").strip())
        assert _alive(daemon)
        root = env.host_path("/app").parent
        await env.stop(delete=True)
        for _ in range(100):
            if not _alive(daemon):
                break
            await asyncio.sleep(0.05)
        assert not _alive(daemon)
        assert not root.exists()
        with pytest.raises(EnvironmentStartError, match="not started"):
            await env.exec("true")

    asyncio.run(scenario())


def test_upload_download_files_and_dirs(tmp_path: Path) -> None:
    async def scenario() -> None:
        env = make_env(tmp_path, "u")
        await env.start(False)
        try:
            src = tmp_path / "src"
            (src / "sub").mkdir(parents=True)
            (src / "a.txt").write_text("A")
            (src / "sub" / "b.txt").write_text("B")
            await env.upload_dir(src, "/tests")
            await env.upload_file(src / "a.txt", "/app/data/a-copy.txt")
            listing = await env.exec("cat /tests/a.txt /tests/sub/b.txt /app/data/a-copy.txt")
            assert listing.stdout == "ABA"
            await env.exec("mkdir -p /app/out/x && echo C > /app/out/x/c.txt")
            await env.download_dir("/app/out", tmp_path / "down")
            assert (tmp_path / "down" / "x" / "c.txt").read_text() == "C\n"
            await env.download_file("/app/out/x/c.txt", tmp_path / "c.txt")
            assert (tmp_path / "c.txt").read_text() == "C\n"
            with pytest.raises(ValueError, match="outside the private dirs"):
                await env.upload_file(src / "a.txt", "/etc/oneloop-should-not-exist")
            with pytest.raises(FileNotFoundError):
                await env.download_file("/app/missing.txt", tmp_path / "m.txt")
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def test_environment_dir_files_land_in_the_workdir(tmp_path: Path) -> None:
    async def scenario() -> None:
        env = make_env(tmp_path, "w", workdir="/srv-oneloop")
        (tmp_path / "task-env" / "input.csv").write_text("1,2\n")
        (tmp_path / "task-env" / "Dockerfile").write_text("FROM scratch\n")
        await env.start(False)
        try:
            result = await env.exec("pwd; ls")
            assert result.stdout == "/srv-oneloop\ninput.csv\n"
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def test_capabilities_are_honest(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="GPU"):
        make_env(tmp_path, "gpu", gpus=1)
    with pytest.raises(ValueError, match="no-network"):
        make_env(tmp_path, "net", network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
    with pytest.raises(ConfigError, match="workdir"):
        make_env(tmp_path, "wd", workdir="/usr/local/app")
    with pytest.raises(ConfigError, match="os="):
        make_env(tmp_path, "win", os="windows")

    async def non_root() -> None:
        env = make_env(tmp_path, "user")
        await env.start(False)
        try:
            with pytest.raises(ConfigError, match="root only"):
                await env.exec("true", user="nobody")
        finally:
            await env.stop(delete=True)

    asyncio.run(non_root())


def test_injected_start_failure(tmp_path: Path) -> None:
    env = make_env(tmp_path, "f", env={INJECT_START_FAILURE_ENV: "1"})
    with pytest.raises(EnvironmentStartError, match="injected start failure"):
        asyncio.run(env.start(False))
