"""oneloop: one asynchronous RL training loop for tool-using LLM agents.

The same loop trains on a local Ray cluster (`backend: local`) or on a remote Tinker service
(`backend: tinker`). See DESIGN notes in the README.
"""

import os

# Offline defaults for the libraries we start (Harbor, LiteLLM through Harbor, the tinker SDK, the
# Hugging Face hub). `setdefault` so a user who wants telemetry or the hub can still opt in.
for _key, _value in (
    ("HARBOR_TELEMETRY", "0"),
    ("LITELLM_LOCAL_MODEL_COST_MAP", "True"),
    ("TINKER_TELEMETRY", "0"),
    ("HF_HUB_OFFLINE", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
    # Ray starts worker processes at nice 15 (so its own daemons win); our workers are the trainer
    # and sampler engines, the work itself: at 15 they lose every contended core (measured: the
    # actor path 1.2-1.6x slower than the same engine in-process on a busy 2-core machine).
    ("RAY_worker_niceness", "0"),
):
    os.environ.setdefault(_key, _value)

__version__ = "0.1.0"
