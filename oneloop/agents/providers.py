"""Which Harbor environment runs a trial, and whether it can run at all: the preflight check.

A trial config names its environment either by Harbor type (`docker`, `modal`, `daytona`, ... —
Harbor 0.25's `EnvironmentType` values) or by `module:Class` import path (oneloop's
no-container environment, a test subclass, a user's own). `preflight_environment` is called once
by `TrialRunner` before any trial starts and raises `EnvironmentPreflightError` naming every
problem it finds:

* the class cannot be imported (a typo in the import path, an unknown type);
* the provider's Python SDK is missing (Harbor's Modal/Daytona modules import without it and only
  fail when a trial constructs the environment, i.e. as one infra error per trial);
* the class's own `preflight()` fails: Harbor's checks raise `SystemExit` for missing credentials
  (Modal: `MODAL_TOKEN_ID`/`MODAL_TOKEN_SECRET` or `~/.modal.toml`; Daytona: `DAYTONA_API_KEY`
  or `DAYTONA_JWT_TOKEN` + `DAYTONA_ORGANIZATION_ID`) and for a missing Docker binary or daemon.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from oneloop.errors import ConfigError

# Python distribution each SDK-backed provider needs, and the Harbor extra that installs it.
# Harbor imports these SDKs lazily, so their absence is only visible through this check.
PROVIDER_PACKAGES: dict[str, tuple[str, str]] = {
    "modal": ("modal", "modal"),
    "daytona": ("daytona", "daytona"),
    "e2b": ("e2b", "e2b"),
}


class EnvironmentPreflightError(ConfigError):
    """The selected environment cannot run trials here (missing SDK, credentials or daemon)."""


def environment_label(environment_type: str | None, import_path: str | None) -> str:
    return f"type {environment_type!r}" if environment_type else f"import_path {import_path!r}"


def check_environment_type(environment_type: str, field: str) -> Any:
    """The Harbor `EnvironmentType` named `environment_type`, or a ConfigError listing them."""
    from harbor.models.environment_type import EnvironmentType

    try:
        return EnvironmentType(environment_type)
    except ValueError:
        known = sorted(t.value for t in EnvironmentType)
        raise ConfigError(
            f"{field}: unknown Harbor environment type {environment_type!r}; known: {known} "
            "(or set an import path `module:Class` instead)"
        ) from None


def check_environment_choice(
    environment_type: str | None, import_path: str | None, field: str
) -> None:
    """Exactly one of a known Harbor type and an import path; ConfigError naming `field`."""
    if (environment_type is None) == (import_path is None):
        raise ConfigError(
            f"{field}: set exactly one of environment_type (a Harbor type such as docker, "
            "modal, daytona) and environment_import_path (module:Class)"
        )
    if environment_type is not None:
        check_environment_type(environment_type, f"{field}.environment_type")


def load_environment_class(
    environment_type: str | None, import_path: str | None, field: str = "environment"
) -> type:
    """The environment class a trial config selects (imported, not instantiated)."""
    label = environment_label(environment_type, import_path)
    try:
        if environment_type is not None:
            # Harbor 0.25 keeps its type -> class table private; this is the function its own
            # factory uses, so a type resolves exactly as a trial would resolve it.
            from harbor.environments.factory import _load_environment_class

            return _load_environment_class(check_environment_type(environment_type, field))
        if import_path is None:
            raise ConfigError(f"{field}: set an environment type or an import path")
        from harbor.utils.import_path import import_class

        return import_class(import_path, label="environment")
    except ConfigError:
        raise
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise EnvironmentPreflightError(
            f"{field}: environment {label} cannot be loaded: {type(exc).__name__}: {exc}"
        ) from exc


def preflight_environment(
    environment_type: str | None, import_path: str | None, field: str = "environment"
) -> type:
    """Load the environment class and run every check; returns the class.

    Raises `EnvironmentPreflightError` with all problems found (one message, `; `-separated).
    """
    cls = load_environment_class(environment_type, import_path, field)
    label = environment_label(environment_type, import_path)
    problems: list[str] = []
    provider = _provider_name(cls)
    if provider in PROVIDER_PACKAGES:
        package, extra = PROVIDER_PACKAGES[provider]
        if importlib.util.find_spec(package) is None:
            problems.append(
                f"the Python package {package!r} is not installed "
                f"(install it with: uv add 'harbor[{extra}]' or pip install 'harbor[{extra}]')"
            )
    try:
        cls.preflight()
    except SystemExit as exc:  # Harbor's preflight contract: SystemExit with the reason
        problems.append(str(exc.code if exc.code is not None else "preflight failed"))
    except Exception as exc:  # a user's preflight may raise anything; still a preflight failure
        problems.append(f"{type(exc).__name__}: {exc}")
    if problems:
        raise EnvironmentPreflightError(
            f"{field}: environment {label} cannot run trials: " + "; ".join(problems)
        )
    return cls


def _provider_name(cls: type) -> str | None:
    try:
        value = cls.type()  # a Harbor environment's type (EnvironmentType or a string)
    except Exception:  # noqa: BLE001 - a class without a usable type() has no known provider
        return None
    return getattr(value, "value", value) if value is not None else None


def container_free_warning(
    tasks_dir: object, environment_type: str | None, import_path: str | None
) -> str | None:
    """A warning when a run's own tasks (not the demo family) would run in the container-free
    environment, which isolates files only: it is the default for the demo and tests."""
    from oneloop.agents.environment import NO_CONTAINER_IMPORT_PATH

    if tasks_dir is None or environment_type is not None or import_path != NO_CONTAINER_IMPORT_PATH:
        return None
    return (
        f"tasks.dir={tasks_dir}: these tasks run in the container-free environment (files "
        "isolated, no security, the demo/test default); for production set "
        "rollout.environment_type (docker, modal, daytona) or rollout.environment_import_path"
    )
