"""Data: what a run trains and is scored on.

Prompt datasets and the prompt sampler (:mod:`.prompts`), preference pairs (:mod:`.preference`),
reward functions with TRL's signature (:mod:`.rewards`) and the scoring that runs them, isolated
when asked (:mod:`.scoring`), and the built-in verifiable tasks (:mod:`.tasks`). Knows no model:
everything here is text, token ids of a tokenizer, and numbers.
"""
