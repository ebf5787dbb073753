"""Loop checkpoints: trainer state through `save_state`, loop state appended to checkpoints.jsonl.

A line is written only after `save_state` returned, so the last complete line always names a
trainer checkpoint that exists. Resume reads the last complete line (a torn line from a crash
mid-write is ignored).
"""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

CHECKPOINTS_FILE = "checkpoints.jsonl"


@dataclass(frozen=True)
class LoopState:
    """Everything besides the trainer's weights and optimizer needed to continue a run."""

    step: int
    """Optimizer steps of RL done."""
    trainer_path: str
    """`tinker://…/weights/…` of the trainer state saved at this step."""
    cursor: int
    """Task hand-outs issued so far (TaskSource.cursor)."""
    consumed: list[str] = field(default_factory=list)
    """Sample ids trained on (or dropped as zero-variance) up to this step."""
    sft_done: bool = True
    """Whether the SFT warm start has run."""
    eval_before: dict[str, float] = field(default_factory=dict)
    """Held-out metrics measured before RL."""
    warm_start: dict[str, float] = field(default_factory=dict)
    """The SFT warm start's figures (`sft/...`), logged in the step-0 line."""


def append_checkpoint(run_dir: Path, state: LoopState) -> None:
    path = run_dir / CHECKPOINTS_FILE
    with path.open("a") as handle:
        handle.write(json.dumps(asdict(state)) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def last_checkpoint(run_dir: Path) -> LoopState | None:
    path = run_dir / CHECKPOINTS_FILE
    if not path.is_file():
        return None
    state = None
    for line in path.read_text().splitlines():
        try:
            state = LoopState(**json.loads(line))
        except (json.JSONDecodeError, TypeError):
            continue  # a torn last line from a crash mid-write
    return state
