"""Difficulty filtering (``difficulty_filter_low`` / ``difficulty_filter_high``): the prompt sampler passes
over prompts whose last group pass rate was too low or too high before they are generated, counts them,
keeps its pass rates through a checkpoint, and the online step logs what it skipped."""

from __future__ import annotations

import json

import pytest

from posttrain.config import Config, ConfigError
from posttrain.data.prompts import PromptSampler
from posttrain.training.online import train_step
from posttrain.training.session import OnlineSession
from conftest import assert_online_resume_is_exact

# The orders PromptSampler(6, seed=0) walks (torch.randperm(6) seeded with seed * 1_000_003 + epoch):
EPOCH_ORDERS = {0: [2, 5, 3, 0, 1, 4], 1: [1, 5, 2, 0, 3, 4], 2: [0, 3, 1, 2, 4, 5], 3: [4, 0, 3, 2, 1, 5]}


def test_the_epoch_orders_are_those_the_hand_computed_test_assumes():
    sampler = PromptSampler(6, seed=0)
    for epoch, order in EPOCH_ORDERS.items():
        sampler.epoch = epoch
        assert sampler._order() == order


def test_prompts_outside_the_band_are_skipped_in_later_epochs_by_hand():
    sampler = PromptSampler(6, seed=0, difficulty_filter_low=0.0, difficulty_filter_high=1.0)
    assert sampler.next(6) == [2, 5, 3, 0, 1, 4]  # epoch 0: no pass rate known, nothing skipped
    assert sampler.tally == {"skipped_easy": 0, "skipped_hard": 0, "drawn_with_rate": 0, "drawn_rate_sum": 0}
    # group pass rates of G = 4 samples: 0/4, 4/4, 1/4, 2/4, 3/4, 4/4
    sampler.record_pass_rates({0: 0.0, 1: 1.0, 2: 0.25, 3: 0.5, 4: 0.75, 5: 1.0})
    # epoch 1 walks 1 (easy), 5 (easy), 2, 0 (hard), 3, 4: three drawn, with rates 0.25 + 0.5 + 0.75 = 1.5
    assert sampler.next(3) == [2, 3, 4]
    assert sampler.tally == {"skipped_easy": 2, "skipped_hard": 1, "drawn_with_rate": 3, "drawn_rate_sum": 1.5}
    sampler.record_pass_rates({2: 0.0, 3: 0.5, 4: 1.0})  # 2 is now too hard, 4 too easy
    # epoch 2 walks 0 (hard), 3, 1 (easy), 2 (hard), 4 (easy), 5 (easy); epoch 3: 4 (easy), 0 (hard), 3
    assert sampler.next(2) == [3, 3]
    assert sampler.tally == {"skipped_easy": 2 + 3 + 1, "skipped_hard": 1 + 2 + 1, "drawn_with_rate": 3 + 2,
                             "drawn_rate_sum": 1.5 + 0.5 + 0.5}
    assert (sampler.epoch, sampler.position) == (3, 3)
    sampler.record_pass_rates({3: 1.0})  # the last prompt in the band is solved: none is left
    with pytest.raises(RuntimeError, match=r"difficulty filtering has left out every prompt.*difficulty_filter_low "
                                           r"\(0.0\).*difficulty_filter_high \(1.0\)"):
        sampler.next(1)


def test_one_threshold_alone_skips_only_its_side():
    sampler = PromptSampler(6, seed=0, difficulty_filter_high=0.75)
    sampler.next(6)
    sampler.record_pass_rates({0: 0.0, 1: 1.0, 2: 0.25, 3: 0.5, 4: 0.75, 5: 1.0})
    # epoch 1: 1 (>= 0.75), 5 (>= 0.75) skipped, then 2, 0 (never solved, but no low threshold), 3
    assert sampler.next(3) == [2, 0, 3]
    assert (sampler.tally["skipped_easy"], sampler.tally["skipped_hard"]) == (2, 0)


def test_history_resampling_still_leaves_out_prompts_solved_in_the_last_epoch():
    sampler = PromptSampler(6, seed=0, history_resampling=True)
    sampler.next(6)
    sampler.record_pass_rates({0: 0.0, 1: 1.0, 2: 0.25, 3: 0.5, 4: 0.75, 5: 1.0})
    # epoch 1's order without 1 and 5 (solved by every completion): 2, 0, 3, 4; no difficulty filter, no skips
    assert sampler.next(4) == [2, 0, 3, 4]
    assert sampler.tally["skipped_easy"] == sampler.tally["skipped_hard"] == 0


