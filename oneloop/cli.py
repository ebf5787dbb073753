"""The `oneloop` command line: `demo`, `serve`, `bench`.

Each subcommand lives in its own module; this file only dispatches.
"""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="oneloop", description=__doc__)
    parser.add_argument("command", choices=["demo", "train", "serve", "bench"], help="what to run")
    args, rest = parser.parse_known_args(argv[:1])
    rest = argv[1:]
    if args.command == "demo":
        from oneloop.demo import main as demo_main

        return demo_main(rest)
    if args.command == "train":
        from oneloop.loop.cli import main as train_main

        return train_main(rest)
    if args.command == "serve":
        from oneloop.backends.megatron_local.serve import serve_main

        return serve_main(rest)
    from oneloop.bench import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
