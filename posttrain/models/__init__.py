"""Models: what is trained, and its forward pass.

Turning a ``--model`` spec into a ``transformers`` model and tokenizer offline (:mod:`.loading`), the
built-in tiny models (:mod:`.tiny`) and the tiny random models of each family posttrain is checked on
(:mod:`.families`), LoRA adapters (:mod:`.lora`), which fast paths serve a model exactly
(:mod:`.architecture`), how it computes while it trains (:mod:`.compute`: the packed attention, mixed
precision, checkpointing), the training passes and their log-probs (:mod:`.modeling`, :mod:`.packing`,
:mod:`.logprobs`), and a mixture of experts' routing (:mod:`.experts`). Generation is in
:mod:`posttrain.rollout`, above this.
"""
