"""The training loop on the device's GPU, as a user runs it (issue 20): kill-and-resume, and the
same run in-process vs through `oneloop serve`.

    python3 scripts/device/runbook/loop_gpu.py resume --out $OUT     # kill -9 mid-run, --resume
    python3 scripts/device/runbook/loop_gpu.py local --out $OUT      # LoRA RL in-process
    python3 scripts/device/runbook/loop_gpu.py serve --out $OUT      # the same through serve

`resume` runs `oneloop train --config demo-gpu` (SFT warm start, then RL with a checkpoint every
step), kills its whole process group with SIGKILL once step 2 is checkpointed, then runs
`--resume` to the end and checks what the CPU resume test checks, less the bitwise loss equality
(GPU sampling is not deterministic): every step logged once, the warm start not redone, no task
consumed twice, every trained sample trained in exactly one step. It then writes the warm start's
weights (the step-0 checkpoint) as a Hugging Face directory, the base of the next two stages.

`local` and `serve` run the same LoRA RL on that base (the `tinker` backend asks for LoRA: the
service it stands for has no full fine-tuning): in-process on the `local` backend, then with
`--backend tinker` against `oneloop serve` started here in front of the same GPU engines. Each
prints its per-step figures; `serve` prints both runs' side by side (keys and values) and the
step-time ratio. Results land in `--out` as JSON. `--config`/extra overrides make the same script
runnable on CPU (`--config demo-cpu`) to check it before spending device minutes.
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from oneloop.backends.megatron_local.serve.spawn import serve_process

ROOT = Path(__file__).resolve().parents[3]
RUNS = Path("/tmp/runs")
SFT_DIR = Path("/tmp/models/demo-gpu-sft")
API_KEY = "tml-device-local"  # the SDK wants a tml- key even on loopback
LORA = ["model.lora_rank=32", "sft=null", "algo.learning_rate=4e-4"]


def train_command(config: str, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "oneloop.cli", "train", "--config", config, "--run-dir",
            str(run_dir), f"backend.run_dir={run_dir / 'backend'}", *overrides]  # fmt: skip


def rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    path = run_dir / name
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.is_file() else []


def checkpoints(run_dir: Path) -> list[dict]:
    return rows(run_dir, "checkpoints.jsonl")


def gpu_processes() -> list[str]:
    if shutil.which("nvidia-smi") is None:  # a CPU check run
        return []
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return [line for line in out.stdout.splitlines() if line.strip()]


def wait_gpu_free(limit_s: float = 90) -> list[str]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and gpu_processes():
        time.sleep(1)
    return gpu_processes()


def run_to_end(command: list[str], log: Path, limit_s: float) -> int:
    with log.open("w") as out:
        try:
            return subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=limit_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            return 124


def resume(args: argparse.Namespace, extra: list[str]) -> dict:
    run_dir = RUNS / "resume"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = ["algo.max_steps=6", "checkpoint.every_steps=1", "eval=null", *extra]
    command = train_command(args.config, run_dir, *overrides)
    log = args.out / "resume_first.log"
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    while time.monotonic() - started < args.limit_s and proc.poll() is None:
        if any(c["step"] >= 2 for c in checkpoints(run_dir)):
            break
        time.sleep(0.5)
    if proc.poll() is not None:
        raise SystemExit(f"the run ended before it could be killed: {log.read_text()[-3000:]}")
    killed_at = max(c["step"] for c in checkpoints(run_dir))
    os.killpg(proc.pid, signal.SIGKILL)  # kill -9, Ray and the engines included
    proc.wait(timeout=60)
    first_s = time.monotonic() - started
    left = wait_gpu_free()
    second = args.out / "resume_second.log"
    t0 = time.monotonic()
    rc = run_to_end([*command, "--resume"], second, args.limit_s)
    resumed_s = time.monotonic() - t0
    text = second.read_text()
    steps = [r["step"] for r in rows(run_dir) if "train/loss" in r]
    last = checkpoints(run_dir)[-1]
    consumed = last["consumed"]
    trained: dict[str, set[int]] = {}
    for row in rows(run_dir, "logprob_gaps.jsonl"):
        trained.setdefault(row["sample_id"], set()).add(row["step"])
    result = {
        "rc": rc, "killed_after_step": killed_at, "first_s": round(first_s, 1),
        "resumed_s": round(resumed_s, 1), "gpu_processes_after_kill": left,
        "steps_logged": steps, "sft_redone": "sft 1/" in text,
        "consumed": len(consumed), "consumed_unique": len(set(consumed)),
        "trained_samples": len(trained),
        "trained_in_one_step": all(len(s) == 1 for s in trained.values()),
        "trained_subset_of_consumed": set(trained) <= set(consumed),
        "staleness_violations": sum(r.get("staleness/violations", 0) for r in rows(run_dir)),
    }  # fmt: skip
    result["ok"] = bool(
        rc == 0 and sorted(steps) == list(range(1, 7)) and not result["sft_redone"]
        and result["consumed"] == result["consumed_unique"] and result["trained_in_one_step"]
        and result["trained_subset_of_consumed"] and result["staleness_violations"] == 0
    )  # fmt: skip
    if rc != 0:
        result["tail"] = text[-3000:]
    try:
        export_warm_start(run_dir, args.sft_dir)
        result["sft_dir"] = str(args.sft_dir)
    except (StopIteration, OSError, SystemExit) as error:  # no step-0 checkpoint, a LoRA one
        result["sft_dir"] = None
        result["export_error"] = f"{type(error).__name__}: {error}"
    return result


def export_warm_start(run_dir: Path, target: Path) -> None:
    """The step-0 checkpoint (the warm start's weights) as a Hugging Face model directory: the base
    model's directory with the checkpoint's HF-named weights in place of its own."""
    step0 = next(c for c in checkpoints(run_dir) if c["step"] == 0)
    run_id, _, name = step0["trainer_path"].removeprefix("tinker://").split("/")
    ckpt = run_dir / "backend" / run_id / "weights" / name
    meta = json.loads((ckpt / "meta.json").read_text())
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(meta["model_dir"], target)
    for stale in target.glob("*.safetensors*"):
        stale.unlink()
    weights = ckpt / "model.safetensors"
    if not weights.is_file():
        raise SystemExit(f"{ckpt} has no model.safetensors (a LoRA or torch-engine checkpoint?)")
    shutil.copy(weights, target / "model.safetensors")


def step_figures(run_dir: Path) -> list[dict]:
    keep = ("step", "train/loss", "rollout/reward_mean", "time/step", "time/wait_for_rollouts",
            "train/logprob_gap_mean", "staleness/violations")  # fmt: skip
    return [{k: r[k] for k in keep if k in r} for r in rows(run_dir) if "train/loss" in r]


def lora_run(args: argparse.Namespace, extra: list[str], remote: bool) -> dict:
    name = "serve" if remote else "local"
    run_dir = RUNS / name
    shutil.rmtree(run_dir, ignore_errors=True)
    base = "demo-gpu-sft" if remote else str(args.sft_dir)
    kept = [o for o in extra if not o.startswith("sft.")]  # the LoRA runs start from the base
    overrides = [f"model.base_model={base}", f"algo.max_steps={args.steps}", *LORA, *kept]
    command = train_command(args.config, run_dir, *overrides)
    with contextlib.ExitStack() as stack:
        if remote:
            import yaml

            preset_file = ROOT / "oneloop" / "loop" / "presets" / f"{args.config}.yaml"
            preset = yaml.safe_load(preset_file.read_text())["backend"].get("local", {})
            backend = args.out / "serve_backend.json"
            backend.write_text(json.dumps({"backend": "local", "run_dir": str(run_dir / "serve"),
                                           "models": {"demo-gpu-sft": str(args.sft_dir)},
                                           "local": preset}))  # fmt: skip
            served = stack.enter_context(serve_process(
                ["--api-key", API_KEY, "--backend-config", str(backend)], cwd=ROOT,
                log=args.out / "serve_server.log"))  # fmt: skip
            command += ["--backend", "tinker", "--base-url", served.url, "--api-key", API_KEY]
        t0 = time.monotonic()
        rc = run_to_end(command, args.out / f"{name}.log", args.limit_s)
        wall = time.monotonic() - t0
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    result = {"rc": rc, "wall_s": round(wall, 1), "steps": step_figures(run_dir),
              "keys": sorted({k for r in rows(run_dir) if "train/loss" in r for k in r}),
              "eval_before": summary.get("eval_before/success_rate"),
              "eval_after": summary.get("eval_after/success_rate")}  # fmt: skip
    if rc != 0:
        result["tail"] = (args.out / f"{name}.log").read_text()[-3000:]
    (RUNS / f"loop_{name}.json").write_text(json.dumps(result, indent=1))  # for `compare`
    return result


def compare() -> dict:
    local = json.loads((RUNS / "loop_local.json").read_text())
    serve = json.loads((RUNS / "loop_serve.json").read_text())

    def mean_step(result: dict) -> float:
        times = [s["time/step"] for s in result["steps"][1:] if "time/step" in s]
        return sum(times) / max(1, len(times))

    def loop_keys(result: dict) -> list[str]:  # backend/*: what one backend can see of itself
        return [k for k in result["keys"] if not k.startswith("backend/")]

    return {
        "same_keys": loop_keys(local) == loop_keys(serve),
        "keys_only_local": sorted(set(local["keys"]) - set(serve["keys"])),
        "keys_only_serve": sorted(set(serve["keys"]) - set(local["keys"])),
        "step_time_local_s": round(mean_step(local), 3),
        "step_time_serve_s": round(mean_step(serve), 3),
        "serve_over_local": round(mean_step(serve) / max(1e-9, mean_step(local)), 3),
        "eval": {"local": [local["eval_before"], local["eval_after"]],
                 "serve": [serve["eval_before"], serve["eval_after"]]},
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["resume", "local", "serve"])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    parser.add_argument("--config", default="demo-gpu")
    parser.add_argument("--sft-dir", type=Path, default=SFT_DIR)
    parser.add_argument("--steps", type=int, default=6, help="RL steps of local/serve")
    parser.add_argument("--limit-s", type=float, default=420, help="bound on each train process")
    args, extra = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    RUNS.mkdir(parents=True, exist_ok=True)
    if args.stage == "resume":
        result = resume(args, extra)
    else:
        result = lora_run(args, extra, remote=args.stage == "serve")
        if args.stage == "serve" and (RUNS / "loop_local.json").is_file():
            result = {"serve": result, "side_by_side": compare()}
    (args.out / f"loop_gpu_{args.stage}.json").write_text(json.dumps(result, indent=1))
    print("RESULT", json.dumps(result))
    return 0 if result.get("ok", result.get("rc", 0) == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
