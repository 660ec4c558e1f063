"""Routing replay's first half: the experts a mixture of experts chose for each token while it was sampled.

:class:`RoutingRecorder` hooks the routers of the model that samples and keeps, for each forward pass, every
router's chosen experts ``[T, k]``. After a batch is sampled, :func:`decode_routing` (posttrain's decode loop:
one prefill of the distinct prompts, then one pass per step over the rows still running) or
:func:`generate_routing` (transformers' ``generate``: the prompts repeated per sample, then every row each
step) lays them out per completion as ``[N, L, S, k]``: row ``n``'s prompt tokens at positions
``0..P_n - 1`` and its completion tokens fed back at ``P_n..``, the positions the training pass computes. A
completion's last token is never fed back while sampling, and the training pass does not compute it either.
The training pass replays them (:class:`posttrain.models.experts.RoutingReplay`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posttrain.models.experts import routers


class RoutingRecorder:
    """While active, each forward pass's chosen experts per router: ``passes[i]`` is ``[L, T_i, k]``."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        self._current: list[Tensor] = []
        self.passes: list[Tensor] = []
        self._handles: list = []

    def __enter__(self) -> RoutingRecorder:
        self._handles = [r.register_forward_hook(self._routed) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _routed(self, module: nn.Module, args: tuple, out: tuple[Tensor, Tensor, Tensor]) -> None:
        self._current.append(out[2].detach().to(torch.int16).cpu())
        if len(self._current) == len(self.routers):  # every layer has routed this pass's tokens
            self.passes.append(torch.stack(self._current))
            self._current = []


def _layout(prompt_lengths: list[int], completion_inputs: list[int], layers: int, k: int) -> Tensor:
    width = max(p + c for p, c in zip(prompt_lengths, completion_inputs))
    return torch.zeros(len(prompt_lengths), layers, max(width, 1), k, dtype=torch.int16)


def decode_routing(recorder: RoutingRecorder, prompt_lengths: list[int], width: int, num_samples: int,
                   step_rows: list[Tensor], lengths: Tensor) -> Tensor:
    """[N, L, S, k] from posttrain's decode loop: ``recorder.passes[0]`` the prefill of the distinct prompts,
    left-padded to ``width`` (``[L, P * width, k]``); ``passes[1 + t]`` step ``t``'s pass over the rows
    ``step_rows[t]`` (output row indices), which fed back each row's completion token ``t``. ``lengths``: [N]
    each completion's tokens."""
    prefill, steps = recorder.passes[0], recorder.passes[1:]
    layers, k = prefill.shape[0], prefill.shape[-1]
    n = len(prompt_lengths) * num_samples
    inputs = [max(int(lengths[row]) - 1, 0) for row in range(n)]
    own = [prompt_lengths[row // num_samples] for row in range(n)]
    routing = _layout(own, inputs, layers, k)
    prefill = prefill.view(layers, len(prompt_lengths), width, k)
    for row in range(n):
        p = own[row]
        routing[row, :, :p] = prefill[:, row // num_samples, width - p:]
    own_N, inputs_N = torch.tensor(own), torch.tensor(inputs)
    for t, (rows, chosen) in enumerate(zip(step_rows, steps)):  # chosen: [L, len(rows), k]
        rows = rows.cpu()
        fed = t < inputs_N[rows]  # the rows whose token t is a completion input (not their last token)
        routing[rows[fed], :, own_N[rows[fed]] + t] = chosen[:, fed].transpose(0, 1)
    return routing


def generate_routing(recorder: RoutingRecorder, prompt_lengths: list[int], width: int, num_samples: int,
                     lengths: Tensor) -> Tensor:
    """[N, L, S, k] from transformers' ``generate``: ``passes[0]`` the prefill of every row (each prompt
    repeated per sample, left-padded to ``width``), ``passes[1 + t]`` step ``t`` over every row."""
    prefill, steps = recorder.passes[0], recorder.passes[1:]
    layers, k = prefill.shape[0], prefill.shape[-1]
    n = len(prompt_lengths) * num_samples
    inputs = [max(int(lengths[row]) - 1, 0) for row in range(n)]
    own = [prompt_lengths[row // num_samples] for row in range(n)]
    routing = _layout(own, inputs, layers, k)
    prefill = prefill.view(layers, n, width, k)
    for row in range(n):
        p = own[row]
        routing[row, :, :p] = prefill[:, row, width - p:]
    own_N, inputs_N = torch.tensor(own), torch.tensor(inputs)
    for t, chosen in enumerate(steps):  # chosen: [L, N, k]
        fed = t < inputs_N
        routing[fed, :, own_N[fed] + t] = chosen[:, fed].transpose(0, 1)
    return routing
