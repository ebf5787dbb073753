"""The `oneloop` command line: `demo`, `train`, `serve`, `bench`, `eval`, `inspect`, `size`.

Each subcommand lives in its own module (named below); this file only dispatches.
"""

import argparse
import importlib
import sys

COMMANDS = {
    "demo": "oneloop.demo",
    "train": "oneloop.loop.cli",
    "serve": "oneloop.backends.megatron_local.serve.server",
    "bench": "oneloop.bench",
    "eval": "oneloop.diagnostics.eval_cli",
    "inspect": "oneloop.diagnostics.inspect_cli",
    "size": "oneloop.diagnostics.size",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="oneloop", description=__doc__)
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to run")
    args = parser.parse_args(argv[:1])
    module = importlib.import_module(COMMANDS[args.command])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
