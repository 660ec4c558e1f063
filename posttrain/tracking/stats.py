"""The statistics of an evaluation: confidence intervals, pass@k, maj@k, one task's summary.

- :func:`wilson_interval`: the 95% interval of a proportion (greedy accuracy, maj@K). Wilson's
  score interval rather than the normal one, because accuracies near 0 or 1 on a few hundred
  problems are common and the normal interval then leaves [0, 1] or collapses to a point.
- :func:`pass_at_k`: the unbiased estimator of Chen et al. (2021, "Evaluating Large Language
  Models Trained on Code"): with ``n`` samples of a problem of which ``c`` are correct, the
  probability that ``k`` samples drawn without replacement hold at least one correct one,
  ``1 - C(n - c, k) / C(n, k)``. With ``k == n`` it is whether any sample is correct.
- :func:`mean_interval`: the mean of per-problem values in [0, 1] (pass@1, pass@K) with a 95%
  normal interval over problems (the problems are the sample; the K draws per problem only make
  each value less noisy), clipped to [0, 1].
- :func:`pass_ks`: which pass@k a run of K samples reports (1, the powers of two below K, K).
- :func:`across_variants`: one problem set under several prompt variants: the mean accuracy over
  variants with its interval, and the worst variant's.
- :func:`majority_index`: maj@K's vote: the completion whose extracted answer is the most common
  among the K (ties: the answer given first); a problem is solved when that completion is correct.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson's score interval for a proportion ``successes / n``; (0, 1) when ``n`` is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))  # rounding never excludes p


def mean_interval(values: Sequence[float], z: float = Z_95) -> tuple[float, float, float]:
    """(mean, low, high) of per-problem values in [0, 1]: the normal interval over problems, clipped."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval: no values")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, 0.0, 1.0
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = z * std / math.sqrt(n)
    return mean, max(0.0, mean - half), min(1.0, mean + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a problem with ``c`` correct among ``n`` samples: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(k: int) -> list[int]:
    """The k reported from K samples: 1, the powers of two below K, and K (16 samples: 1, 2, 4, 8, 16),
    each estimated without bias from all K (:func:`pass_at_k`)."""
    return sorted({1, k, *(2 ** i for i in range(1, k.bit_length()) if 2 ** i < k)})


def across_variants(correct: dict[str, Sequence[bool]]) -> dict[str, float | str]:
    """How one problem set fares across prompt variants: ``correct[variant][i]`` is whether problem i was
    solved when asked that way (the same problems under every variant).

    ``mean``: the accuracy averaged over variants, with the normal interval over problems of each
    problem's share of variants solved (:func:`mean_interval`: the problems are the sample). ``worst``:
    the variant with the lowest accuracy (the first on ties), its accuracy and Wilson interval.
    """
    names = list(correct)
    n = len(correct[names[0]])
    if any(len(v) != n for v in correct.values()):
        raise ValueError("across_variants: every variant must score the same problems")
    shares = [sum(bool(correct[name][i]) for name in names) / len(names) for i in range(n)]
    mean, low, high = mean_interval(shares)
    worst = min(names, key=lambda name: sum(map(bool, correct[name])))
    right = sum(map(bool, correct[worst]))
    worst_low, worst_high = wilson_interval(right, n)
    return {"mean": mean, "mean_low": low, "mean_high": high, "worst": right / n, "worst_low": worst_low,
            "worst_high": worst_high, "worst_variant": worst}


def majority_index(answers: Sequence[str | None]) -> int | None:
    """Index of the first completion giving the most common answer (None answers do not vote);
    ties go to the answer given first; None when no completion gave an answer."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    return answers.index(winner)


def summarise(correct_greedy: Sequence[bool], rewards: Sequence[float], lengths: Sequence[float],
              sampled: Sequence[Sequence[bool]] | None = None,
              sampled_answers: Sequence[Sequence[str | None]] | None = None) -> dict[str, float]:
    """The metrics of one task from per-problem outcomes.

    ``correct_greedy``, ``rewards``, ``lengths``: one per problem, of its greedy completion;
    ``sampled[i]``: whether each of problem i's K samples is correct; ``sampled_answers[i]`` their
    extracted answers (for maj@K).
    """
    n = len(correct_greedy)
    right = sum(map(bool, correct_greedy))
    low, high = wilson_interval(right, n)
    out = {"accuracy": right / n, "accuracy_low": low, "accuracy_high": high,
           "reward": math.fsum(rewards) / n, "completion_length": math.fsum(lengths) / n}
    if sampled is not None:
        k = len(sampled[0])
        for j in pass_ks(k):
            per_problem = [pass_at_k(k, sum(s), j) for s in sampled]
            out[f"pass@{j}"], out[f"pass@{j}_low"], out[f"pass@{j}_high"] = mean_interval(per_problem)
        if sampled_answers is not None:
            wins = 0
            for outcomes, answers in zip(sampled, sampled_answers):
                index = majority_index(answers)
                wins += index is not None and bool(outcomes[index])
            out[f"maj@{k}"] = wins / n
            out[f"maj@{k}_low"], out[f"maj@{k}_high"] = wilson_interval(wins, n)
    return out
