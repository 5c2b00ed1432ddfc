#!/usr/bin/env bash
# Submit a qerl training run to a Ray cluster as a Ray job, from the repository root:
#   RAY_ADDRESS=http://127.0.0.1:8265 bash deploy/cluster/submit.sh [CONFIG] [OVERRIDES ...]
# RAY_ADDRESS is the head's job server (the dashboard port, 8265 by default; reach a remote head
# through `ray dashboard deploy/cluster/ray-cluster.yaml` or an SSH tunnel to 127.0.0.1).
# The entrypoint is `python -m deploy.cli`, not `qerl`: the job runs in Ray's copy of this
# folder, where the `qerl` console script is not on the PATH. train.run_dir must be absolute
# and on shared storage (a relative one would land in Ray's temporary package folder).
set -euo pipefail
config="${1:-configs/qwen2.5-7b_cluster.yaml}"
shift $(( $# ? 1 : 0 ))
: "${RAY_ADDRESS:?set RAY_ADDRESS to the job server of the head, e.g. http://127.0.0.1:8265}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
exec ray job submit --address "$RAY_ADDRESS" --runtime-env deploy/cluster/runtime_env.yaml \
    -- python -m deploy.cli train --config "$config" "$@"
