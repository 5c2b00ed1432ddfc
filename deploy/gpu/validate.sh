#!/usr/bin/env bash
# GPU validation on one GPU with vLLM 0.26 installed (docs/benchmarks.md, "On a GPU machine"):
#   bash deploy/gpu/validate.sh [STAGE ...]
# Stages (default, in this order): tests rollout sync learner train. Opt-in: engine-core compares
# vLLM's engine core in its own process; levers compares rollout throughput levers (per-request
# seeds off, separate engine core, fp8 base); lora-tune tunes vLLM's LoRA kernels for the 7B shape
# (files in $out/lora-kernels; configs/lora-kernels holds the committed ones); lora-kernels
# compares the 7B rollout with vLLM's default LoRA kernels and configs/lora-kernels, bf16;
# lora-kernels-fp8 the same on the fp8 base with a separate engine core; fp8-kv adds an fp8 KV
# cache to that fp8 engine; profile shows where a 64-sequence decode step goes, with the adapter
# and without, profile-4bit the same for the int4 engine; ratio measures the HF peer at 64 sequences and the fp8 engine at 64 with the
# levers added one at a time (tuned LoRA kernels, then an fp8 KV cache); formats measures the 7B
# rollout in bf16, int4 and NVFP4 side by side, int4-levers the int4 engine with Marlin forced and
# with dual-stream LoRA, formats-32b bf16 vs int4 at 32B; fidelity compares every policy pair on
# the tiny model; memory32b trains a 32B-shaped int4 pair on one GPU; learner-gc
# the learner's peak memory at micro-batch 1 and 8 with gradient checkpointing off and on;
# memory32b-bf16 the same 32B run with the bf16 pair (random weights in memory); formats-32b-marlin
# the 32B int4 engine on Marlin beside bf16; async trains a 0.5B shape at rollout.max_staleness 0, 1
# and 2; fleet measures 1 and 2 int4 7B workers sharing the GPU; dual-stream-bf16 the 7B bf16 engine
# with and without dual-stream LoRA; fleet-gpus (2 or more GPUs) the fleet at one GPU per worker and
# a training with the learner and the workers on GPUs of their own; rebuild-tests checks the Triton
# GPU rebuild of packed 4-bit weights bit for bit, rebuild-bench times it per 7B weight shape
# (qerl bench rebuild); step-7b runs the whole RL step (qerl bench step)
# of the 7B bf16 and int4 pairs sharing the GPU (FORMATS: others; GPU_GIB: a --gpu-memory-gib, 76 on an
# 80 GB card), step-7b-80g the same on long-tailed completion
# lengths within an 80 GiB budget, step-7b-48g both within 48 GiB, step-7b-nvfp4 the NVFP4 pair alone (STEPS timed steps, default 2);
# write-32b-int4 then step-32b the 32B int4 pair (GPU_GIB, KV_GIB); learner-formats the 7B learner alone
# per base format at one micro-batch (FORMATS), with MFU; step-7b-profile one pair's step (FORMAT, default int4)
# with its learner phase profiled; learner-tests the learner's GPU tests; learner-profile
# shows where the bf16 7B learner step goes; w8a8-tests checks the W8A8 pair against vLLM's fp8 kernels
# and its engine (w8a8-kernel-tests the kernel tests alone), rollout-w8a8 its 7B engine beside bf16 and int4 at
# 64/256/512 sequences, rollout-w8a8-profile a profiled 512-sequence decode step of bf16 and W8A8,
# rollout-w8a8-separate both at 256/512 with the engine core in its own process, fidelity-w8a8 measures its KL beside bf16 on >= 10k tokens
# with eager engines, fidelity-w8a8-compiled with compiled ones (issue 26). Each opt-in stage fits one
# 10-minute device call (two or three engines).
# Results (logs, JSON) go to $OUT, or gpu-results/ where OUT is unset.
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export QERL_CACHE_DIR="${QERL_CACHE_DIR:-/tmp/qerl-cache}"
qerl() { python3 -m deploy.cli "$@"; }
gpu=(--config configs/bench_gpu.yaml)
# two workers share the GPU: a fixed KV size (engines that profile one GPU at once trip vLLM's
# memory check), eager, half the GPU each
two_workers=(rollout.num_workers=2 rollout.num_gpus_per_worker=0.5 rollout.gpu_memory_utilization=0.4
             rollout.kv_cache_memory_bytes=1073741824 rollout.enforce_eager=true)
