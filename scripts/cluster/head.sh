#!/usr/bin/env bash
# Start the Ray head on this node (run it first, on the node that will run `oneloop train`).
#   scripts/cluster/head.sh                 # port 6379, every GPU and CPU of the node
#   RAY_PORT=6380 scripts/cluster/head.sh
# Then on every other node: scripts/cluster/worker.sh <this node's IP>:6379
# Train on the head with the config's backend.local.ray_address: auto (or pass the override
# `backend.local.ray_address=auto`); check the layout first with `oneloop train --plan`.
set -euo pipefail
PORT="${RAY_PORT:-6379}"
IP="${RAY_NODE_IP:-$(hostname -I | awk '{print $1}')}"
# No dashboard: the local backend does not need it (one port less open on the cluster network).
exec ray start --head --node-ip-address="$IP" --port="$PORT" --include-dashboard=false \
    --disable-usage-stats "$@"
