#!/usr/bin/env bash
# Create (or reuse) the virtual environment at .venv and install posttrain into it.
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build that pip
# finds locally (a looser spec would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${POSTTRAIN_EXTRAS:-dev}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet "torch>=2.4,<3"
  else
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
  fi
fi
# Reinstall only when the project's metadata changed since the last install.
stamp=.venv/.posttrain-installed
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1) $EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet -e ".[$EXTRAS]"
  # GEM's environments (--task gem:ENV_ID): gem-llm 0.1.0 pins reasoning-gym 0.1.23, older than the
  # reasoning-gym extra's; it runs with 0.1.25, so it goes in without its pins (its other dependencies
  # are the gem extra's, which dev includes).
  if [[ ",$EXTRAS," == *,dev,* || ",$EXTRAS," == *,gem,* ]]; then
    .venv/bin/python -m pip install --quiet --no-deps "gem-llm==0.1.0"
  fi
  # verl's own loss functions, which the tests check posttrain's against (tests/peers.py): without its
  # dependencies (ray, vLLM, ...), which the losses do not use.
  if [[ ",$EXTRAS," == *,dev,* ]]; then
    .venv/bin/python -m pip install --quiet --no-deps "verl==0.9.1"
  fi
  echo "$want" > "$stamp"
fi
# bubblewrap, the sandbox that model-written code runs in (posttrain.sandbox; the code task's reward):
# installed where this user may install system packages, otherwise a note (the sandbox's error says the same).
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; } \
      || echo "setup: could not install bubblewrap; code-execution rewards need it (apt-get install bubblewrap)" >&2
  else
    echo "setup: bubblewrap (bwrap) is not installed; code-execution rewards need it: sudo apt-get install bubblewrap" >&2
  fi
fi
