"""`oneloop demo` (the README's first command): the CPU demo on the embedded default.

Builds the tiny model, generates the calculator task family, runs the SFT warm start and async RL
on the local backend (Ray, torch engines), and ends with the held-out success rate before vs after
RL. Equivalent to `scripts/train.py --config demo-cpu`; extra arguments are dotted overrides.

The design, stated because the warm start is imperfect on purpose: SFT gives the format, RL gives
correctness. The model is `oneloop/tiny-qwen3-demo` (0.9 M parameters, tools listed in the compact
style, ~235 tokens per episode). The preset's `sft.wrong_tool_fraction` makes exactly 55 % of the
`-` and `/` demonstrations call the inverse tool (`add` for `-`, `multiply` for `/`) and submit
its result; the warm start's rate decays linearly to 0 so it ends settled. After SFT the model
copies numbers, calls tools and submits in the right format, but greedy decoding picks the
demonstrated majority tool, so the held-out `-` and `/` questions fail (and `+`/`*` ones succeed
as far as copying allows). Rollouts at temperature 1 still sample the right tool often enough for
group-relative advantages to favour it, and RL shifts the choice. Task generation, the choice of
imperfect demonstrations (a hash of the question), data order and sampling seeds are all fixed;
the warm start repeats exactly, RL up to the order in which asynchronous rollouts finish.
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
    masked = [int(summary.get(f"{p}/masked", 0)) for p in ("eval_before", "eval_after")]
    n = int(summary.get("eval_after/n", 0))
    print(
        f"held-out success: {before:.3f} after SFT -> {after:.3f} after RL "
        f"({after - before:+.3f}) on {n} tasks; {time.time() - started:.0f}s; run dir {cfg.run_dir}"
    )
    if any(masked):
        # A masked evaluation trial (infrastructure error) counts as a failure in the rate above.
        print(f"warning: {masked[0]} / {masked[1]} held-out trials masked (before / after RL)")
    return 0
