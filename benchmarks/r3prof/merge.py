"""Sum benchmarks/r3prof's per-process files of one run: `merge.py DIR OUT.json` writes
{phase: {"Class.method": {"calls", "s", "us_per_call"}}} and prints, per phase, each
wrapped method's time per scheduled step."""

import json
import sys
from pathlib import Path


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    merged: dict[str, dict[str, list[float]]] = {}
    for f in sorted(src.glob("*.json")):
        for phase, funcs in json.loads(f.read_text()).items():
            for name, (calls, secs) in funcs.items():
                entry = merged.setdefault(phase, {}).setdefault(name, [0, 0.0])
                entry[0] += calls
                entry[1] += secs
    table = {
        phase: {
            name: {"calls": c, "s": round(s, 4), "us_per_call": round(1e6 * s / max(c, 1), 1)}
            for name, (c, s) in sorted(funcs.items())
        }
        for phase, funcs in merged.items()
    }
    out.write_text(json.dumps(table, indent=1))
    for phase, funcs in table.items():
        # one schedule() per model step (step_with_batch_queue runs twice a step when async)
        steps = funcs.get("Scheduler.schedule", {}).get("calls", 0)
        print(f"R3PROF {phase}: {steps} scheduled steps")
        for name, e in sorted(funcs.items(), key=lambda kv: -kv[1]["s"]):
            per_step = 1e3 * e["s"] / steps if steps else float("nan")
            print(f"R3PROF   {name:<42}{e['calls']:>8}{e['s']:>9.3f} s{per_step:>9.3f} ms/step")


if __name__ == "__main__":
    main()
