"""KL estimators of Schulman, "Approximating KL Divergence" (2020).

With `d = ref - logp` per sampled token (samples drawn from the policy):
`k1 = -d`, `k2 = d**2 / 2`, `k3 = exp(d) - d - 1`.

Departure from the note: `k3` is computed as `expm1(d) - d`, which is the same
value without the cancellation of `exp(d) - 1` near `d = 0`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._checks import check_choice, check_same_shape, compute_dtype


def _k1(d: Tensor) -> Tensor:
    return -d  # Schulman 2020 k1: log(p/q), unbiased, can be negative


def _k2(d: Tensor) -> Tensor:
    return d.square() / 2  # Schulman 2020 k2: (log r)^2 / 2


def _k3(d: Tensor) -> Tensor:
    return torch.expm1(d) - d  # Schulman 2020 k3: (r - 1) - log r, unbiased, >= 0; GRPO eq. (4)


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    Args:
        logprobs: [N, T] (any shape) log-probs of the sampled tokens under the policy.
        ref_logprobs: same shape as `logprobs`, under the reference policy.
        estimator: "k1" | "k2" | "k3".

    Returns:
        Same shape as `logprobs`. No masking: padded positions hold whatever the
        inputs give there; the losses mask before calling this.
    """
    check_choice("estimator", estimator, KL_ESTIMATORS)
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    dtype = compute_dtype(logprobs, ref_logprobs)
    d = ref_logprobs.to(dtype) - logprobs.to(dtype)
    return KL_ESTIMATORS[estimator](d)
