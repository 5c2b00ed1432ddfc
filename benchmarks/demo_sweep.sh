#!/usr/bin/env bash
# The demo recipe (configs/tiny_cpu.yaml) with GRPO and DAPO, AQN on and off, over several seeds,
# then one `qerl report` overlaying every run (OUT/report.png) and its text summary:
#   bash benchmarks/demo_sweep.sh [OUT] [SEEDS] [EXTRA OVERRIDES ...]
# OUT defaults to runs/demo_sweep, SEEDS to "0 1 2". The seed is the outer loop, so an interrupted
# sweep still holds every condition for the seeds it finished. About 5 minutes a run on 2 cores.
set -uo pipefail
out="${1:-runs/demo_sweep}"
seeds="${2:-0 1 2}"
shift $(( $# < 2 ? $# : 2 ))
qerl=".venv/bin/qerl"
[ -x "$qerl" ] || qerl=qerl
declare -A conditions=(
  [grpo_aqn]="learner.algorithm=grpo aqn.enabled=true"
  [grpo_noaqn]="learner.algorithm=grpo aqn.enabled=false"
  [dapo_aqn]="learner.algorithm=dapo aqn.enabled=true"
  [dapo_noaqn]="learner.algorithm=dapo aqn.enabled=false"
)
mkdir -p "$out"
for seed in $seeds; do
  for name in grpo_aqn grpo_noaqn dapo_aqn dapo_noaqn; do
    run="$out/${name}_s$seed"
    [ -f "$run/final_adapter/adapter_config.json" ] && { echo "=== $run: done before"; continue; }
    echo "=== $run"
    # shellcheck disable=SC2086  # the condition is a list of overrides
    "$qerl" train --config configs/tiny_cpu.yaml ${conditions[$name]} train.seed="$seed" \
        train.run_dir="$run" train.overwrite=true "$@" | grep -E '^(\[qerl\] (mean|eval)|qerl:)'
  done
done
"$qerl" report "$out"/*_s* --out "$out/report.png"
