"""Production environments through config: Harbor's docker / modal / daytona (or any import path)
are selected by the trial config, and an environment that cannot run here fails its preflight
before any trial starts, with an error that names what is missing."""

import os
import stat
from pathlib import Path

import pytest

from oneloop.agents.environment import NO_CONTAINER_IMPORT_PATH
from oneloop.agents.providers import EnvironmentPreflightError, preflight_environment
from oneloop.agents.trials import TrialRunner, TrialRunnerConfig
from oneloop.errors import ConfigError
from oneloop.loop.config import load_config
from oneloop.loop.train import trial_runner_config

CREDENTIAL_VARS = (
    "MODAL_TOKEN_ID",
    "MODAL_TOKEN_SECRET",
    "DAYTONA_API_KEY",
    "DAYTONA_JWT_TOKEN",
    "DAYTONA_ORGANIZATION_ID",
)


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    for var in CREDENTIAL_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.modal.toml


def fake_docker(directory: Path, info_exit: int) -> None:
    """A `docker` CLI whose `info` exits with `info_exit` (the daemon answers or not)."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "docker"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = info ]; then echo "Cannot connect to the Docker daemon" >&2; '
        f"exit {info_exit}; fi\nexit 0\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def runner_config(tmp_path: Path, **environment) -> TrialRunnerConfig:
    return TrialRunnerConfig(
        trials_dir=tmp_path / "trials",
        agent_import_path=None,
        agent_name="oracle",
        **environment,
    )


def test_docker_without_a_daemon_fails_before_any_trial(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    fake_docker(bin_dir, info_exit=1)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    config = runner_config(tmp_path, environment_type="docker", environment_import_path=None)
    with pytest.raises(EnvironmentPreflightError, match="Docker daemon is not running"):
        TrialRunner(config)
    assert not (tmp_path / "trials").exists()  # nothing started


def test_docker_not_installed(tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(EnvironmentPreflightError, match="Docker is not installed"):
        preflight_environment("docker", None, "rollout.environment")


def test_docker_by_import_path_runs_the_same_check(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    fake_docker(bin_dir, info_exit=1)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(EnvironmentPreflightError, match="daemon"):
        preflight_environment(None, "harbor.environments.docker.docker:DockerEnvironment")
    fake_docker(bin_dir, info_exit=0)  # a daemon that answers: the check passes
    preflight_environment(None, "harbor.environments.docker.docker:DockerEnvironment")


def test_modal_without_credentials_names_the_variables(no_credentials):
    with pytest.raises(EnvironmentPreflightError) as error:
        preflight_environment("modal", None, "rollout.environment")
    message = str(error.value)
    assert message.startswith("rollout.environment: environment type 'modal'")
    assert "MODAL_TOKEN_ID" in message and "MODAL_TOKEN_SECRET" in message


def test_modal_with_credentials_still_needs_its_sdk(no_credentials, monkeypatch):
    import importlib.util

    monkeypatch.setenv("MODAL_TOKEN_ID", "id")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "secret")
    if importlib.util.find_spec("modal") is not None:
        preflight_environment("modal", None)  # SDK and credentials present: passes
        return
    with pytest.raises(EnvironmentPreflightError) as error:
        preflight_environment("modal", None)
    assert "'modal' is not installed" in str(error.value)
    assert "harbor[modal]" in str(error.value)
    assert "MODAL_TOKEN_ID" not in str(error.value)


def test_daytona_without_credentials(no_credentials):
    with pytest.raises(EnvironmentPreflightError, match="DAYTONA_API_KEY"):
        preflight_environment("daytona", None)


def test_training_config_selects_the_environment_and_preflights(no_credentials, tmp_path):
    cfg = load_config("demo-cpu", [f"run_dir={tmp_path}", "rollout.environment_type=daytona"])
    config = trial_runner_config(cfg, "tokenizer", 1.0, 4)
    assert config.environment_type == "daytona" and config.environment_import_path is None
    with pytest.raises(EnvironmentPreflightError, match="DAYTONA_API_KEY"):
        TrialRunner(config)
    # Both set is ambiguous; an unknown type names the field and the known types.
    with pytest.raises(ConfigError, match="rollout"):
        load_config(
            "demo-cpu",
            ["rollout.environment_type=docker", "rollout.environment_import_path=a.b:C"],
        )
    with pytest.raises(ConfigError, match="trials.environment_type.*'dockr'.*daytona"):
        runner_config(tmp_path, environment_type="dockr", environment_import_path=None)
    with pytest.raises(ConfigError, match="exactly one of environment_type"):
        runner_config(tmp_path, environment_type="docker")


def test_bad_import_path_and_default(tmp_path):
    with pytest.raises(EnvironmentPreflightError, match="no_such_module"):
        preflight_environment(None, "no_such_module:Environment", "rollout.environment")
    # The container-free default passes here (root, util-linux present) and is the default.
    assert preflight_environment(None, NO_CONTAINER_IMPORT_PATH).__name__ == (
        "NoContainerEnvironment"
    )
    assert load_config("demo-cpu").rollout.environment_import_path == NO_CONTAINER_IMPORT_PATH


def test_own_tasks_in_the_container_free_default_are_warned_about():
    from oneloop.agents.providers import container_free_warning

    assert container_free_warning(None, None, NO_CONTAINER_IMPORT_PATH) is None  # the demo
    assert container_free_warning("/tasks", "docker", None) is None
    assert (
        container_free_warning("/tasks", None, "harbor.environments.modal:ModalEnvironment") is None
    )
    warning = container_free_warning("/tasks", None, NO_CONTAINER_IMPORT_PATH)
    assert warning is not None and "rollout.environment_type" in warning
