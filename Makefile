# Quick start:  make train   (set up .venv and run the embedded default)
#               make test    (set up .venv and run the test suite)
.PHONY: setup train test test-slow bench

setup:
	@bash scripts/setup.sh

train: setup
	.venv/bin/posttrain train $(ARGS)

test: setup
	.venv/bin/python -m pytest -q -n 2 --durations=10

test-slow: setup
	.venv/bin/python -m pytest -q -m slow --durations=0
