"""Rollout: turning prompts into sampled completions.

A generator is anything with ``generate(prompt_ids, num_samples=..., greedy=...)``
returning :class:`Completions`. Row ``i*G + j`` of the result is sample ``j`` of
prompt ``i`` everywhere in posttrain. Backend ``hf`` is :class:`FastGenerator`,
posttrain's own decode loop around the model's forward pass
(:mod:`posttrain.rollout.generation`: one prefill per prompt, a preallocated KV cache,
finished rows dropped); :class:`HFGenerator` runs Hugging Face ``generate`` on
all ``B*G`` sequences at once. ``FastGenerator`` falls back to it, with a logged
reason, for models whose cache it cannot hold; ``POSTTRAIN_HF_GENERATE=1`` selects
it outright, for comparison.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import nullcontext
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from posttrain.models.architecture import family, padded_generate_reason
from posttrain.models.experts import routers
from posttrain.rollout.routing import RoutingRecorder, decode_routing, generate_routing
from posttrain.models.modeling import left_pad
from posttrain.rollout.completions import (
    POLICY_SAMPLER,
    Completions,
    Generator,
    SamplingParams,
    per_prompt_budgets,
    to_completions,
    within_budgets,
)

logger = logging.getLogger(__name__)


class HFGenerator:
    """Sampling with ``model.generate`` (KV cache, batched, stops at EOS or the budget); with each sampled token's
    log-prob under the distribution it was drawn from, as the decode loop gives it (:class:`SamplingRecorder`)."""

    capabilities = POLICY_SAMPLER

    def __init__(self, model: Any, tokenizer: Any, params: SamplingParams, eos_token_ids: list[int], *,
                 record_routing: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.params = params
        self.eos_ids = torch.tensor(eos_token_ids, dtype=torch.long)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
        self.record_routing = record_routing
        self.said_unpadded = False  # the one-line notice of _by_prompt_length

    @torch.no_grad()
    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False,
                 rows: Any = None, max_new_tokens: int | None = None) -> Completions:
        """``max_new_tokens``: this call's budget (default: the sampling parameters')."""
        if len({len(p) for p in prompt_ids}) > 1 and padded_generate_reason(self.model):
            return self._by_prompt_length(prompt_ids, num_samples, greedy, max_new_tokens)
        device = self.model.device
        ids, attention = left_pad(prompt_ids, self.pad_id)
        width = ids.shape[1]
        ids = ids.repeat_interleave(num_samples, 0).to(device)
        attention = attention.repeat_interleave(num_samples, 0).to(device)
        recorder = None if greedy else SamplingRecorder(self.params)
        routed = RoutingRecorder(self.model) if self.record_routing and not greedy else nullcontext()
        was_training = self.model.training
        self.model.eval()
        with routed:
            out = self._generate(ids, attention, greedy, recorder, max_new_tokens=max_new_tokens)
        self.model.train(was_training)
        tokens = out[:, ids.shape[1]:]
        completions = to_completions(tokens.cpu(), self.eos_ids, self.pad_id)
        if recorder is not None:
            completions.sampling_logprobs = recorder.drawn(tokens).cpu() * completions.mask
        if isinstance(routed, RoutingRecorder):
            completions.routing = generate_routing(routed, [len(p) for p in prompt_ids], width, num_samples,
                                                   completions.lengths)
        return completions

    def _by_prompt_length(self, prompt_ids: list[Tensor], num_samples: int, greedy: bool,
                          max_new_tokens: int | None) -> Completions:
        """:meth:`generate` one prompt length at a time, so no call pads a prompt (:data:`PADDED_GENERATE`); the
        rows back in the prompts' order."""
        if not self.said_unpadded:
            self.said_unpadded = True
            logger.warning("%s: %s; sampling its prompts one length at a time", family(self.model),
                           padded_generate_reason(self.model))
        groups: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompt_ids):
            groups.setdefault(len(prompt), []).append(i)
        parts = [self.generate([prompt_ids[i] for i in group], num_samples=num_samples, greedy=greedy,
                               max_new_tokens=max_new_tokens) for group in groups.values()]
        order = torch.tensor([i * num_samples + k for group in groups.values() for i in group for k in range(num_samples)])
        return Completions.cat(parts).rows(torch.argsort(order))

    def _generate(self, ids: Tensor, attention: Tensor, greedy: bool, recorder: SamplingRecorder | None,
                  suppress: list[int] | None = None, max_new_tokens: int | None = None, **images: Tensor) -> Tensor:
        return self.model.generate(
            input_ids=ids,
            attention_mask=attention,
            **images,
            **({"suppress_tokens": suppress} if suppress else {}),
            do_sample=not greedy,
            max_new_tokens=self.params.max_new_tokens if max_new_tokens is None else max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids.tolist(),
            use_cache=True,
            # the recorder applies temperature, top-k and top-p: generate's own warpers stay off
            temperature=1.0, top_k=0, top_p=1.0,
            logits_processor=None if recorder is None else [recorder],
            **({"output_router_logits": False} if routers(self.model) else {}),  # as the decode loop: no load loss
        )


