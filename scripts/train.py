#!/usr/bin/env python
"""The one training script: the same config trains on the local Ray backend or a Tinker service.

    python scripts/train.py --config demo-cpu                       # local backend (default)
    python scripts/train.py --config demo-cpu --backend tinker --base-url http://127.0.0.1:8000 \
        --api-key tml-local
    python scripts/train.py --config qwen3-8b-1node algo.max_staleness=3 algo.max_steps=2
    python scripts/train.py --config demo-cpu --resume    # continue from checkpoints.jsonl
"""

import sys

from oneloop.loop.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
