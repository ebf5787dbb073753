"""`oneloop demo` (the README's first command): the CPU demo on the embedded default.

Builds the tiny model, generates the calculator task family, runs the SFT warm start and async RL
on the local backend (Ray, torch engines), and ends with the held-out success rate before vs after
RL. Equivalent to `scripts/train.py --config demo-cpu`; extra arguments are dotted overrides.
"""

import asyncio
import json
import logging
import time

from oneloop.loop.config import load_config


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_config("demo-cpu", argv)
    from oneloop.loop.train import train

    started = time.time()
    summary = asyncio.run(train(cfg))
    before = summary.get("eval_before/success_rate", float("nan"))
    after = summary.get("eval_after/success_rate", float("nan"))
    print(json.dumps({k: round(v, 4) for k, v in sorted(summary.items())}, indent=1))
    print(
        f"held-out success: {before:.3f} after SFT -> {after:.3f} after RL "
        f"({after - before:+.3f}); {time.time() - started:.0f}s; run dir {cfg.run_dir}"
    )
    return 0
