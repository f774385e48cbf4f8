#!/usr/bin/env bash
# Run a command with every 127.0.0.1 link capped at RATE: a fresh network namespace
# whose loopback goes through a token bucket filter. Needs root and iproute2.
#   sudo benchmarks/with_bandwidth.sh 1gbit .venv/bin/python benchmarks/torch_vs_ddp.py --algorithm bytegrad
set -euo pipefail
rate=$1; shift
ns="bxbench$$"
ip netns add "$ns"
trap 'ip netns delete "$ns"' EXIT
ip netns exec "$ns" ip link set lo mtu 9000 up
ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst 512kb latency 500ms
BAGUA_X_LINK="$rate" ip netns exec "$ns" "$@"