class VisionGenerator(HFGenerator):
    """``generate`` on a vision-language model: each prompt with its row's images, encoded by the model's
    processor (:func:`posttrain.data.images.encode_row_prompt`, once per row), batched as the training passes
    batch them (:func:`posttrain.models.vision.batch_image_inputs`); the completions carry each row's image
    inputs for those passes."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.encoded: dict[int, tuple[Mapping[str, Any], dict[str, Tensor]]] = {}

    def images_of(self, prompt: Tensor, row: Mapping[str, Any] | None) -> dict[str, Tensor]:
        """A row's image inputs ({} for a row without images); its ids must be the prompt's."""
        from posttrain.data.images import encode_row_prompt, has_images

        if row is None or not has_images(row):
            return {}
        if id(row) not in self.encoded:  # the row is held too, so that its id is never another row's
            ids, images = encode_row_prompt(self.tokenizer, dict(row), f"the row with prompt {str(row['prompt'])[:60]!r}")
            if not torch.equal(ids, prompt.cpu()):
                raise ValueError("a row's prompt ids differ from its images' encoding: encode image prompts with "
                                 "posttrain.data.images.encode_row_prompt")
            self.encoded[id(row)] = (row, images)
        return self.encoded[id(row)][1]

    @torch.no_grad()
    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False,
                 rows: Any = None) -> Completions:
        from posttrain.models.vision import batch_image_inputs, image_token_ids

        per_row = [self.images_of(p, None if rows is None else rows[i]) for i, p in enumerate(prompt_ids)
                   for _ in range(num_samples)]
        ids, attention = left_pad(prompt_ids, self.pad_id)
        ids = ids.repeat_interleave(num_samples, 0).to(self.model.device)
        attention = attention.repeat_interleave(num_samples, 0).to(self.model.device)
        width = ids.shape[1]
        images = batch_image_inputs(per_row, [len(p) for p in prompt_ids for _ in range(num_samples)], width, width)
        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        images = {k: v.to(self.model.device, dtype) if v.is_floating_point() else v.to(self.model.device)
                  for k, v in images.items()}
        recorder = None if greedy else SamplingRecorder(self.params)
        was_training = self.model.training
        self.model.eval()
        # an image placeholder in a completion would take an image the row does not have: never sampled (the
        # recorder sees its probability as 0, and the importance correction covers it as it covers top-k)
        out = self._generate(ids, attention, greedy, recorder, suppress=image_token_ids(self.model), **images)
        self.model.train(was_training)
        tokens = out[:, width:]
        completions = to_completions(tokens.cpu(), self.eos_ids, self.pad_id)
        if recorder is not None:
            completions.sampling_logprobs = recorder.drawn(tokens).cpu() * completions.mask
        completions.images = per_row if any(per_row) else None
        return completions


class SamplingRecorder:
    """A logits processor for ``generate`` that turns the logits into the decode loop's sampling distribution
    (:func:`posttrain.rollout.generation.sampling_distribution`: temperature, then top-k, then top-p) and keeps
    the log-probs of each token drawn from it. Only the last step's distribution is held ([N, V]): at each
    step the token drawn at the one before is read from the ids ``generate`` passes in."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.previous_NV: Tensor | None = None
        self.logprobs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores_NV: Tensor) -> Tensor:
        from posttrain.rollout.generation import sampling_distribution

        if self.previous_NV is not None:
            self.logprobs.append(self.previous_NV.gather(1, input_ids[:, -1:])[:, 0])
        p = self.params
        probs_NK, token_ids_NK = sampling_distribution(scores_NV, p.temperature, p.top_k, p.top_p)
        logp_NK = probs_NK.log() - probs_NK.sum(-1, keepdim=True).log()
        if token_ids_NK is None:
            self.previous_NV = logp_NK
        else:
            self.previous_NV = torch.full_like(scores_NV, -torch.inf, dtype=logp_NK.dtype).scatter_(1, token_ids_NK, logp_NK)
        return self.previous_NV

    def drawn(self, tokens_NT: Tensor) -> Tensor:
        """[N, T] the log-prob of each generated token (``tokens_NT``: what ``generate`` appended), 0 after the
        last step."""
        steps = [*self.logprobs, self.previous_NV.gather(1, tokens_NT[:, len(self.logprobs):len(self.logprobs) + 1])[:, 0]]
        logprobs_NT = torch.stack(steps[:tokens_NT.shape[1]], 1)
        return logprobs_NT.nan_to_num(neginf=0.0)


