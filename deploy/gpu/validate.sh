#!/usr/bin/env bash
# GPU validation on one H200 with vLLM 0.26 (see ../shared/gpu/README.md for the install):
#   bash .gpu/install.sh install && source .gpu/env.sh && bash deploy/gpu/validate.sh [STAGE ...]
# Stages (default: all but engine-core and levers, in this order): tests rollout sync learner train;
# engine-core compares vLLM's engine core in its own process; levers compares rollout throughput
# levers (per-request seeds off, separate engine core, fp8 base).
# Results (logs, JSON) go to $OUT, or gpu-results/ where OUT is unset.
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export QERL_CACHE_DIR="${QERL_CACHE_DIR:-/tmp/qerl-cache}"
qerl() { python3 -m deploy.cli "$@"; }
status=0
run() {  # run NAME COMMAND...: log to $out/NAME.log, remember a failure, go on
  local name=$1; shift
  echo "=== $name: $*"
  local started=$SECONDS
  "$@" > >(tee "$out/$name.log") 2>&1 || { echo "=== $name FAILED"; status=1; }
  echo "=== $name took $((SECONDS - started)) s"
}
for stage in ${*:-tests rollout sync learner train}; do
  case $stage in
    tests)
      # pytest is not on the GPU image: install the wheels carried in .gpu/extra
      python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
          --target /tmp/site .gpu/extra/*.whl
      run tests python3 -m pytest -m gpu -q -rsP -p no:cacheprovider tests ;;
    rollout)
      run rollout qerl bench rollout --model qwen2.5-7b --lora-rank 32 --concurrency 16,64,256 \
          --prompt-len 256 --gen-len 512 --samples-per-prompt 8 --peer-concurrency 16,64 \
          --peer-format nf4 --json "$out/rollout_7b.json" ;;
    sync)
      run sync_7b_1w qerl bench sync --model qwen2.5-7b --lora-rank 32 --workers 1 --repeats 10 \
          --json "$out/sync_7b_1w.json"
      run sync_7b_2w qerl bench sync --model qwen2.5-7b --lora-rank 32 --workers 2 --repeats 10 \
          --json "$out/sync_7b_2w.json"
      run sync_tiny qerl bench sync --model tiny --lora-rank 16 --workers 2 --repeats 10 \
          --json "$out/sync_tiny.json" ;;
    engine-core)
      # not in the default list: the same 7B rollout and sync with vLLM's engine core in its own
      # process (rollout.in_process=false), to compare with the in-process figures
      run rollout_7b_separate qerl bench rollout --model qwen2.5-7b --lora-rank 32 --concurrency 16,64,256 \
          --prompt-len 256 --gen-len 512 --samples-per-prompt 8 --peer-concurrency 64 --peer-format nf4 \
          --engine-core separate --json "$out/rollout_7b_separate.json"
      run sync_7b_separate qerl bench sync --model qwen2.5-7b --lora-rank 32 --workers 1 --repeats 10 \
          --engine-core separate --json "$out/sync_7b_separate.json" ;;
    levers)
      # not in the default list: the 7B rollout under each throughput lever, one engine per run,
      # all against the same HF peer (measured with the first)
      lever() { local name=$1; shift; run "rollout_7b_$name" qerl bench rollout --model qwen2.5-7b --lora-rank 32 \
          --concurrency 16,64,256 --prompt-len 256 --gen-len 512 --samples-per-prompt 8 --peer-format nf4 \
          --json "$out/rollout_7b_$name.json" "$@"; }
      lever seeded --peer-concurrency 64
      lever unseeded --peer-concurrency "" --no-request-seeds
      lever unseeded_separate --peer-concurrency "" --no-request-seeds --engine-core separate
      lever fp8_unseeded_separate --peer-concurrency "" --no-request-seeds --engine-core separate --base-format fp8 ;;
    learner)
      run learner qerl bench learner --model qwen2.5-7b --formats nf4,bf16 --micro-batches 1,4,8 \
          --prompt-len 256 --gen-len 512 --lora-rank 32 --json "$out/learner_7b.json" ;;
    train)
      python3 -m shared.model_shapes qwen2.5-0.5b /tmp/qwen2.5-0.5b-random > /dev/null
      run train qerl train --config configs/qwen2.5-0.5b_gpu_smoke.yaml model.path=/tmp/qwen2.5-0.5b-random \
          train.run_dir=/tmp/qerl-gpu-train train.overwrite=true
      cp /tmp/qerl-gpu-train/metrics.jsonl "$out/train_05b_metrics.jsonl" 2>/dev/null ;;
    *) echo "unknown stage $stage (tests rollout sync learner train engine-core levers)"; exit 2 ;;
  esac
done
exit $status
