"""The passes of a preference run: summed completion log-probs of (prompt, completion) sequences.

A preference example is a prompt with ``K`` completions (chosen and rejected, or one labelled completion);
its ``K`` sequences go through one forward pass together (:func:`sequence_forward`, with the shared-prompt and
padding settings of :func:`posttrain.models.modeling.collate`). An example whose prompt has images carries the
model's image inputs (``PreferenceExamples.images``), passed with each of its sequences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posttrain.data.preference import PreferenceExamples
from posttrain.models.experts import RouterStats
from posttrain.models.modeling import collate, forward, right_pad

ImageInputs = list[dict[str, Tensor]] | None
"""Per sequence, the model's image inputs of its prompt ({} for one without), or None when no prompt has any."""


def sequence_logps(model: Any, prompts: list[Tensor], completions: list[Tensor], pad_id: int, *,
                   share_prompts: bool = True, trim_padding: bool = True,
                   images: ImageInputs = None) -> tuple[Tensor, Tensor]:
    """Summed completion log-probs [M] and completion token counts [M] of M sequences, in one forward pass
    (``share_prompts``, ``trim_padding``, ``images``: as in ``collate``)."""
    logps, lengths, _ = sequence_forward(model, prompts, completions, pad_id, share_prompts=share_prompts,
                                         trim_padding=trim_padding, images=images)
    return logps, lengths


def sequence_forward(model: Any, prompts: list[Tensor], completions: list[Tensor], pad_id: int, *,
                     share_prompts: bool = True, trim_padding: bool = True,
                     images: ImageInputs = None) -> tuple[Tensor, Tensor, RouterStats | None]:
    """:func:`sequence_logps`, and a mixture of experts' routing in the pass (with gradient; else None)."""
    ids_MT, mask_MT = right_pad(completions, pad_id)
    batch = collate(prompts, ids_MT, mask_MT, pad_id, model.device, share_prompts=share_prompts,
                    trim_padding=trim_padding, images=images)
    out = forward(model, batch)
    logp_MT = out.logprobs.masked_fill(batch.mask == 0, 0.0)
    return logp_MT.sum(-1), batch.mask.sum(-1), out.router


def passes(s: Any) -> dict[str, bool]:
    """The prompt-sharing and padding settings of a session's passes."""
    return {"share_prompts": s.config.optim.share_prompts, "trim_padding": s.config.optim.trim_padding}


def example_sequences(data: PreferenceExamples, idx: list[int]) -> tuple[list[Tensor], list[Tensor]]:
    """The K * n (prompt, completion) sequences of examples ``idx``: all chosen, then all rejected."""
    prompts = [data.prompt_ids[i] for _ in data.completion_ids for i in idx]
    completions = [column[i] for column in data.completion_ids for i in idx]
    return prompts, completions


def example_images(data: PreferenceExamples, idx: list[int], repeats: int | None = None) -> ImageInputs:
    """The image inputs of :func:`example_sequences`' sequences (``repeats``: K by default; 1 for
    :func:`mismatched_sequences`, whose prompts are ``idx``'s own)."""
    if data.images is None:
        return None
    return [data.images[i] or {} for _ in range(len(data.completion_ids) if repeats is None else repeats) for i in idx]


def mismatched_sequences(data: PreferenceExamples, idx: list[int],
                         max_length: int) -> tuple[list[Tensor], list[Tensor]]:
    """KTO's mismatched pairs: prompt ``idx[i]`` with the completion of ``idx[i-1]``, cyclic in the batch
    (cut to fit ``max_length`` after the new prompt)."""
    prompts = [data.prompt_ids[i] for i in idx]
    shifted = idx[-1:] + idx[:-1]
    completions = [data.completion_ids[0][j][:max_length - len(p)] for p, j in zip(prompts, shifted)]
    return prompts, completions


@torch.no_grad()
def chunked_logps(model: Any, prompts: list[Tensor], completions: list[Tensor], pad_id: int,
                  chunk: int, images: ImageInputs = None, **passes: bool) -> tuple[Tensor, Tensor]:
    """``sequence_logps`` without gradient, ``chunk`` sequences per forward pass: ([M], [M])."""
    parts = [sequence_logps(model, prompts[i:i + chunk], completions[i:i + chunk], pad_id,
                            images=None if images is None else images[i:i + chunk], **passes)
             for i in range(0, len(prompts), chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def dataset_logps(model: Any, data: PreferenceExamples, pad_id: int, chunk: int) -> tuple[Tensor, Tensor]:
    """Summed log-probs and token counts of every completion of ``data``, on the CPU: ([K, N], [K, N])."""
    every = list(range(len(data)))
    logps, lengths = chunked_logps(model, *example_sequences(data, every), pad_id, chunk,
                                   images=example_images(data, every))
    k = len(data.completion_ids)
    return logps.view(k, -1).cpu(), lengths.view(k, -1).cpu()
