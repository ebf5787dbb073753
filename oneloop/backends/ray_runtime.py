"""Starting the local Ray runtime, with a bounded retry of one known transient failure.

Ray waits a fixed 30 s for a fresh raylet to register with its GCS (`ray/_private/node.py`) and
then gives up with "The current node timed out during startup". On an overloaded host (measured:
a 2-core machine at load 20+) that is a slow start, not a broken install; the half-started
processes are shut down and Ray is started again, at most `attempts` times. Any other error, and
the last attempt's, is raised as Ray raised it.
"""

import logging
import time
from typing import Any

import ray

log = logging.getLogger(__name__)

SLOW_START = "timed out during startup"


def init_ray(attempts: int = 3, **kwargs: Any) -> None:
    """`ray.init(**kwargs)` unless Ray is already up; see the module docstring."""
    if ray.is_initialized():
        return
    for attempt in range(1, attempts + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as error:
            if SLOW_START not in str(error) or attempt == attempts:
                raise
            log.warning("Ray start %d/%d timed out (host overloaded?); retrying", attempt, attempts)
            ray.shutdown()
            time.sleep(2.0 * attempt)
