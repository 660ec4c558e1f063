"""Models: what is trained, and its forward pass.

Turning a ``--model`` spec into a ``transformers`` model and tokenizer offline (:mod:`.loading`), the
built-in tiny models (:mod:`.tiny`), LoRA adapters (:mod:`.lora`), and the training-time batch layout
and per-token log-probs (:mod:`.modeling`). Generation is in :mod:`posttrain.rollout`, above this.
"""
