"""posttrain: post-training language models with reinforcement learning and preference optimization."""

__version__ = "0.1.0"

from posttrain.algorithms.presets import ALGORITHMS, OnlineAlgorithm, PreferenceAlgorithm, algorithm  # noqa: E402

__all__ = ["ALGORITHMS", "OnlineAlgorithm", "PreferenceAlgorithm", "algorithm", "__version__"]
