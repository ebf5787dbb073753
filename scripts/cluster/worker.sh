#!/usr/bin/env bash
# Join this node to a Ray cluster: scripts/cluster/worker.sh HEAD_IP:PORT [extra `ray start` flags]
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: $0 HEAD_IP:PORT [ray start flags]" >&2
    exit 2
fi
HEAD="$1"
shift
IP="${RAY_NODE_IP:-$(hostname -I | awk '{print $1}')}"
exec ray start --address="$HEAD" --node-ip-address="$IP" --disable-usage-stats "$@"
