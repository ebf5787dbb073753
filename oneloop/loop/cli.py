"""The loop's commands: `oneloop train` / `scripts/train.py` (config file + dotted overrides +
backend switch) and `oneloop demo` (the CPU demo preset, with its before/after report).

Exit status: 0 done; 1 the run stopped itself (`algo.max_zero_variance_in_a_row`) or failed
(a backend component failed, e.g. a trainer rank died: its message and the resume point are
printed, no traceback; `--resume` rebuilds the backend from the last checkpoint); 2 a bad
config; 128 + signal number after SIGTERM (143) or SIGINT (130), which stop the run
cleanly (see `oneloop.loop.signals`): the step in progress is abandoned, `--resume` redoes it.
"""

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from oneloop.errors import BackendError, ConfigError
from oneloop.loop.config import load_config
from oneloop.loop.signals import Stopped, run_stoppable

TRAIN_STOP_NOTE = "the step in progress is abandoned; --resume continues from the last checkpoint"


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="oneloop train", description=__doc__)
    parser.add_argument("--config", default="demo-cpu", help="YAML file or preset name")
    parser.add_argument("--backend", choices=["local", "tinker"], help="overrides backend.backend")
    parser.add_argument("--base-url", help="tinker backend: service URL (backend.tinker.base_url)")
    parser.add_argument("--api-key", help="tinker backend: API key (else TINKER_API_KEY)")
    parser.add_argument("--run-dir", help="overrides run_dir")
    parser.add_argument("--max-steps", type=int, help="overrides algo.max_steps")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print where ranks and engines go (node, GPU), start nothing",
    )
    parser.add_argument(
        "--cluster", type=Path, help="with --plan: a described cluster (YAML/JSON) instead of Ray's"
    )
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
    """`oneloop train`: load the config, run SFT (if set) and RL, print the summary's rates."""
    args, overrides = parse(argv)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    if args.plan or args.cluster:
        return print_plan(cfg, args.cluster, args.plan)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    summary, status = run_reporting(cfg, "oneloop train", resume=args.resume)
    if summary is None:
        return status
    print({k: round(v, 4) for k, v in summary.items() if k.startswith(("eval", "rollout/reward"))})
    return 0


def run_reporting(cfg, prog: str, resume: bool = False) -> tuple[dict | None, int]:
    """Run `train(cfg)` under the signal handlers: (its summary, 0), or (None, the exit status)
    after a one-line message for each way it can end early, with where `--resume` continues."""
    from oneloop.loop.rollouts import NoTrainableGroupsError
    from oneloop.loop.train import train

    try:  # a knob the backend cannot honour fails in setup, before SFT or RL start
        return run_stoppable(train(cfg, resume=resume), prog, TRAIN_STOP_NOTE), 0
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return None, 2
    except NoTrainableGroupsError as error:
        print(f"stopped: {error}", file=sys.stderr)
        return None, 1
    except BackendError as error:  # the step in progress is lost, the checkpoints are not
        print(f"{prog}: failed: {error}\n{resume_hint(cfg.run_dir)}", file=sys.stderr)
        return None, 1
    except Stopped as stop:
        print(f"{prog}: {stop}; {resume_hint(cfg.run_dir)}", file=sys.stderr)
        return None, stop.exit_status


def print_plan(cfg, cluster: Path | None, plan: bool) -> int:
    """`--plan [--cluster FILE]`: the backend's placement plan, printed; no engine starts.
    Exit 2 when the layout does not fit (the error names what is short)."""
    if not plan:
        print("config error: --cluster describes the cluster for --plan; add --plan",
              file=sys.stderr)  # fmt: skip
        return 2
    from oneloop.backends import plan as backend_plan

    try:
        placement = backend_plan(cfg.backend, cluster)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    print(placement.format())
    return 0


def resume_hint(run_dir: Path) -> str:
    """Where a stopped run resumes from (its last checkpoints.jsonl line)."""
    from oneloop.loop.checkpoints import last_checkpoint

    state = last_checkpoint(run_dir)
    if state is None:
        return "no checkpoint yet: --resume starts the run over"
    return f"--resume continues after step {state.step} ({run_dir / 'checkpoints.jsonl'})"


def demo(argv: list[str]) -> int:
    """`oneloop demo` (the README's first command): the CPU demo on the embedded default.

    Builds the tiny model, generates the calculator task family and its demonstrations, runs the
    SFT warm start and async RL on the local backend (Ray, torch engines), and ends with the
    held-out success rate before vs after RL. Equivalent to `scripts/train.py --config demo-cpu`;
    extra arguments are dotted overrides.

    The design, stated because the warm start is imperfect on purpose: SFT gives the format, RL
    gives correctness. The model is `oneloop/tiny-qwen3-demo` (0.9 M parameters, tools listed in
    the compact style, ~235 tokens per episode). The preset's `tasks.demo.wrong_tool_fraction`
    makes exactly 55 % of the `-` and `/` demonstrations call the inverse tool (`add` for `-`,
    `multiply` for `/`) and submit its result; the warm start's rate decays linearly to 0 so it
    ends settled. After SFT the model copies numbers, calls tools and submits in the right format,
    but greedy decoding picks the demonstrated majority tool, so the held-out `-` and `/`
    questions fail (and `+`/`*` ones succeed as far as copying allows). Rollouts at temperature 1
    still sample the right tool often enough for group-relative advantages to favour it, and RL
    shifts the choice. Task generation, the choice of imperfect demonstrations (a hash of the
    question), data order and sampling seeds are all fixed; the warm start repeats exactly, RL up
    to the order in which asynchronous rollouts finish.
    """
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config("demo-cpu", argv)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    started = time.time()
    summary, status = run_reporting(cfg, "oneloop demo")
    if summary is None:
        return status
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
