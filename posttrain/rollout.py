"""Rollout: turning prompts into sampled completions.

A generator is anything with ``generate(prompt_ids, num_samples=..., greedy=...)``
returning :class:`Completions`; :class:`HFGenerator` runs Hugging Face
``generate`` with a KV cache on all ``B*G`` sequences at once. Row ``i*G + j``
of the result is sample ``j`` of prompt ``i`` everywhere in posttrain.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class Completions:
    """``N = len(prompts) * num_samples`` completions, right-padded.

    completion_ids: [N, T] token ids, ``pad`` after the end.
    mask:           [N, T] 1.0 for completion tokens (the EOS token included), 0.0 for padding.
    truncated:      [N] bool, True when the budget ran out before EOS.
    """

    completion_ids: Tensor
    mask: Tensor
    truncated: Tensor

    @property
    def lengths(self) -> Tensor:
        return self.mask.sum(-1).long()


class Generator(Protocol):
    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False) -> Completions: ...


def left_pad(sequences: list[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad 1-D token tensors: ([n, L] ids, [n, L] attention mask)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            ids[row, width - len(seq):] = seq
            attention[row, width - len(seq):] = 1
    return ids, attention


def completion_mask(tokens: Tensor, eos_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Mask up to and including the first EOS: ([N, T] float mask, [N] truncated)."""
    is_eos = torch.isin(tokens, eos_ids)
    # Position of the first EOS, or T when there is none.
    first_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), torch.tensor(tokens.shape[1]))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(1)).float()
    return mask, ~is_eos.any(-1)


class HFGenerator:
    """Sampling with ``model.generate`` (KV cache, batched, stops at EOS or the budget)."""

    def __init__(self, model: Any, tokenizer: Any, params: SamplingParams, eos_token_ids: list[int]):
        self.model = model
        self.tokenizer = tokenizer
        self.params = params
        self.eos_ids = torch.tensor(eos_token_ids, dtype=torch.long)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]

    @torch.no_grad()
    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False) -> Completions:
        device = self.model.device
        ids, attention = left_pad(prompt_ids, self.pad_id)
        ids = ids.repeat_interleave(num_samples, 0).to(device)
        attention = attention.repeat_interleave(num_samples, 0).to(device)
        sampling = {} if greedy else {
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "top_k": self.params.top_k or None,
        }
        was_training = self.model.training
        self.model.eval()
        out = self.model.generate(
            input_ids=ids,
            attention_mask=attention,
            do_sample=not greedy,
            max_new_tokens=self.params.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids.tolist(),
            use_cache=True,
            **sampling,
        )
        self.model.train(was_training)
        tokens = out[:, ids.shape[1]:].cpu()
        if tokens.shape[1] == 0:  # nothing generated (budget of 0 is rejected by config)
            raise RuntimeError("generate returned no new tokens")
        mask, truncated = completion_mask(tokens, self.eos_ids)
        tokens = tokens.masked_fill(mask == 0, self.pad_id)
        return Completions(tokens, mask, truncated)


def make_generator(backend: str, model: Any, tokenizer: Any, params: SamplingParams, eos_token_ids: list[int]):
    """The configured generator; vLLM needs a GPU and the ``vllm`` package."""
    if backend == "hf":
        return HFGenerator(model, tokenizer, params, eos_token_ids)
    if backend == "vllm":
        if not torch.cuda.is_available():
            raise RuntimeError("backend=vllm needs a CUDA GPU and none is available; use --backend hf")
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError("backend=vllm needs the vllm package: pip install vllm; or use --backend hf")
        raise NotImplementedError("the vLLM backend is not implemented yet (issue #9); use --backend hf")
    raise ValueError(f"unknown generation backend {backend!r}; valid: hf, vllm")
