"""posttrain: post-training language models with reinforcement learning and preference optimization."""

__version__ = "0.1.0"
