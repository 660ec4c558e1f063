"""Reward scoring: weights, None, and every way a reward function can fail, under both policies."""

from __future__ import annotations

import math
import time

import pytest
import torch

from posttrain.data.scoring import RewardError, RewardPolicy, score

PROMPTS = ["1+1=", "2+2=", "3+3="]
COMPLETIONS = ["a", "bb", "ccc"]


def length(prompts, completions, **kw):
    return [float(len(c)) for c in completions]


def only_long(prompts, completions, **kw):
    return [1.0 if len(c) > 1 else None for c in completions]


def test_weighted_sum_skips_none():
    # sample 0: 2*1 + (None) = 2; sample 1: 2*2 + 0.5*1 = 4.5; sample 2: 2*3 + 0.5*1 = 6.5
    s = score([length, only_long], [2.0, 0.5], PROMPTS, COMPLETIONS, {})
    assert s.total.tolist() == [2.0, 4.5, 6.5]
    assert math.isnan(s.terms["only_long"][0]) and s.terms["only_long"][1] == 1.0
    assert not s.failed.any()


def test_columns_arrive_as_keyword_arguments():
    def uses_answer(prompts, completions, answer, **kw):
        return [float(c == a) for c, a in zip(completions, answer)]

    s = score([uses_answer], [1.0], PROMPTS, COMPLETIONS, {"answer": ["a", "x", "ccc"]})
    assert s.total.tolist() == [1.0, 0.0, 1.0]


def test_all_none_for_a_sample_is_an_error():
    with pytest.raises(RewardError, match="sample 0"):
        score([only_long], [1.0], PROMPTS, COMPLETIONS, {})


def raises_on_b(prompts, completions, **kw):
    if any("b" in c for c in completions):
        raise ZeroDivisionError("boom")
    return [1.0] * len(completions)


def nan_on_c(prompts, completions, **kw):
    return [float("nan") if "c" in c else 1.0 for c in completions]


def wrong_count(prompts, completions, **kw):
    return [1.0]


@pytest.mark.parametrize("fn, sample, text", [
    (raises_on_b, 1, "ZeroDivisionError: boom"),
    (nan_on_c, 2, "returned nan"),
])
def test_error_policy_names_the_failing_sample_and_shows_why(fn, sample, text):
    with pytest.raises(RewardError) as info:
        score([fn], [1.0], PROMPTS, COMPLETIONS, {})
    message = str(info.value)
    assert f"sample {sample}" in message and text in message
    assert repr(PROMPTS[sample]) in message and repr(COMPLETIONS[sample]) in message


def one_too_few(prompts, completions, **kw):
    return [1.0] * (len(completions) - 1)


@pytest.mark.parametrize("fn, count", [(wrong_count, 1), (one_too_few, 2)])
@pytest.mark.parametrize("on_error", ["error", "skip"])
def test_wrong_number_of_values_is_an_error_of_the_batch_not_of_a_sample(fn, count, on_error):
    """One value too few used to be retried sample by sample and pinned on sample 0 ("returned 0 values
    for 1 completions"): a count is the batch's problem, and no policy can skip it."""
    with pytest.raises(RewardError) as info:
        score([fn], [1.0], PROMPTS, COMPLETIONS, {}, RewardPolicy(on_error=on_error))
    message = str(info.value)
    assert f"reward function {fn.__name__!r} returned {count} values for 3 completions" in message
    assert "sample" not in message


def strings(prompts, completions, **kw):
    return ["0.5", "high", "1"]


@pytest.mark.parametrize("sample, shown", [(0, "str '0.5'"), (1, "str 'high'")])
def test_a_string_is_not_a_reward_even_a_numeric_one(sample, shown):
    def only(prompts, completions, **kw):  # the batch's other values are numbers
        return [strings(prompts, completions)[i] if i == sample else 1.0 for i in range(len(completions))]

    with pytest.raises(RewardError) as info:
        score([only], [1.0], PROMPTS, COMPLETIONS, {})
    message = str(info.value)
    assert f"reward function 'only' failed on sample {sample}" in message and shown in message
    assert repr(COMPLETIONS[sample]) in message and "return a number" in message
    skipped = score([only], [1.0], PROMPTS, COMPLETIONS, {}, RewardPolicy(on_error="skip"))
    assert skipped.failed.tolist() == [i == sample for i in range(3)]


def test_numpy_scalars_bools_and_one_element_tensors_are_numbers():
    import numpy as np

    def mixed(prompts, completions, **kw):
        return [np.float32(0.5), True, torch.tensor(2.0)]

    assert score([mixed], [1.0], PROMPTS, COMPLETIONS, {}).total.tolist() == [0.5, 1.0, 2.0]


@pytest.mark.parametrize("fn, bad", [(raises_on_b, 1), (nan_on_c, 2)])
def test_skip_policy_marks_only_the_failing_sample(fn, bad):
    s = score([fn], [1.0], PROMPTS, COMPLETIONS, {}, RewardPolicy(on_error="skip"))
    assert s.failed.tolist() == [i == bad for i in range(3)]
    assert s.failures == {fn.__name__: 1}
    assert all(s.terms[fn.__name__][i] == 1.0 for i in range(3) if i != bad)


def sleeps_on_b(prompts, completions, **kw):
    if any("b" in c for c in completions):
        time.sleep(30)
    return [1.0] * len(completions)


def test_timeout_kills_a_hung_reward_and_skips_its_sample():
    started = time.perf_counter()
    s = score([sleeps_on_b], [1.0], PROMPTS, COMPLETIONS, {}, RewardPolicy(timeout=0.5, on_error="skip"))
    assert time.perf_counter() - started < 10  # 1 batch call + 3 single calls, each at most 0.5 s
    assert s.failed.tolist() == [False, True, False]


def test_timeout_under_error_policy_stops_with_the_sample():
    with pytest.raises(RewardError, match="timed out after 0.5 s"):
        score([sleeps_on_b], [1.0], PROMPTS, COMPLETIONS, {}, RewardPolicy(timeout=0.5))


def test_worker_results_equal_in_process_results():
    a = score([length, only_long], [1.0, 1.0], PROMPTS, COMPLETIONS, {})
    b = score([length, only_long], [1.0, 1.0], PROMPTS, COMPLETIONS, {}, RewardPolicy(timeout=5))
    assert torch.equal(a.total, b.total)
