"""The `oneloop` command line: `demo`, `train`, `serve`, `bench`, `eval`, `inspect`, `size`,
`tasks`.

Each subcommand lives in its own module (named below as `module:function`); this file only
dispatches. `bench` is the one exception: the benchmarks live in the source tree's `benchmarks/`
(they measure the code under development and are not part of the wheel), so `oneloop bench local`
runs `benchmarks/bench_local.py` (`oneloop bench sampling`: `bench_sampling.py`) of the checkout
this package was imported from, and says so when there is none (an installed wheel).
"""

import argparse
import importlib
import runpy
import sys
from pathlib import Path

COMMANDS = {
    "demo": "oneloop.loop.cli:demo",
    "train": "oneloop.loop.cli:main",
    "serve": "oneloop.backends.megatron_local.serve.server:serve_main",
    "bench": "oneloop.cli:bench",
    "eval": "oneloop.diagnostics.eval_cli:main",
    "inspect": "oneloop.diagnostics.inspect_cli:main",
    "size": "oneloop.diagnostics.size:main",
    "gateway": "oneloop.agents.gateway.server:main",
    "tasks": "oneloop.agents.tasks_check:main",
}
BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
"""The checkout's benchmarks (absent from an installed wheel)."""


BENCHES = ("local", "sampling")
"""`oneloop bench NAME` runs `benchmarks/bench_NAME.py`."""


def bench(argv: list[str]) -> int:
    """`oneloop bench local|sampling [...]`: `benchmarks/bench_<name>.py` of this checkout
    (`local` when no name is given)."""
    name = argv[0] if argv and not argv[0].startswith("-") else "local"
    if name not in BENCHES:
        print(f"error: oneloop bench: expected one of {', '.join(BENCHES)}, got {name!r}",
              file=sys.stderr)  # fmt: skip
        return 2
    script = BENCHMARKS_DIR / f"bench_{name}.py"
    if not script.is_file():
        print(
            f"error: oneloop bench needs the source tree's benchmarks/ ({script} not found); "
            "benchmarks are not installed with the wheel: run it from a git checkout",
            file=sys.stderr,
        )
        return 2
    return runpy.run_path(str(script))["main"](argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="oneloop", description=__doc__)
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to run")
    args = parser.parse_args(argv[:1])
    module, _, function = COMMANDS[args.command].partition(":")
    return getattr(importlib.import_module(module), function)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
