#!/usr/bin/env python
"""Wait until the Ray cluster at `auto` (this node's) has N alive nodes; exit 1 after a timeout.

    python scripts/cluster/wait_nodes.py 16 --timeout 600
"""

import argparse
import sys
import time


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("nodes", type=int, help="alive nodes to wait for")
    parser.add_argument("--address", default="auto", help="Ray address (default: auto)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    args = parser.parse_args(argv)
    import ray

    ray.init(address=args.address, include_dashboard=False, log_to_driver=False)
    deadline = time.monotonic() + args.timeout
    alive = 0
    while time.monotonic() < deadline:
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        if alive >= args.nodes:
            print(f"ray: {alive} nodes alive")
            return 0
        time.sleep(2.0)
    print(f"ray: only {alive} of {args.nodes} nodes alive after {args.timeout:.0f} s",
          file=sys.stderr)  # fmt: skip
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
