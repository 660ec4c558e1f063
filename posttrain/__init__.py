"""posttrain: post-training language models with reinforcement learning and preference optimization.

From Python: ``posttrain.train(...)`` runs a training, watched by ``posttrain.Callback`` objects, and
``posttrain.evaluate(...)`` scores a model as ``posttrain eval`` does (:mod:`posttrain.training.api`);
``posttrain.completion_logprobs(...)`` gives the per-token log-probs a run trains on (:mod:`posttrain.models.logprobs`);
``posttrain.algorithm`` returns a preset; the ``register_*`` functions add presets and the pieces they name
(:mod:`posttrain.algorithms.registry`), and ``register_reward`` a reward that ``--reward NAME`` names
(:mod:`posttrain.data.rewards`); ``posttrain.functional`` holds the math as pure functions.
"""

import importlib

__version__ = "0.1.0"

from posttrain.algorithms.presets import (  # noqa: E402
    ALGORITHMS,
    OnlineAlgorithm,
    PreferenceAlgorithm,
    SupervisedAlgorithm,
    algorithm,
    register_algorithm,
)
from posttrain.algorithms.registry import (  # noqa: E402
    register_advantage,
    register_policy_loss,
    register_preference_loss,
)
from posttrain.data.rewards import REWARDS, register_reward  # noqa: E402

__all__ = ["ALGORITHMS", "REWARDS", "Callback", "OnlineAlgorithm", "PreferenceAlgorithm", "Preempted", "SupervisedAlgorithm",
           "algorithm", "register_advantage", "register_algorithm", "register_policy_loss", "register_preference_loss",
           "register_reward", "completion_logprobs", "evaluate", "train", "__version__"]


_LAZY = {"train": "posttrain.training.api", "evaluate": "posttrain.training.api",
         "completion_logprobs": "posttrain.models.logprobs",
         "Callback": "posttrain.training.runner", "Preempted": "posttrain.training.lifecycle"}
"""Names imported on first use: they import the trainers (transformers), which ``import posttrain`` need not."""


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
