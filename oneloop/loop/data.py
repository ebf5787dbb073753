"""The order in which training tasks are handed to rollout groups, and what was consumed.

Every hand-out is a *sample id* `"<epoch>:<position>"` into a per-epoch permutation seeded by
(seed, epoch), so the order is reproducible without saving RNG state. The loop records the ids it
trained on; on resume, ids handed out but never trained (groups in flight at a crash) are handed
out again first, so no task is lost and none is trained twice.
"""

import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TaskItem:
    """One hand-out: a stable id and the Harbor task directory."""

    sample_id: str
    task: Path


class TaskSource:
    """Deterministic, resumable stream of training tasks."""

    def __init__(
        self,
        tasks: list[Path],
        seed: int,
        cursor: int = 0,
        consumed: set[str] | None = None,
        max_attempts: int = 3,
    ) -> None:
        if not tasks:
            raise ValueError("tasks: the training split is empty")
        self.tasks = sorted(tasks)
        self.seed = seed
        self.consumed: set[str] = set(consumed or ())
        self.attempts: dict[str, int] = {}
        self.max_attempts = max_attempts
        self.cursor = 0
        self._requeued: deque[str] = deque()
        # Everything handed out before the resume point and not trained is re-run first.
        for index in range(cursor):
            sample_id = self._id(index)
            if sample_id not in self.consumed:
                self._requeued.append(sample_id)
        self.cursor = cursor

    def _id(self, index: int) -> str:
        epoch, position = divmod(index, len(self.tasks))
        return f"{epoch}:{position}"

    def _task(self, sample_id: str) -> Path:
        epoch, position = (int(x) for x in sample_id.split(":"))
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return self.tasks[order[position]]

    def next(self) -> TaskItem:
        """The next task to run (re-queued ones first)."""
        if self._requeued:
            sample_id = self._requeued.popleft()
        else:
            sample_id = self._id(self.cursor)
            self.cursor += 1
        return TaskItem(sample_id, self._task(sample_id))

    def requeue(self, item: TaskItem) -> bool:
        """A group for `item` was abandoned (timeout, masked): run it again before new tasks.

        After `max_attempts` abandoned groups the task is dropped instead (marked consumed, so a
        resume does not retry it either); returns False then.
        """
        self.attempts[item.sample_id] = self.attempts.get(item.sample_id, 0) + 1
        if self.attempts[item.sample_id] >= self.max_attempts:
            self.consumed.add(item.sample_id)
            return False
        self._requeued.appendleft(item.sample_id)
        return True

    def mark_consumed(self, sample_ids: list[str]) -> None:
        """These ids were trained on; a second time is a bug."""
        twice = self.consumed.intersection(sample_ids)
        if twice:
            raise RuntimeError(f"sample ids trained twice: {sorted(twice)[:5]}")
        self.consumed.update(sample_ids)


def sample_seed(sample_id: str, base: int) -> int:
    """A sampling seed derived from the sample id, so reruns draw the same tokens."""
    epoch, position = (int(x) for x in sample_id.split(":"))
    return (base * 7_919 + epoch * 1_000_003 + position * 131) % (2**31)
