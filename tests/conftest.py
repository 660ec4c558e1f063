"""Shared fixtures: a tiny random Llama saved to disk, and reward functions with variance."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# One thread per test worker (the suite runs with pytest -n 2 on 2 cores), no hub, no noise.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REWARDS = '''
def starts_even(prompts, completions, **columns):
    """1.0 when the completion starts with an even digit: a sparse reward with some zero-variance groups."""
    return [1.0 if c[:1] in "02468" else 0.0 for c in completions]

def sevens(prompts, completions, **columns):
    """A dense reward with variance in almost every group: the share of 7s."""
    return [c.count("7") / max(len(c), 1) for c in completions]

def ones(prompts, completions, **columns):
    """A constant reward: a fixed target for a value function."""
    return [1.0 for _ in completions]
'''


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 1-layer random Llama over the addition task's characters."""
    from posttrain.models.tiny import build_tiny_model, char_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = char_tokenizer("0123456789+=,|")
    model = build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama over the addition task's characters with head size 64, which vLLM's CPU attention
    supports (the tests that start real vLLM engines and servers)."""
    from posttrain.models.tiny import build_tiny_model, char_tokenizer

    path = tmp_path_factory.mktemp("vllm-model")
    tokenizer = char_tokenizer("0123456789+=,|")
    build_tiny_model(tokenizer, seed=0, hidden_size=128, num_layers=2, num_heads=2,
                     intermediate_size=256).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    return path


def assert_runs_identical(a: Path, b: Path) -> None:
    """Two run directories logged the same metrics (timings aside) and saved the same final weights."""
    from safetensors.torch import load_file

    from posttrain.tracking.metrics import read_metrics

    def comparable(run):
        return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in read_metrics(run)]

    assert comparable(a) == comparable(b)
    wa, wb = (load_file(run / "final_model" / "model.safetensors") for run in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


class Interrupted(Exception):
    """What kills a run in ``run_interrupted``."""


def run_interrupted(session, config, step_fn, evaluate, after: int) -> None:
    """Run ``config`` as a crash would leave it: killed as step ``after + 1`` starts, so its last
    checkpoint is step ``after``'s (``save_every`` must divide it) and ``max_steps`` is unchanged,
    as is the learning-rate schedule that depends on it."""
    from posttrain.training.runner import run_training

    def step_or_die(s):
        if s.step == after:
            raise Interrupted(f"killed after step {after}")
        return step_fn(s)

    with pytest.raises(Interrupted):
        run_training(session, config, step_or_die, evaluate)


def assert_online_resume_is_exact(config_of, tmp_path: Path, after: int = 2) -> None:
    """An online run killed after step ``after`` and resumed from its checkpoint ends as the run that was
    never interrupted: the same metrics and final weights. ``config_of(output)`` is the run's config
    writing to ``output`` (``save_every`` must divide ``after``)."""
    from posttrain.training.online import train_step
    from posttrain.training.runner import run_training
    from posttrain.training.session import OnlineSession, evaluate

    whole = config_of(str(tmp_path / "whole"))
    run_training(OnlineSession.create(whole), whole, train_step, evaluate)
    first = config_of(str(tmp_path / "split"))
    run_interrupted(OnlineSession.create(first), first, train_step, evaluate, after=after)
    second = resumed(first, tmp_path / "split")
    run_training(OnlineSession.create(second), second, train_step, evaluate)
    assert_runs_identical(tmp_path / "whole", tmp_path / "split")


def resumed(config, run_dir: Path):
    """``config`` resuming ``run_dir``."""
    from posttrain.config import Config

    return Config.from_flat({**config.to_flat(), "resume": str(run_dir)})


@pytest.fixture(scope="session")
def printable_model_dir(tmp_path_factory):
    """A 1-layer random Llama whose characters are printable ASCII: it can write a tool call."""
    from posttrain.models.tiny import build_tiny_model, char_tokenizer

    path = tmp_path_factory.mktemp("printable-model")
    tokenizer = char_tokenizer("".join(chr(c) for c in range(32, 127)))
    build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