def test_a_resumed_sampler_equals_an_uninterrupted_one():
    def run(sampler: PromptSampler, steps: range) -> list[list[int]]:
        drawn = []
        for step in steps:  # a pass rate for each drawn prompt that depends on the prompt and the step
            indices = sampler.next(4)
            sampler.record_pass_rates({i: ((i * 7 + step) % 9) / 8 for i in indices})
            drawn.append(indices)
        return drawn

    settings = dict(num_rows=20, seed=3, difficulty_filter_low=0.0, difficulty_filter_high=1.0)
    whole = PromptSampler(**settings)
    uninterrupted = run(whole, range(12))
    first = PromptSampler(**settings)
    before = run(first, range(7))  # interrupted in the second epoch, some prompts already skipped
    saved = json.loads(json.dumps(first.state_dict()))  # the checkpoint's trainer_state is JSON
    second = PromptSampler(**settings)
    second.load_state_dict(saved)
    assert before + run(second, range(7, 12)) == uninterrupted
    assert second.state_dict() == whole.state_dict()
    assert whole.tally["skipped_easy"] > 0 and whole.tally["skipped_hard"] > 0  # the filter acted after the resume


def test_a_checkpoint_without_pass_rates_loads_with_none():
    sampler = PromptSampler(4, seed=0, difficulty_filter_low=0.0)
    sampler.load_state_dict({"epoch": 1, "position": 2, "excluded": [], "solved_this_epoch": [3]})
    assert (sampler.pass_rates, sampler.tally["skipped_hard"]) == ({}, 0)


@pytest.mark.parametrize("field, value, message", [
    ("difficulty_filter_low", 1.0, r"difficulty_filter_low: got 1.0; use a pass rate in \[0, 1\)"),
    ("difficulty_filter_high", 0.0, r"difficulty_filter_high: got 0.0; use a pass rate in \(0, 1\]"),
    ("difficulty_filter_low", 0.5, r"difficulty_filter_high: got 0.5 with difficulty_filter_low 0.5"),
])
def test_invalid_thresholds_are_rejected_where_the_config_is_built(field, value, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_flat({"difficulty_filter_high": 0.5, field: value})


def test_the_filter_needs_a_task_that_checks_answers(tiny_model_dir, reward_file, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["1+1=", "2+2="]))
    config = Config.from_flat(dict(model=str(tiny_model_dir), dataset=str(data), reward=[f"{reward_file}:sevens"],
                                   max_new_tokens=4, prompts_per_step=2, difficulty_filter_high=1.0))
    with pytest.raises(ConfigError, match="difficulty_filter_low, difficulty_filter_high: .* a task that checks"):
        OnlineSession.create(config)


def one_digit_sums(**flat) -> Config:
    """GRPO on the built-in model, on the addition task's 54 one-digit sums (the prompts of at most 5 tokens):
    27 prompts a step, so that each prompt's pass rate is known after two steps and the third draws again."""
    return Config.from_flat(dict(
        algorithm="grpo", model="tiny-addition", task="addition", max_prompt_length=5, long_prompts="drop",
        prompts_per_step=27, group_size=4, eval_size=4, progress=False, report_to="none", seed=0,
        difficulty_filter_low=0.0, difficulty_filter_high=1.0, **flat))


def test_the_step_skips_prompts_before_generating_them_and_logs_it():
    s = OnlineSession.create(one_digit_sums(max_steps=3))
    assert len(s.train_rows) == 54
    for _ in range(2):  # epoch 0: every prompt sampled once, none skipped
        metrics = train_step(s)
        s.step += 1
        assert (metrics["difficulty/skipped_easy"], metrics["difficulty/skipped_hard"]) == (0, 0)
        assert "difficulty/prior_pass_rate" not in metrics
    known = dict(s.sampler.pass_rates)
    assert len(known) == 54 and {0.0, 1.0} & set(known.values())
    generated = []
    s.generator.generate = recording(s.generator.generate, generated)
    metrics = train_step(s)
    trained = s.last_groups.indices
    assert all(0.0 < known[i] < 1.0 for i in trained)  # none that was never or always solved was trained on
    skipped = metrics["difficulty/skipped_easy"] + metrics["difficulty/skipped_hard"]
    assert skipped > 0
    assert metrics["difficulty/skipped_easy"] == s.sampler.tally["skipped_easy"]
    assert metrics["difficulty/completions_saved"] == skipped * 4  # x group_size
    assert metrics["difficulty/prior_pass_rate"] == pytest.approx(sum(known[i] for i in trained) / len(trained))
    assert generated == [27 * 4]  # the skipped prompts were never generated: the batch was refilled before


def recording(generate, sizes: list[int]):
    def generate_and_count(prompts, num_samples, **kwargs):
        sizes.append(len(prompts) * num_samples)
        return generate(prompts, num_samples=num_samples, **kwargs)
    return generate_and_count


def test_a_resumed_run_skips_what_the_uninterrupted_one_skips(tmp_path):
    assert_online_resume_is_exact(lambda output: one_digit_sums(
        max_steps=3, save_every=2, eval_every=0, log_samples_every=0, output=output), tmp_path)
