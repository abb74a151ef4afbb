#!/bin/sh
# Container entry point: build the default model if the volume lacks it, start a Ray head, then
# serve the deployment config (SHARDSERVE_CONFIG, default /etc/shardserve/config.yaml) on that head.
set -eu
CONFIG="${SHARDSERVE_CONFIG:-/etc/shardserve/config.yaml}"
if [ ! -f models/default/config.json ]; then
    echo "entrypoint: models/default is empty: building the default model (first start only)"
    shardserve data
    shardserve train --config recipes/default.yaml
fi
ray start --head --port=6379 --dashboard-host=0.0.0.0 --num-cpus="${RAY_NUM_CPUS:-2}" --disable-usage-stats
# exec: `docker stop` sends SIGTERM to shardserve itself, which drains in-flight requests
exec shardserve serve --config "$CONFIG" --address 127.0.0.1:6379
