#!/usr/bin/env bash
# GPU paths on a CUDA machine (run from the repo root; no install needed: PYTHONPATH=.).
# 1. the tests that have CUDA/vLLM branches (skipped ones say why);
# 2. the embedded default on the GPU in bfloat16 and in float32, 30 steps each, timed;
# writes logs and metrics under ${OUT:-/tmp/gpu_check}.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 POSTTRAIN_CACHE="$OUT/cache"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
python3 -m pytest -q -p no:cacheprovider -x tests/test_vllm.py tests/test_functional_policy.py 2>&1 | tail -15 | tee "$OUT/pytest.log"
for dtype in bfloat16 float32; do
  /usr/bin/time -v python3 -m posttrain.cli train --device cuda --dtype "$dtype" --max-steps 30 --eval-every 15 --eval-size 100 \
      --no-progress --no-tensorboard --output "$OUT/run-$dtype" > "$OUT/train-$dtype.log" 2>&1
  echo "== $dtype: exit $?"; grep -E "before training|after|Elapsed|Maximum resident" "$OUT/train-$dtype.log"
  python3 - "$OUT/run-$dtype/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if "time/step" in r][5:]
for key in ("time/step", "time/generation", "time/training"):
    print(f"  median {key}: {statistics.median(r[key] for r in steps):.3f} s")
PY
done
for dtype in bfloat16 float32; do cp "$OUT/run-$dtype/metrics.jsonl" "$OUT/metrics-$dtype.jsonl" 2>/dev/null; done; true
