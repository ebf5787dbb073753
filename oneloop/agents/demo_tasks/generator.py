"""Generator of the demo task family: calculator questions as Harbor task directories.

This module owns the question generator (deterministic from a seed, three difficulty levels,
disjoint train and held-out splits) and the layout of each Harbor 0.25 task directory:

    <task>/instruction.md          the question and how to answer (call submit_answer)
    <task>/task.toml               timeouts, the stdio MCP server, metadata (difficulty, split, ...)
    <task>/environment/            empty: the no-container environment needs no image
    <task>/tests/test.sh           verifier: /logs/agent/answer.txt vs /tests/expected_answer.txt
    <task>/tests/expected_answer.txt
    <task>/solution/solve.sh       for Harbor's `oracle` agent: writes the right answer

Fault injection (for tests) is a per-task `Fault`: MCP server flags, a task environment variable
read by `NoContainerEnvironment.start`, or a verifier that writes no reward.
"""

from __future__ import annotations

import json
import logging
import random
import shlex
import sys
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from oneloop.errors import ConfigError

SERVER_MODULE = "oneloop.agents.demo_tasks.server"
MCP_SERVER_NAME = "calculator"
ANSWER_ENV_PATH = "/logs/agent/answer.txt"
FAMILY = "oneloop-demo-calculator"
DEFAULT_AGENT_TIMEOUT_SEC = 120.0
DEFAULT_VERIFIER_TIMEOUT_SEC = 30.0
_VERIFY_SH = Path(__file__).with_name("verify.sh")
log = logging.getLogger(__name__)


class Difficulty(StrEnum):
    EASY = "easy"  # a op b
    MEDIUM = "medium"  # (a op b) op c
    HARD = "hard"  # ((a op b) op c) op d, with exact division


class Fault(StrEnum):
    """Fault-injection knobs for tests; NONE for real tasks."""

    NONE = "none"
    TOOL_HANG = "tool_hang"  # `add` never returns
    TOOL_HUGE = "tool_huge"  # `add` returns 1 MB of text
    SERVER_CRASH = "server_crash"  # the MCP server answers its first tool call, then exits (3)
    ENV_START_FAIL = "env_start_fail"  # NoContainerEnvironment.start raises
    NO_REWARD = "no_reward"  # the verifier runs but writes no reward file


@dataclass(frozen=True)
class Question:
    text: str  # e.g. "(17 + 25) * 3"
    answer: int
    difficulty: Difficulty


@dataclass(frozen=True)
class DemoTask:
    task_id: str
    path: Path
    question: Question
    split: str  # "train" | "eval" | "demonstrations"
    fault: Fault


@dataclass(frozen=True)
class TaskSplits:
    train: tuple[DemoTask, ...]
    eval: tuple[DemoTask, ...]
    demonstrations: tuple[DemoTask, ...] = ()
    """Tasks drawn for the warm start's demonstrations only, apart from train and eval."""


_OPS = ("+", "-", "*", "/")
_STEPS = {Difficulty.EASY: 1, Difficulty.MEDIUM: 2, Difficulty.HARD: 3}
_MAX_LITERAL = {Difficulty.EASY: 50, Difficulty.MEDIUM: 30, Difficulty.HARD: 20}


