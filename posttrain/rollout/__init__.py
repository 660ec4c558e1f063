"""Rollout: turning prompts into sampled completions.

The generator protocol, its data types and the ``hf`` and ``fast`` generators (:mod:`.generators`),
the decode loop with its preallocated cache (:mod:`.generation`), the fused decode step written
against a Llama model's weights (:mod:`.decode_step`) and the vLLM generator (:mod:`.vllm`).
Depends on models, never on a trainer.
"""
