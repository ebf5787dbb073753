"""`oneloop train` / `scripts/train.py`: config file + dotted overrides + backend switch."""

import argparse
import asyncio
import logging
import sys

from oneloop.errors import ConfigError
from oneloop.loop.config import load_config


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="oneloop train", description=__doc__)
    parser.add_argument("--config", default="demo-cpu", help="YAML file or preset name")
    parser.add_argument("--backend", choices=["local", "tinker"], help="overrides backend.backend")
    parser.add_argument("--base-url", help="tinker backend: service URL (backend.tinker.base_url)")
    parser.add_argument("--api-key", help="tinker backend: API key (else TINKER_API_KEY)")
    parser.add_argument("--run-dir", help="overrides run_dir")
    parser.add_argument("--max-steps", type=int, help="overrides algo.max_steps")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"backend.backend={args.backend}")
    if args.base_url:
        overrides.append(f"backend.tinker.base_url={args.base_url}")
    if args.api_key:
        overrides.append(f"backend.tinker.api_key={args.api_key}")
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    if args.max_steps is not None:
        overrides.append(f"algo.max_steps={args.max_steps}")
    return args, overrides


def main(argv: list[str]) -> int:
    args, overrides = parse(argv)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from oneloop.loop.train import train

    try:  # a knob the backend cannot honour fails in setup, before SFT or RL start
        summary = asyncio.run(train(cfg, resume=args.resume))
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    print({k: round(v, 4) for k, v in summary.items() if k.startswith(("eval", "rollout/reward"))})
    return 0