def make_question(
    rng: random.Random, difficulty: Difficulty, first_op: str | None = None
) -> Question:
    """One question: a left-nested expression with integer intermediate results. `first_op`
    (one of + - * /) fixes the innermost operator (the only one of an easy question); otherwise
    every operator is drawn."""
    if first_op is not None and first_op not in _OPS:
        raise ConfigError(f"first_op must be one of {' '.join(_OPS)}, got {first_op!r}")
    top = _MAX_LITERAL[difficulty]
    value = rng.randint(2, top)
    text = str(value)
    for step in range(_STEPS[difficulty]):
        op = first_op if step == 0 and first_op is not None else rng.choice(_OPS)
        operand = 0
        if op == "/" and step == 0:
            # The first literal is redrawn as a multiple of the divisor, so that `/` is as
            # likely as the other operators (it was about one question in ten).
            operand = rng.randint(2, 12)
            value = operand * rng.randint(1, max(1, top // operand))
            text = str(value)
        elif op == "/":
            divisors = [d for d in range(2, 13) if value != 0 and value % d == 0]
            if divisors:
                operand = rng.choice(divisors)
            else:
                op = rng.choice(_OPS[:3])
        if op == "-" and value < 2:
            op = rng.choice(("+", "*"))
        if op == "/":
            value //= operand
        else:
            # A difference never goes below zero: the tiny demo model miscopies negative results
            # under greedy decoding (a tool answers -18, it submits -188), which RL on the choice
            # of tool cannot fix and which hid what RL did learn.
            high = min(top, value) if op == "-" else 12 if op == "*" else top
            operand = rng.randint(2, high)
            value = {"+": value + operand, "-": value - operand, "*": value * operand}[op]
        text = f"{text} {op} {operand}" if step == 0 else f"({text}) {op} {operand}"
    return Question(text=text, answer=value, difficulty=difficulty)


def instruction_text(question: Question) -> str:
    # Short on purpose: the instruction is in every prompt the tiny demo model trains on.
    return f"What is {question.text}?\nUse the calculator tools, then submit_answer the result.\n"


def _server_args(fault: Fault) -> list[str]:
    extra = {
        Fault.TOOL_HANG: ["--hang-tool", "add"],
        Fault.TOOL_HUGE: ["--huge-tool", "add"],
        Fault.SERVER_CRASH: ["--exit-after-tool-replies", "2"],  # tools/list, one call
    }.get(fault, [])
    return ["-m", SERVER_MODULE, "--answer-path", ANSWER_ENV_PATH, *extra]


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def task_toml(
    task: DemoTask, python: str, agent_timeout_sec: float, verifier_timeout_sec: float
) -> str:
    args = ", ".join(_toml_str(a) for a in _server_args(task.fault))
    env_block = ""
    if task.fault is Fault.ENV_START_FAIL:
        from oneloop.agents.environment import INJECT_START_FAILURE_ENV

        env_block = f'\n[environment.env]\n{INJECT_START_FAILURE_ENV} = "1"\n'
    return f"""schema_version = "1.4"

[metadata]
family = {_toml_str(FAMILY)}
task_id = {_toml_str(task.task_id)}
difficulty = {_toml_str(task.question.difficulty.value)}
category = {_toml_str("arithmetic/" + task.question.difficulty.value)}
split = {_toml_str(task.split)}
fault = {_toml_str(task.fault.value)}

[agent]
timeout_sec = {agent_timeout_sec!r}

[verifier]
timeout_sec = {verifier_timeout_sec!r}

[environment]
workdir = "/app"
{env_block}
[[environment.mcp_servers]]
name = {_toml_str(MCP_SERVER_NAME)}
transport = "stdio"
command = {_toml_str(python)}
args = [{args}]
"""


def write_task(
    task: DemoTask,
    python: str = sys.executable,
    agent_timeout_sec: float = DEFAULT_AGENT_TIMEOUT_SEC,
    verifier_timeout_sec: float = DEFAULT_VERIFIER_TIMEOUT_SEC,
) -> Path:
    """Write one Harbor task directory at `task.path`."""
    root = task.path
    for sub in ("environment", "tests", "solution"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "instruction.md").write_text(instruction_text(task.question))
    (root / "task.toml").write_text(
        task_toml(task, python, agent_timeout_sec, verifier_timeout_sec)
    )
    test_sh = root / "tests" / "test.sh"
    if task.fault is Fault.NO_REWARD:
        test_sh.write_text("#!/bin/sh\n# Injected fault: the verifier writes no reward.\nexit 0\n")
    else:
        test_sh.write_text(_VERIFY_SH.read_text())
    test_sh.chmod(0o755)
    (root / "tests" / "expected_answer.txt").write_text(f"{task.question.answer}\n")
    solve = root / "solution" / "solve.sh"
    solve.write_text(
        "#!/bin/sh\nset -e\n"
        f"mkdir -p {shlex.quote(str(Path(ANSWER_ENV_PATH).parent))}\n"
        f"echo {task.question.answer} > {shlex.quote(ANSWER_ENV_PATH)}\n"
    )
    solve.chmod(0o755)
    return root


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")


def generate_tasks(
    out_dir: Path | str,
    n_train: int,
    n_eval: int,
    seed: int,
    *,
    difficulties: tuple[Difficulty, ...] = tuple(Difficulty),
    fault: Fault = Fault.NONE,
    python: str = sys.executable,
    agent_timeout_sec: float = DEFAULT_AGENT_TIMEOUT_SEC,
    verifier_timeout_sec: float = DEFAULT_VERIFIER_TIMEOUT_SEC,
    n_demonstrations: int = 0,
) -> TaskSplits:
    """Write `n_train + n_eval + n_demonstrations` task dirs under
    `out_dir/{train,eval,demonstrations}/`; same seed → same tasks, and the train and eval tasks
    do not depend on `n_demonstrations` (drawn last).

    Difficulties cycle through `difficulties` and, independently, the innermost operator through
    + - * / (so each operator is a quarter of every split, give or take one: a repeated question is
    redrawn with the same operator). Easy `/` questions are the fewest (102); once an operator's
    questions are used up, its turns are drawn with any operator and a warning counts them. No
    question text appears in two splits.
    """
    _check_counts(n_train=n_train, n_eval=n_eval, n_demonstrations=n_demonstrations)
    if not difficulties:
        raise ConfigError("difficulties must name at least one Difficulty")
    if agent_timeout_sec <= 0 or verifier_timeout_sec <= 0:
        raise ConfigError("agent_timeout_sec and verifier_timeout_sec must be > 0")
    out = Path(out_dir)
    rng = random.Random(seed)
    seen: set[str] = set()
    counts = {"train": n_train, "eval": n_eval, "demonstrations": n_demonstrations}
    splits: dict[str, list[DemoTask]] = {split: [] for split in counts}
    short: Counter[tuple[str, str, str]] = Counter()
    used_up: set[tuple[Difficulty, str]] = set()  # not drawn for again: every later turn would fail
    for split, count in counts.items():
        for index in range(count):
            difficulty = difficulties[index % len(difficulties)]
            first_op = _OPS[index % len(_OPS)]
            question = None
            if (difficulty, first_op) not in used_up:
                question = _draw_new(rng, difficulty, first_op, seen)
            if question is None:  # that operator's questions are used up: any operator
                used_up.add((difficulty, first_op))
                short[(split, difficulty.value, first_op)] += 1
                question = _draw_new(rng, difficulty, None, seen, tries=10_000)
            if question is None:
                raise ConfigError(
                    f"could not draw {split} task {index}: nearly every {difficulty} question is "
                    f"taken by the {sum(counts.values())} tasks asked for (n_train + n_eval + "
                    "n_demonstrations); ask for fewer"
                )
            seen.add(question.text)
            task_id = f"{split}-{index:05d}-{difficulty.value}"
            task = DemoTask(task_id, out / split / task_id, question, split, fault)
            write_task(task, python, agent_timeout_sec, verifier_timeout_sec)
            splits[split].append(task)
    for (split, difficulty_name, op), drawn_otherwise in short.items():
        log.warning(
            "demo tasks: every %s question with %r first was taken; %d %s tasks were drawn with "
            "another operator instead (that split has fewer %r questions than the others)",
            difficulty_name, op, drawn_otherwise, split, op,
        )  # fmt: skip
    return TaskSplits(**{split: tuple(tasks) for split, tasks in splits.items()})


def _draw_new(
    rng: random.Random, difficulty: Difficulty, first_op: str | None, seen: set[str],
    tries: int = 1_000,
) -> Question | None:
    """A question not in `seen` (drawn up to `tries` times), or None."""
    for _ in range(tries):
        question = make_question(rng, difficulty, first_op)
        if question.text not in seen:
            return question
    return None
