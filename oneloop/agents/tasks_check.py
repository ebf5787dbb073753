"""Refusing, before any trial, the Harbor tasks that cannot run in the chosen environment.

This module owns `check_task` (the reasons one task directory is refused, empty when it can run)
and `oneloop tasks check DIR [--environment ...] [--oracle]`. The trial runner calls
`check_task` before a group's first trial, and the training loop and `oneloop eval` before
they start: a refused task is a `task_config` outcome, counted on its own and never retried,
because no retry can make it run.

Every environment: the task must load (task.toml parses, `instruction.md`, `tests/test.sh`, or
for a multi-step task `steps/<name>/instruction.md` and a step or shared test script, as
Harbor's own `Task` validation asks). The container-free environment
(`oneloop.agents.environment`) also refuses what it cannot honour: a non-root `agent.user` /
`verifier.user` (top-level or per step), a network policy other than public (`network_mode`
no-network or allowlist, `allowed_hosts`, `allow_internet = false`, at any level), GPUs or TPUs,
a non-Linux OS, an `[environment.healthcheck]` (it checks services an image's entrypoint starts),
a separate verifier environment, a docker-compose file, a `docker_image`, and Dockerfile
instructions other than `DOCKERFILE_HONOURED` (the base image, `RUN`, `COPY`, `ENTRYPOINT`, ... are
not applied: tasks run on this host's filesystem).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from oneloop.agents.environment import NO_CONTAINER_IMPORT_PATH, ROOT_USERS
from oneloop.errors import ConfigError

# Dockerfile instructions that change nothing a container-free trial could observe, or that it
# honours itself (WORKDIR when it equals the task's workdir). Everything else refuses the task.
DOCKERFILE_HONOURED = frozenset({"LABEL", "EXPOSE", "ARG", "MAINTAINER", "STOPSIGNAL"})
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
ORACLE_TIMEOUT_SEC = 900.0


def is_container_free(environment_type: str | None, import_path: str | None) -> bool:
    return environment_type is None and import_path == NO_CONTAINER_IMPORT_PATH


def check_task(task_dir: Path | str, container_free: bool = True) -> list[str]:
    """Why the Harbor task at `task_dir` cannot run (one short reason each); [] when it can."""
    from harbor.models.task.task import Task

    task_dir = Path(task_dir)
    if not (task_dir / "task.toml").is_file():
        return ["no task.toml (not a Harbor task directory)"]
    try:
        task = Task(task_dir)
        Task._validate_tests(task.config, task.paths)  # noqa: SLF001 (Harbor's own check)
    except Exception as exc:  # Harbor raises ValueError, FileNotFoundError, pydantic errors, ...
        text = " ".join(str(exc).split())
        return [f"task does not load: {text[:300]}"]
    if not container_free:
        return []
    return _container_free_problems(task.config, task_dir)


def _container_free_problems(config: Any, task_dir: Path) -> list[str]:
    env = config.environment
    problems: list[str] = []
    phases: list[tuple[str, Any]] = [("agent", config.agent), ("verifier", config.verifier)]
    for step in config.steps or []:
        phases += [(f"steps.{step.name}.agent", step.agent)]
        phases += [(f"steps.{step.name}.verifier", step.verifier)]
    for name, phase in phases:
        if phase.user not in ROOT_USERS:
            problems.append(
                f"{name}.user={phase.user!r}: the container-free environment runs as root only"
            )
        if phase.network_mode is not None and phase.network_mode.value != "public":
            problems.append(
                f"{name}.network_mode={phase.network_mode.value!r}: the container-free "
                "environment has no network policy (the host's network)"
            )
        if phase.allowed_hosts:
            problems.append(
                f"{name}.allowed_hosts: the container-free environment has no allowlist"
            )
    if env.network_mode.value != "public" or env.allowed_hosts or env.allow_internet is False:
        problems.append(
            f"environment.network_mode={env.network_mode.value!r}: the container-free environment "
            "has no network policy (the host's network)"
        )
    if env.gpus or env.tpu is not None:
        problems.append("environment.gpus/tpu: the container-free environment has no accelerators")
    if env.os.value != "linux":
        problems.append(
            f"environment.os={env.os.value!r}: the container-free environment is Linux only"
        )
    if env.healthcheck is not None:
        problems.append(
            "environment.healthcheck: checks services an image's entrypoint starts; the "
            "container-free environment runs no image"
        )
    verifier_separate = [("verifier", config.verifier)]
    verifier_separate += [(f"steps.{s.name}.verifier", s.verifier) for s in config.steps or []]
    for name, verifier in verifier_separate:
        mode = verifier.environment_mode.value if verifier.environment_mode else None
        if verifier.environment is not None or mode == "separate":
            problems.append(
                f"{name}.environment: a separate verifier environment needs a container runtime"
            )
    if env.docker_image:
        problems.append(
            f"environment.docker_image={env.docker_image!r}: not applied by the container-free "
            "environment (tasks run on this host's filesystem); use a container environment"
        )
    env_dir = task_dir / "environment"
    for name in COMPOSE_FILES:
        if (env_dir / name).is_file():
            problems.append(f"environment/{name}: compose services need a container runtime")
    dockerfile = env_dir / "Dockerfile"
    if dockerfile.is_file():
        problems += _dockerfile_problems(dockerfile.read_text(), env.workdir or "/app")
    return problems


def _dockerfile_problems(text: str, workdir: str) -> list[str]:
    """Instructions of a Dockerfile the container-free environment would silently skip."""
    refused: dict[str, int] = {}
    continued = False
    for number, line in enumerate(text.splitlines(), 1):
        words = line.strip().split()
        was_continued, continued = continued, line.rstrip().endswith("\\")
        if was_continued or not words or words[0].startswith("#"):
            continue
        instruction = words[0].upper()
        if instruction in DOCKERFILE_HONOURED:
            continue
        if instruction == "WORKDIR" and len(words) == 2 and words[1].rstrip("/") == workdir:
            continue
        refused.setdefault(instruction, number)
    if not refused:
        return []
    listed = ", ".join(f"{name} (line {line})" for name, line in refused.items())
    return [
        f"environment/Dockerfile: {listed} not applied by the container-free environment "
        "(tasks run on this host's filesystem, not the image); use a container environment"
    ]


def task_directories(root: Path) -> list[Path]:
    """`root` itself when it is a task, else every task below it (any depth), sorted."""
    root = Path(root)
    if (root / "task.toml").is_file():
        return [root]
    return sorted(p.parent for p in root.rglob("task.toml"))


def refusals(
    tasks: Iterable[Path], environment_type: str | None, import_path: str | None
) -> dict[Path, list[str]]:
    """The refused tasks among `tasks` with their reasons, for the chosen environment."""
    container_free = is_container_free(environment_type, import_path)
    found = {Path(t): check_task(t, container_free) for t in tasks}
    return {task: reasons for task, reasons in found.items() if reasons}


def refusal_line(task: Path, reasons: Sequence[str]) -> str:
    return f"refused {task}: " + "; ".join(reasons)


def screen_tasks(
    tasks: Sequence[Path],
    environment_type: str | None,
    import_path: str | None,
    report: Callable[[str], Any],
    field: str = "tasks",
) -> list[Path]:
    """`tasks` minus the refused ones; `report` gets one `task_config` line per refused task
    (the loop's startup screen). ConfigError naming `field` when every task is refused."""
    refused = refusals(tasks, environment_type, import_path)
    for task, reasons in refused.items():
        report(f"task_config: {refusal_line(task, reasons)}")
    accepted = [t for t in tasks if Path(t) not in refused]
    if tasks and not accepted:
        raise ConfigError(
            f"{field}: all {len(tasks)} tasks are refused by the chosen environment (see the "
            "lines above, or run `oneloop tasks check DIR`)"
        )
    return accepted


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="oneloop tasks", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    check = sub.add_parser("check", help="refuse tasks the environment cannot run")
    check.add_argument("dir", type=Path, help="a task directory or a directory of tasks")
    check.add_argument(
        "--environment",
        default=NO_CONTAINER_IMPORT_PATH,
        help="a Harbor environment type (docker, modal, ...) or module:Class import path "
        f"(default: {NO_CONTAINER_IMPORT_PATH})",
    )
    check.add_argument(
        "--oracle", action="store_true", help="run the oracle over the accepted tasks"
    )
    check.add_argument("--concurrency", type=int, default=8, help="oracle trials at once")
    check.add_argument(
        "--trials-dir", type=Path, help="where oracle trials go (default: a temp dir)"
    )
    return parser.parse_args(argv)


def environment_choice(value: str) -> tuple[str | None, str | None]:
    """(environment_type, import_path) of an `--environment` value."""
    return (None, value) if ":" in value else (value, None)


def main(argv: list[str]) -> int:
    """`oneloop tasks check`: exit 0 when every task is accepted (and, with --oracle, scores
    above 0), 1 when some are refused or score 0, 2 on bad input."""
    args = _parse(argv)
    tasks = task_directories(args.dir)
    if not tasks:
        print(f"error: {args.dir}: no task.toml found (expected a Harbor task directory)",
              file=sys.stderr)  # fmt: skip
        return 2
    environment_type, import_path = environment_choice(args.environment)
    refused = refusals(tasks, environment_type, import_path)
    for task, reasons in refused.items():
        print(refusal_line(task, reasons))
    accepted = [t for t in tasks if t not in refused]
    print(f"{len(accepted)} of {len(tasks)} tasks accepted for {args.environment}")
    failing: list[Path] = []
    if args.oracle and accepted:
        try:
            failing = asyncio.run(_oracle_zeros(accepted, environment_type, import_path, args))
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        for task, why in failing:
            print(f"oracle 0 {task}: {why}")
        print(f"oracle: {len(accepted) - len(failing)} of {len(accepted)} tasks score > 0")
    return 1 if refused or failing else 0


async def _oracle_zeros(
    tasks: list[Path], environment_type: str | None, import_path: str | None, args: Any
) -> list[tuple[Path, str]]:
    """Tasks whose reference solution scores 0 (or errors) under the oracle agent."""
    import tempfile

    from oneloop.agents.trials import TrialRunner, TrialRunnerConfig
    from oneloop.backends.ray_runtime import init_ray

    trials_dir = args.trials_dir or Path(tempfile.mkdtemp(prefix="oneloop-oracle-"))
    runner = TrialRunner(
        TrialRunnerConfig(
            trials_dir=trials_dir,
            agent_import_path=None,
            agent_name="oracle",
            environment_import_path=import_path,
            environment_type=environment_type,
            max_concurrent_trials=args.concurrency,
            max_infra_retries=0,
        )
    )
    init_ray(include_dashboard=False, configure_logging=False)
    async with asyncio.timeout(ORACLE_TIMEOUT_SEC * (1 + len(tasks) // args.concurrency)):
        groups = await asyncio.gather(*(runner.run_group(t, 1, None) for t in tasks))
    zeros = []
    for task, group in zip(tasks, groups, strict=True):
        (result,) = group.results
        if result.reward is None or result.reward <= 0:
            why = f"reward {result.reward}" if result.error is None else result.error
            zeros.append((task, f"{result.outcome}: {why.splitlines()[0][:200]}"))
    return zeros