class FastGenerator:
    """Sampling with :func:`posttrain.rollout.generation.decode`; :class:`HFGenerator` for models it cannot hold.

    It can be interrupted between decode steps and continue rows within a smaller budget (partial rollouts);
    where it falls back to ``generate``, a generation runs to its end instead, with the weights it started with."""

    capabilities = dataclasses.replace(POLICY_SAMPLER, resumes=True)

    def __init__(self, model: Any, tokenizer: Any, params: SamplingParams, eos_token_ids: list[int], *,
                 record_routing: bool = False):
        self.model = model
        self.params = params
        self.eos_ids = torch.tensor(eos_token_ids, dtype=torch.long)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
        self.record_routing = record_routing
        self.fallback = HFGenerator(model, tokenizer, params, eos_token_ids, record_routing=record_routing)
        self.fallback_reason: str | None = None  # "" once checked and supported

    @torch.no_grad()
    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False, rows: Any = None,
                 interrupted: Callable[[], bool] | None = None,
                 max_new_tokens: int | list[int] | None = None) -> Completions:
        """``interrupted``: see :func:`posttrain.rollout.generation.decode`; ``max_new_tokens``: this call's budget
        (default: the sampling parameters'), or one per prompt (the rows run to the longest and are cut at
        their own)."""
        from posttrain.rollout.generation import (
            decode,
            preallocated_cache,
            unsupported_reason,
        )

        if self.fallback_reason is None:
            self.fallback_reason = unsupported_reason(self.model) or ""
            if self.fallback_reason:
                logger.warning("posttrain's decode loop cannot run %s: %s; using transformers' generate%s",
                               type(self.model).__name__, self.fallback_reason,
                               " (generations are not interrupted: partial rollouts sample each request whole, "
                               "with the weights it started with)" if interrupted is not None else "")
        budgets = per_prompt_budgets(max_new_tokens, self.params.max_new_tokens, len(prompt_ids))
        if len(set(budgets)) > 1:
            whole = self.generate(prompt_ids, num_samples=num_samples, greedy=greedy, rows=rows,
                                  interrupted=interrupted, max_new_tokens=max(budgets))
            return within_budgets(whole, torch.tensor(budgets).repeat_interleave(num_samples), self.pad_id)
        budget = budgets[0]
        if self.fallback_reason:
            return self.fallback.generate(prompt_ids, num_samples=num_samples, greedy=greedy, max_new_tokens=budget)
        ids, attention = left_pad(prompt_ids, self.pad_id)
        cache = preallocated_cache(self.model.config, num_samples, ids.shape[1] + budget)
        device = self.model.device
        was_training = self.model.training
        self.model.eval()
        p = self.params
        routed = RoutingRecorder(self.model) if self.record_routing and not greedy else nullcontext()
        step_rows: list[Tensor] | None = [] if isinstance(routed, RoutingRecorder) else None
        with routed:
            tokens, logprobs = decode(self.model, cache, ids.to(device), attention.to(device), num_samples=num_samples,
                                      max_new_tokens=budget, eos_ids=self.eos_ids.to(device),
                                      pad_id=self.pad_id, greedy=greedy, temperature=p.temperature, top_k=p.top_k,
                                      top_p=p.top_p, step_rows=step_rows, interrupted=interrupted)
        self.model.train(was_training)
        completions = to_completions(tokens.cpu(), self.eos_ids, self.pad_id)
        if logprobs is not None:
            completions.sampling_logprobs = logprobs.cpu() * completions.mask
        if isinstance(routed, RoutingRecorder):
            completions.routing = decode_routing(routed, [len(q) for q in prompt_ids], ids.shape[1], num_samples,
                                                 step_rows, completions.lengths)
        return completions


def make_generator(backend: str, model: Any, tokenizer: Any, params: SamplingParams, eos_token_ids: list[int], *,
                   model_path: str | None = None, seed: int = 0, record_routing: bool = False):
    """The configured generator; vLLM needs a GPU, the ``vllm`` package and the model's directory.
    ``record_routing``: the completions carry a mixture of experts' routing (``hf`` only; routing replay)."""
    if backend == "hf":
        from posttrain.models.vision import is_vision_model

        if is_vision_model(model):  # images go through generate's prefill; the decode loop takes token ids only
            return VisionGenerator(model, tokenizer, params, eos_token_ids)
        slow = os.environ.get("POSTTRAIN_HF_GENERATE", "0") == "1"
        return (HFGenerator if slow else FastGenerator)(model, tokenizer, params, eos_token_ids,
                                                        record_routing=record_routing)
    if backend == "vllm":
        from posttrain.rollout.vllm import VLLMGenerator

        return VLLMGenerator(model, tokenizer, params, eos_token_ids, model_path=model_path, seed=seed)
    raise ValueError(f"unknown generation backend {backend!r}; valid: hf, vllm")


def generate_texts(generator: Generator, tokenizer: Any, prompt_ids: list[Tensor], num_samples: int = 1, *,
                   greedy: bool = False, rows: Sequence[Mapping[str, Any]] | None = None,
                   chunk: int = 256) -> tuple[list[str], Completions]:
    """Decoded completions and the completions themselves (token counts, environment rewards), prompt i's
    samples at i*K .. i*K + K - 1, generated ``chunk`` prompts at a time (evaluation sets are larger than
    a training batch); ``rows`` are the prompts' dataset rows, for environments."""
    texts: list[str] = []
    parts: list[Completions] = []
    for start in range(0, len(prompt_ids), chunk):
        completions = generator.generate(prompt_ids[start:start + chunk], num_samples=num_samples, greedy=greedy,
                                         rows=None if rows is None else rows[start:start + chunk])
        texts += tokenizer.batch_decode(completions.completion_ids, skip_special_tokens=True)
        parts.append(completions)
    return texts, Completions.cat(parts)
