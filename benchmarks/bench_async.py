"""Async (S = 3) vs synchronous (S = 0) training on rollouts with heavy-tailed durations.

Runs the real loop (`oneloop.loop.train.rl`: staleness gate, rollout pool, trainer, weight sync on
the local backend) twice for the same number of steps. Only the Harbor trial is replaced: each
rollout is one real `sample` call on the current sampling client followed by a Pareto-distributed
sleep standing in for tool and environment latency (the regime the async loop is built for), and a
random 0/1 reward. Prints wall-clock of each mode, the ratio, and the trainer busy fraction.

    .venv/bin/python benchmarks/bench_async.py --steps 8
"""

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

from tinker import types

from oneloop.agents.tito import Trajectory
from oneloop.agents.trials import GroupResult, TrajectoryResult, TrialOutcome, TrialTimings
from oneloop.loop.config import load_config
from oneloop.loop.metrics import read_metrics
from oneloop.loop.train import rl, setup


class HeavyTailedRunner:
    """Rollouts = one real sample + a Pareto(alpha) × scale second sleep."""

    def __init__(self, alpha: float, scale: float, seed: int, prompt_tokens: int) -> None:
        self.alpha, self.scale, self.prompt_tokens = alpha, scale, prompt_tokens
        self.rng = random.Random(seed)

    async def run_group(self, task, n, client, agent_kwargs=None) -> GroupResult:
        async def one(i: int) -> TrajectoryResult:
            prompt = [1, 40 + i] + [50 + (j % 400) for j in range(self.prompt_tokens - 2)]
            params = types.SamplingParams(max_tokens=8, seed=self.rng.randrange(2**31), stop=[])
            out = await client.sample(types.ModelInput.from_ints(prompt), 1, params)
            trajectory = Trajectory.start(prompt).append_sampled(
                out.sequences[0], prompt=types.ModelInput.from_ints(prompt), fallback_version=0
            )
            await asyncio.sleep(min(self.scale * self.rng.paretovariate(self.alpha), 60.0))
            return TrajectoryResult(
                TrialOutcome.OK,
                float(self.rng.random() < 0.5),
                trajectory.to_json(),
                TrialTimings(),
                None,
                1,
                f"bench-{i}",
            )

        results = await asyncio.gather(*(one(i) for i in range(n)))
        return GroupResult(task=str(task), results=tuple(results), mask_reason=None)


async def run_mode(staleness: int, steps: int, args: argparse.Namespace, root: Path) -> dict:
    cfg = load_config(
        "demo-cpu",
        [
            f"run_dir={root / f's{staleness}'}",
            f"backend.run_dir={root / 'backend'}",
            f"algo.max_steps={steps}",
            f"algo.max_staleness={staleness}",
            f"algo.groups_per_step={args.groups}",
            f"algo.group_size={args.group_size}",
            "algo.filter_zero_variance=false",
            "sft=null",
            "eval=null",
            "logging.console=false",
            f"checkpoint.every_steps={steps}",
            "tasks.demo.n_train=8",
            "tasks.demo.n_eval=1",
            f"rollout.max_concurrency={args.concurrency}",
        ],
    )
    run = await setup(cfg, resume=False)
    started = time.monotonic()
    await rl(run, runner=HeavyTailedRunner(args.alpha, args.scale, staleness, args.prompt_tokens))
    wall = time.monotonic() - started
    run.logger.close()
    run.service.close()
    rows = [r for r in read_metrics(cfg.run_dir / "metrics.jsonl") if "train/loss" in r]
    busy = sum(r["time/trainer_busy_frac"] for r in rows[1:]) / max(len(rows) - 1, 1)
    return {
        "wall_s": wall,
        "trainer_busy_frac": busy,
        "violations": max(r["staleness/violations"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=1.5, help="Pareto shape (heavier < 2)")
    parser.add_argument("--scale", type=float, default=0.5, help="seconds")
    parser.add_argument("--prompt-tokens", type=int, default=8, help="tokens per rollout prompt")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        sync = asyncio.run(run_mode(0, args.steps, args, Path(root)))
        async_ = asyncio.run(run_mode(3, args.steps, args, Path(root)))
    print(
        json.dumps(
            {
                "sync_S0": sync,
                "async_S3": async_,
                "speedup_sync_over_async_wall": sync["wall_s"] / async_["wall_s"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