status=0
kernels="${QERL_LORA_KERNELS:-configs/lora-kernels}"
run() {  # run NAME COMMAND...: log to $out/NAME.log, remember a failure, go on
  local name=$1; shift
  echo "=== $name: $*"
  local started=$SECONDS
  "$@" > >(tee "$out/$name.log") 2>&1 || { echo "=== $name FAILED"; status=1; }
  echo "=== $name took $((SECONDS - started)) s"
}
lever() {  # lever NAME ARGS...: the 7B rollout bench with extra arguments (flags or overrides)
  local name=$1; shift
  run "rollout_7b_$name" qerl bench rollout "${gpu[@]}" --shape qwen2.5-7b --concurrency 16,64,256 \
      --prompt-len 256 --gen-len 512 --peer-format nf4 --formats bf16 --json "$out/rollout_7b_$name.json" "$@"
}
write_packed() {  # write_packed SHAPE SCHEME: the random packed folder qerl bench step and learner use
  python3 -c "from benchmarks.shapes import random_packed_shape_folder as f; print(f('$1', '$2', 128))"
}
separate=(rollout.in_process=false)
unseeded=(rollout.request_seeds=false)
fp8=(--formats nf4-fp8)  # a later --formats wins over lever's bf16
tuned=(rollout.lora_kernel_configs="$kernels")
for stage in ${*:-tests rollout sync learner train}; do
  case $stage in
    tests)
      # pytest is not on the GPU image: install the wheels carried in .gpu/extra
      python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
          --target /tmp/site .gpu/extra/*.whl
      run tests python3 -m pytest -m gpu -q -rsP -p no:cacheprovider tests ;;
    rollout)
      lever bf16 --peer-concurrency 16,64 ;;
    sync)
      run sync_7b_1w qerl bench sync "${gpu[@]}" --shape qwen2.5-7b --repeats 10 --json "$out/sync_7b_1w.json"
      run sync_7b_2w qerl bench sync "${gpu[@]}" --shape qwen2.5-7b --repeats 10 "${two_workers[@]}" \
          --json "$out/sync_7b_2w.json"
      run sync_tiny qerl bench sync "${gpu[@]}" --repeats 10 "${two_workers[@]}" lora.rank=16 lora.alpha=32 \
          --json "$out/sync_tiny.json" ;;
    engine-core)
      # not in the default list: the same 7B rollout and sync with vLLM's engine core in its own
      # process (rollout.in_process=false), to compare with the in-process figures
      lever separate --peer-concurrency 64 "${separate[@]}"
      run sync_7b_separate qerl bench sync "${gpu[@]}" --shape qwen2.5-7b --repeats 10 "${separate[@]}" \
          --json "$out/sync_7b_separate.json" ;;
    levers)
      # not in the default list: the 7B rollout under each throughput lever, one engine per run,
      # all against the same HF peer (measured with the first)
      lever seeded --peer-concurrency 64
      lever unseeded --peer-concurrency "" "${unseeded[@]}"
      lever unseeded_separate --peer-concurrency "" "${unseeded[@]}" "${separate[@]}"
      lever fp8_unseeded_separate --peer-concurrency "" "${unseeded[@]}" "${separate[@]}" "${fp8[@]}" ;;
    lora-tune)
      run lora_tune qerl bench lora-kernels "${gpu[@]}" --shape qwen2.5-7b --out "$out/lora-kernels" \
          --json "$out/lora_kernels_7b.json" ;;
    lora-kernels)
      lever default --peer-concurrency 64
      lever tuned --peer-concurrency "" "${tuned[@]}" ;;
    lora-kernels-fp8)
      lever fp8_separate --peer-concurrency "" "${unseeded[@]}" "${separate[@]}" "${fp8[@]}"
      lever fp8_separate_tuned --peer-concurrency "" "${unseeded[@]}" "${separate[@]}" "${fp8[@]}" "${tuned[@]}" ;;
    fp8-kv)
      lever fp8_separate --peer-concurrency "" "${unseeded[@]}" "${separate[@]}" "${fp8[@]}"
      lever fp8_separate_fp8kv --peer-concurrency "" "${unseeded[@]}" "${separate[@]}" "${fp8[@]}" \
          rollout.kv_cache_dtype=fp8 ;;
    profile-4bit)
      # where a 64-sequence decode step of the int4 engine goes (the bf16 one: the profile stage)
      lever profiled_int4 --formats int4 --peer-concurrency "" --concurrency 64 --profile "$out/profile_int4" ;;
    profile)
      lever profiled --peer-concurrency "" --concurrency 64 --profile "$out/profile_lora"
      lever profiled_no_adapter --peer-concurrency "" --concurrency 64 --no-adapter \
          --profile "$out/profile_no_adapter" ;;
    ratio)
      ratio=(--concurrency 64 "${unseeded[@]}" "${separate[@]}" "${fp8[@]}")
      lever ratio_fp8 "${ratio[@]}" --peer-concurrency 64
      lever ratio_fp8_tuned "${ratio[@]}" --peer-concurrency "" "${tuned[@]}"
      lever ratio_fp8_tuned_fp8kv "${ratio[@]}" --peer-concurrency "" "${tuned[@]}" rollout.kv_cache_dtype=fp8 ;;
    formats)
      # the 4-bit formats beside bf16 + LoRA, one engine each, same prompts; ratios to bf16
      lever formats --formats bf16,int4,nvfp4 --peer-concurrency "" --repeats 2 ;;
    rollout-w8a8)
      # issue 26's target: the W8A8 engine beside bf16 and int4 (+ LoRA) at RL batch sizes, ratios to bf16
      run rollout_7b_w8a8 qerl bench rollout "${gpu[@]}" --shape qwen2.5-7b --formats bf16,w8a8,int4 \
          --concurrency 64,256,512 --prompt-len 256 --gen-len 512 --peer-concurrency "" --repeats 1 \
          --json "$out/rollout_7b_w8a8.json" ;;
    rollout-w8a8-profile)
      # where a decode step of 512 sequences goes, bf16 vs W8A8 (at 64 the W8A8 step is 1.38x shorter,
      # at 256 and 512 the throughput is even: what grows with the batch?)
      run rollout_7b_w8a8_profile qerl bench rollout "${gpu[@]}" --shape qwen2.5-7b --formats bf16,w8a8 \
          --concurrency 512 --prompt-len 256 --gen-len 512 --peer-concurrency "" --repeats 1 \
          --profile "$out/profile_512" --profile-seqs 512 --json "$out/rollout_7b_w8a8_profile.json" ;;
    rollout-w8a8-separate)
      # the same engines with vLLM's engine core in its own process, so the frontend's per-sequence
      # output work (a logprob per token) overlaps the GPU: is 256-512 sequences host-bound?
      run rollout_7b_w8a8_separate qerl bench rollout "${gpu[@]}" --shape qwen2.5-7b --formats bf16,w8a8 \
          --concurrency 256,512 --prompt-len 256 --gen-len 512 --peer-concurrency "" --repeats 1 \
          "${separate[@]}" --json "$out/rollout_7b_w8a8_separate.json" ;;
    int4-levers)
      # the kernel and LoRA-stream levers on the int4 engine (compare with the formats stage)
      lever int4_marlin --formats int4 --peer-concurrency "" --repeats 2 rollout.linear_backend=marlin
      lever int4_dual_stream --formats int4 --peer-concurrency "" --repeats 2 rollout.lora_dual_stream=true ;;
    formats-32b)
      run rollout_32b_formats qerl bench rollout "${gpu[@]}" --shape qwen2.5-32b --formats bf16,int4 \
          --concurrency 16,64 --prompt-len 256 --gen-len 512 --peer-concurrency "" --repeats 1 \
          --json "$out/rollout_32b_formats.json" ;;
    fidelity)
      # every pair this GPU serves, on the embedded tiny model: KL(rollout||learner), |dlogprob|, entropy
      # (about 80 s a pair on an H100, more on a first call that builds the tiny model: FORMATS splits it)
      run fidelity qerl bench fidelity "${gpu[@]}" --formats "${FORMATS:-bf16,nf4-exact,int4,nvfp4,nf4-int4,nf4-fp8}" \
          rollout.enforce_eager=true rollout.gpu_memory_utilization=0.3 rollout.kv_cache_memory_bytes=1073741824 \
          lora.rank=8 lora.alpha=16 policy.group_size=64 --json "$out/fidelity_tiny.json" ;;
    fidelity-int4)
      # the int4 and bf16 pairs alone on 16x the prompts: the KL mean of ~1,100 tokens moves 10x between leases
      run fidelity_int4 qerl bench fidelity "${gpu[@]}" --formats bf16,int4 --prompts 512 \
          rollout.enforce_eager=true rollout.gpu_memory_utilization=0.3 rollout.kv_cache_memory_bytes=1073741824 \
          lora.rank=8 lora.alpha=16 policy.group_size=64 --json "$out/fidelity_int4_tiny.json" ;;
    memory32b)
      # learner and one worker of a 32B-shaped int4 pair on one GPU, random packed weights
      run write_32b_int4 python3 -m benchmarks.shapes qwen2.5-32b /tmp/qwen2.5-32b-int4 --packed int4
      run train_32b_int4 qerl train --config configs/qwen2.5-32b_int4_gpu_memory.yaml \
          model.path=/tmp/qwen2.5-32b-int4 train.run_dir=/tmp/qerl-32b train.overwrite=true
      cp /tmp/qerl-32b/metrics.jsonl "$out/train_32b_int4_metrics.jsonl" 2>/dev/null ;;
    memory32b-bf16)
      # the same run with the bf16 pair: random bf16 weights drawn in memory on both sides (a bf16 32B
      # folder would not fit the machine's disk); it fits, or fails naming what did not fit
      run write_32b_shape python3 -m benchmarks.shapes qwen2.5-32b /tmp/qwen2.5-32b-shape --shape-only
      run train_32b_bf16 qerl train --config configs/qwen2.5-32b_int4_gpu_memory.yaml policy.format=bf16 \
          model.random_weights=true model.path=/tmp/qwen2.5-32b-shape train.run_dir=/tmp/qerl-32b-bf16 \
          train.overwrite=true
      cp /tmp/qerl-32b-bf16/metrics.jsonl "$out/train_32b_bf16_metrics.jsonl" 2>/dev/null ;;
    async)
      # rollout.max_staleness 0, 1, 2 side by side on a 0.5B shape (bf16 pair, random weights in memory)
      run write_05b_shape python3 -m benchmarks.shapes qwen2.5-0.5b /tmp/qwen2.5-0.5b-shape --shape-only
      for k in 0 1 2; do
        run "train_05b_staleness_$k" qerl train --config configs/qwen2.5-0.5b_gpu_smoke.yaml policy.format=bf16 \
            model.random_weights=true model.path=/tmp/qwen2.5-0.5b-shape rollout.max_staleness=$k train.steps=16 \
            train.run_dir="/tmp/qerl-async-$k" train.overwrite=true
        cp "/tmp/qerl-async-$k/metrics.jsonl" "$out/train_05b_staleness_${k}_metrics.jsonl" 2>/dev/null
      done ;;
    fleet)
      # 1 and 2 int4 7B workers sharing the one GPU by fraction: placement, the push to each, the fleet's tok/s
      run fleet_7b qerl bench fleet "${gpu[@]}" --shape qwen2.5-7b --workers 1,2 --prompt-len 256 --gen-len 256 \
          --steps 2 policy.format=int4 train.prompts_per_step=32 rollout.chunk_sequences=64 \
          rollout.num_gpus_per_worker=0.4 rollout.gpu_memory_utilization=0.35 \
          rollout.kv_cache_memory_bytes=8589934592 rollout.enforce_eager=true --json "$out/fleet_7b.json" ;;
    rebuild-tests)
      python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
          --target /tmp/site .gpu/extra/*.whl
      run rebuild_tests python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/integration/test_packed_rebuild_gpu.py ;;
    rebuild-bench)
      run rebuild_bench_7b qerl bench rebuild --config configs/bench_step_gpu.yaml --shape qwen2.5-7b \
          --json "$out/rebuild_7b.json" ;;
    learner-tests)
      python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
          --target /tmp/site .gpu/extra/*.whl
      run learner_tests python3 -m pytest -m gpu -q -rsxP --show-capture=stdout -p no:cacheprovider tests/integration/test_learner_gpu.py ;;
    w8a8-tests)
      # issue 26: the W8A8 pair's activation rounding and fp8 GEMM against vLLM's kernels, and an engine
      # with LoRA on the learner's folder against the learner (eager and compiled)
      python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
          --target /tmp/site .gpu/extra/*.whl
      run w8a8_tests python3 -m pytest -m gpu -q -rsP --show-capture=stdout -p no:cacheprovider tests/integration/test_w8a8_gpu.py ;;
    w8a8-kernel-tests)
      # the kernel-level half of w8a8-tests (no engines: about a minute)
      python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
          --target /tmp/site .gpu/extra/*.whl
      run w8a8_kernel_tests python3 -m pytest -m gpu -q --tb=short -rs -p no:cacheprovider \
          tests/integration/test_w8a8_gpu.py -k "not engine" ;;
    fidelity-w8a8)
      # the W8A8 and bf16 pairs on 16x the prompts (>= 10k tokens each), eager engines (about 4 minutes)
      run fidelity_w8a8 qerl bench fidelity "${gpu[@]}" --formats bf16,w8a8 --prompts 512 \
          rollout.enforce_eager=true rollout.gpu_memory_utilization=0.3 rollout.kv_cache_memory_bytes=1073741824 \
          lora.rank=8 lora.alpha=16 --json "$out/fidelity_w8a8_tiny.json" ;;
    fidelity-w8a8-compiled)
      # the same with compiled engines (CUDA graphs, Inductor): its own call, the pair did not fit one with the eager one
      run fidelity_w8a8_compiled qerl bench fidelity "${gpu[@]}" --formats bf16,w8a8 --prompts 512 \
          rollout.enforce_eager=false rollout.gpu_memory_utilization=0.3 rollout.kv_cache_memory_bytes=1073741824 \
          lora.rank=8 lora.alpha=16 --json "$out/fidelity_w8a8_tiny_compiled.json" ;;
    step-7b)
      # on an H100 two pairs may not fit one 10-minute call (per pair: an engine start of 86-142 s and a
      # compiling warm-up step of 70-95 s): FORMATS=bf16, then FORMATS=int4 in a second call on the same machine
      run step_7b qerl bench step --config configs/bench_step_gpu.yaml --shape qwen2.5-7b --formats "${FORMATS:-bf16,int4}" \
          --steps "${STEPS:-2}" ${GPU_GIB:+--gpu-memory-gib "$GPU_GIB"} --json "$out/step_7b.json" ;;
    step-7b-nvfp4)
      run step_7b_nvfp4 qerl bench step --config configs/bench_step_gpu.yaml --shape qwen2.5-7b --formats nvfp4 \
          --steps "${STEPS:-2}" ${GPU_GIB:+--gpu-memory-gib "$GPU_GIB"} --json "$out/step_7b_nvfp4.json" ;;
    write-32b-int4)
      # the 32B packed int4 folder where qerl bench step looks for it (about 3.5 minutes)
      run write_32b_int4 write_packed qwen2.5-32b int4 ;;
    step-32b)
      # GPU_GIB: a --gpu-memory-gib; KV_GIB: the engine's KV cache in GiB (the config's 20 GiB beside a
      # 32B learner does not fit an 80 GB card: try GPU_GIB=76 KV_GIB=10 there)
      run step_32b qerl bench step --config configs/bench_step_gpu.yaml --shape qwen2.5-32b --formats int4 \
          --steps "${STEPS:-1}" ${GPU_GIB:+--gpu-memory-gib "$GPU_GIB"} --json "$out/step_32b.json" \
          ${KV_GIB:+rollout.kv_cache_memory_bytes=$((KV_GIB * 1073741824))} ;;
    learner-formats)
      # the 7B learner alone per base format (FORMATS, default bf16,int4,nvfp4) at one micro-batch of
      # 16 x 266 tokens (MICRO_BATCHES: e.g. 16,24), checkpointing off: the ratio at the same micro-batch, each
      # one's MFU and one profiled step.
      # The packed folders are written first, side by side (about a minute each)
      for f in $(echo "${FORMATS:-bf16,int4,nvfp4}" | tr , ' '); do
        case $f in int4|nvfp4|w8a8) write_packed qwen2.5-7b "$f" & ;; esac
      done
      wait
      run learner_formats_7b qerl bench learner --config configs/bench_step_gpu.yaml --shape qwen2.5-7b \
          --formats "${FORMATS:-bf16,int4,nvfp4}" --micro-batches "${MICRO_BATCHES:-16}" --prompt-len 10 --gen-len 256 --repeats 3 \
          --profile "$out/profile_learner" learner.gradient_checkpointing=false --json "$out/learner_formats_7b.json" ;;
    step-7b-80g)
      run step_7b_80g qerl bench step --config configs/bench_step_gpu.yaml --shape qwen2.5-7b --formats bf16,int4 \
          --steps 2 --lengths lognormal --gpu-memory-gib 80 --json "$out/step_7b_80g.json" ;;
    step-7b-48g)
      # the bf16 and int4 pairs within 48 GiB (an L40S- or A6000-class card), 6 GiB of KV cache each: the
      # bf16 learner must recompute or shrink its micro-batches there, the int4 one need not (issue 22's
      # "memory becomes speed"; at 80 GiB both fit without recompute)
      run step_7b_48g qerl bench step --config configs/bench_step_gpu.yaml --shape qwen2.5-7b --formats bf16,int4 \
          --steps "${STEPS:-2}" --gpu-memory-gib 48 rollout.kv_cache_memory_bytes=6442450944 \
          --json "$out/step_7b_48g.json" ;;
    step-7b-profile)
      # one 7B pair's step (FORMAT, default int4), then its learner phase profiled in the learner's
      # process: where the int4 learner's extra time over bf16's goes (GPU_GIB: an --gpu-memory-gib)
      run "step_7b_profile_${FORMAT:-int4}" qerl bench step --config configs/bench_step_gpu.yaml --shape qwen2.5-7b \
          --formats "${FORMAT:-int4}" --steps "${STEPS:-1}" ${GPU_GIB:+--gpu-memory-gib "$GPU_GIB"} \
          --profile "$out/profile_step" --json "$out/step_7b_profile_${FORMAT:-int4}.json" ;;
    learner-profile)
      # where the bf16 7B learner's step goes: 24 sequences of 10 + 256 tokens, checkpointing off
      run learner_profile_7b qerl bench learner --config configs/bench_step_gpu.yaml --shape qwen2.5-7b \
          --formats bf16 --micro-batches 8,24 --prompt-len 10 --gen-len 256 --repeats 2 --profile "$out/profile" \
          learner.gradient_checkpointing=false --json "$out/learner_profile_7b.json" ;;
    dual-stream-bf16)
      # dual-stream LoRA on the bf16 engine beside the plain bf16 engine, same call
      lever bf16_single_stream --peer-concurrency "" --repeats 2
      lever bf16_dual_stream --peer-concurrency "" --repeats 2 rollout.lora_dual_stream=true ;;
    fleet-gpus)
      # the multi-GPU scaling run: the int4 7B fleet at 1, 2, 4 workers with one
      # GPU each (as many as there are), then a short training with the learner on one GPU and a
      # rollout worker on each of the others (random packed weights: plumbing, not learning)
      gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
      if [ "$gpus" -lt 2 ]; then echo "=== fleet-gpus needs 2 or more GPUs, this machine has $gpus"; status=1; continue; fi
      sizes=1,2; [ "$gpus" -ge 4 ] && sizes=1,2,4
      run fleet_7b_gpus qerl bench fleet "${gpu[@]}" --shape qwen2.5-7b --workers "$sizes" --prompt-len 256 \
          --gen-len 256 --steps 2 policy.format=int4 train.prompts_per_step=64 rollout.chunk_sequences=64 \
          rollout.num_gpus_per_worker=1 --json "$out/fleet_7b_gpus.json"
      run write_7b_int4 python3 -m benchmarks.shapes qwen2.5-7b /tmp/qwen2.5-7b-int4 --packed int4
      run train_7b_gpus qerl train --config configs/qwen2.5-32b_int4_gpu_memory.yaml model.path=/tmp/qwen2.5-7b-int4 \
          learner.num_gpus=1 rollout.num_workers=$((gpus - 1)) rollout.num_gpus_per_worker=1 \
          rollout.gpu_memory_utilization=0.85 rollout.enforce_eager=false train.steps=5 \
          train.run_dir=/tmp/qerl-7b-gpus train.overwrite=true
      cp /tmp/qerl-7b-gpus/metrics.jsonl "$out/train_7b_gpus_metrics.jsonl" 2>/dev/null ;;
    formats-32b-marlin)
      # Marlin forced on the 32B int4 engine, beside bf16 + LoRA in the same run
      run rollout_32b_marlin qerl bench rollout "${gpu[@]}" --shape qwen2.5-32b --formats bf16,int4 \
          --concurrency 16,64 --prompt-len 256 --gen-len 512 --peer-concurrency "" --repeats 1 \
          rollout.linear_backend=marlin --json "$out/rollout_32b_marlin.json" ;;
    learner)
      run learner qerl bench learner "${gpu[@]}" --shape qwen2.5-7b --formats nf4,bf16 --micro-batches 1,4,8 \
          --prompt-len 256 --gen-len 512 --json "$out/learner_7b.json" ;;
    learner-gc)
      # the NF4 learner's peak memory and speed at two micro-batch sizes, gradient checkpointing off and on
      run learner_gc_off qerl bench learner "${gpu[@]}" --shape qwen2.5-7b --formats nf4 --micro-batches 1,8 \
          --prompt-len 256 --gen-len 512 --json "$out/learner_7b_gc_off.json" learner.gradient_checkpointing=false
      run learner_gc_on qerl bench learner "${gpu[@]}" --shape qwen2.5-7b --formats nf4 --micro-batches 1,8 \
          --prompt-len 256 --gen-len 512 --json "$out/learner_7b_gc_on.json" learner.gradient_checkpointing=true ;;
    train)
      python3 -m benchmarks.shapes qwen2.5-0.5b /tmp/qwen2.5-0.5b-random > /dev/null
      run train qerl train --config configs/qwen2.5-0.5b_gpu_smoke.yaml model.path=/tmp/qwen2.5-0.5b-random \
          train.run_dir=/tmp/qerl-gpu-train train.overwrite=true
      cp /tmp/qerl-gpu-train/metrics.jsonl "$out/train_05b_metrics.jsonl" 2>/dev/null ;;
    *) # the stages are this file's case labels
       echo "unknown stage $stage; stages: $(grep -oE '^    [a-z0-9-]+\)' "$0" | tr -d ' )' | tr '\n' ' ')"; exit 2 ;;
  esac
done
exit $status
