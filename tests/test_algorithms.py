"""Presets: every field against ALGORITHMS.md's tables, validation, hand-computed
advantages, delegation of the losses to posttrain.functional, and the lineage views."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import posttrain
import posttrain.functional as F
from posttrain.functional._policy import CLIP_OPTIONS
from posttrain.algorithms.presets import (
    AFTER_THE_SEED,
    ALGORITHMS,
    DESCRIPTIVE_FIELDS,
    OnlineAlgorithm,
    PreferenceAlgorithm,
    SupervisedAlgorithm,
    algorithm,
    field_help,
    setting_names,
)
from posttrain.algorithms.tables import format_presets_table, format_side_by_side

# ALGORITHMS.md "Presets", written out field by field; the last two columns are each preset's papers'
# update structure (optimizer steps per rollout = mini_batches x num_epochs, cited in update_structure).
ONLINE_COLUMNS = ("advantage", "ratio", "clip", "eps_low", "eps_high", "aggregation", "loss",
                  "kl_placement", "kl_estimator", "beta", "num_epochs", "mini_batches")
ONLINE_TABLE = {
    "ppo": ("gae", "token", "ppo", 0.2, 0.2, "sequence_mean", "policy", "token_reward", "k1", 0.01, 1, 8),
    "remax": ("greedy_baseline", "token", "ppo", 0.2, 0.2, "sequence_mean", "policy", "sequence_reward", "k1", 0.01,
              1, 1),
    "rloo": ("rloo", "token", "ppo", 0.2, 0.2, "sequence_mean", "policy", "sequence_reward", "k1", 0.01, 1, 1),
    "grpo": ("group", "token", "ppo", 0.2, 0.2, "sequence_mean", "policy", "loss", "k3", 0.04, 1, 1),
    "reinforce_pp": ("reinforce_pp", "token", "ppo", 0.2, 0.2, "token_mean", "policy", "token_reward", "k1", 0.01,
                     1, 8),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", "token", "ppo", 0.2, 0.2, "token_mean", "policy",
                              "token_reward", "k1", 0.01, 1, 8),
    "dapo": ("group", "token", "ppo", 0.2, 0.28, "token_mean", "policy", "none", None, 0.0, 1, 16),
    "dr_grpo": ("group_mean", "token", "ppo", 0.2, 0.2, "constant", "policy", "none", None, 0.0, 1, 8),
    "cispo": ("group", "token", "is_weight", None, 4.0, "token_mean", "policy", "none", None, 0.0, 1, 16),
    "gspo": ("group", "sequence", "ppo", 3e-4, 4e-4, "sequence_mean", "policy", "none", None, 0.0, 1, 4),
    "gspo_token": ("group", "sequence_token", "ppo", 3e-4, 4e-4, "sequence_mean", "policy", "none", None, 0.0, 1, 4),
    "best_of_n": ("best_of_n", "token", "none", None, None, "token_mean", "nll", "none", None, 0.0, 1, 1),
    "sapo": ("group", "token", "sapo", None, None, "sequence_mean", "policy", "none", None, 0.0, 1, 4),
    "dppo": ("group", "token", "dppo_tv", None, None, "constant", "policy", "none", None, 0.0, 1, 8),
    "gmpo": ("group", "token", "geometric", 1 - math.exp(-0.4), math.exp(0.4) - 1, "sequence_mean", "policy", "none",
             None, 0.0, 1, 8),
    "lite_ppo": ("group_batch_std", "token", "ppo", 0.2, 0.2, "token_mean", "policy", "none", None, 0.0, 1, 1),
    "gdpo": ("gdpo", "token", "ppo", 0.2, 0.2, "sequence_mean", "policy", "loss", "k3", 0.04, 1, 1),
    "maxrl": ("maxrl", "token", "ppo", 0.2, 0.2, "sequence_mean", "policy", "loss", "k3", 0.04, 1, 1),
    "clip_cov": ("group", "token", "clip_cov", None, 1.0, "token_mean", "policy", "none", None, 0.0, 1, 8),
    "kl_cov": ("group", "token", "kl_cov", None, None, "token_mean", "policy", "none", None, 0.0, 1, 8),
    "entropy_control": ("group", "token", "ppo", 0.2, 0.2, "token_mean", "policy", "none", None, 0.0, 1, 1),
    "on_policy_distill": ("reverse_kl", "token", "none", None, None, "token_mean", "policy", "none", None, 0.0, 1, 1),
    "multi_teacher_distill": ("reverse_kl", "token", "none", None, None, "token_mean", "policy", "none", None, 0.0,
                              1, 1),
    "sdft": ("reverse_kl", "token", "none", None, None, "sequence_mean", "policy", "none", None, 0.0, 1, 1),
}
ONLINE_DEFAULTS = dict(dual_clip=None, value_clip=None, gamma=None, lam=None, reward_clip=None, binary_reward=None,
                       dynamic_sampling=False, max_generation_rounds=3, overlong_buffer_ratio=None,
                       overlong_filter=False, history_resampling=False, min_reward=None, skip_ties=False, eps=1e-6,
                       tau_pos=None, tau_neg=None, divergence_bound=None, cov_fraction=None, cov_bounds=None,
                       kl_cov_coef=None, entropy_coef=0.0, entropy_target=None, entropy_coef_step=None,
                       task_reward_weight=None, off_policy_mask=None, kl_importance_weighted=False,
                       self_teacher_ema=None, teacher_per_task=False)
ONLINE_EXTRAS = {
    "ppo": dict(value_clip=0.2, gamma=1.0, lam=0.95),
    "reinforce_pp": dict(reward_clip=10.0),
    "dapo": dict(dynamic_sampling=True, overlong_buffer_ratio=4096 / 20480, binary_reward=(-1.0, 1.0)),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
    "dppo": dict(divergence_bound=0.15),
    "clip_cov": dict(cov_fraction=2e-4, cov_bounds=(1.0, 5.0)),
    "kl_cov": dict(cov_fraction=2e-3, kl_cov_coef=1.0),
    "entropy_control": dict(entropy_target=0.2, entropy_coef_step=0.005),
    "multi_teacher_distill": dict(teacher_per_task=True),
    "sdft": dict(self_teacher_ema=0.05),  # TRL's teacher_update_rate: the paper's EMA, its rate not found
    "best_of_n": dict(skip_ties=True),  # not in ALGORITHMS.md: without it a group with no right answer trains on a wrong one
}
PREFERENCE_COLUMNS = ("loss", "beta", "label_smoothing", "alpha", "gamma", "lam", "desirable_weight",
                      "undesirable_weight")
PREFERENCE_TABLE = {
    "dpo": ("dpo", 0.1, 0.0, None, None, None, None, None),
    "odpo": ("odpo", 0.1, None, 1.0, None, None, None, None),
    "simpo": ("simpo", 2.0, None, None, 1.0, None, None, None),
    "orpo": ("orpo", None, None, None, None, 0.1, None, None),
    "ipo": ("ipo", 0.5, None, None, None, None, None, None),
    "kto": ("kto", 0.1, None, None, None, None, 1.0, 1.0),
}
SUPERVISED_TABLE = {  # objective, completion_only_loss, center_rewards_coefficient
    "sft": ("sft", True, None),
    "reward_model": ("reward_model", None, None),
    "gkd": ("gkd", True, None),
}
ARXIV = {"sft": "2203.02155", "reward_model": "2203.02155", "ppo": "1707.06347", "remax": "2310.10505", "rloo": "2402.14740", "grpo": "2402.03300",
         "reinforce_pp": "2501.03262", "reinforce_pp_baseline": "2501.03262", "dapo": "2503.14476",
         "dr_grpo": "2503.20783", "cispo": "2506.13585", "gspo": "2507.18071", "gspo_token": "2507.18071",
         "best_of_n": "2304.06767", "dpo": "2305.18290", "odpo": "2402.10571", "simpo": "2405.14734",
         "orpo": "2403.07691", "kto": "2402.01306", "sapo": "2511.20347", "dppo": "2602.04879",
         "gmpo": "2507.20673", "lite_ppo": "2508.08221", "clip_cov": "2505.22617", "kl_cov": "2505.22617",
         "entropy_control": "2505.22312", "on_policy_distill": "2306.13649", "sdft": "2601.19897",
         "multi_teacher_distill": "2601.02780",
         "gdpo": "2601.05242", "gkd": "2306.13649", "maxrl": "2602.02710", "ipo": "2310.12036"}


# --- the registry ------------------------------------------------------------------------


def test_registry_holds_exactly_the_presets_of_the_table():
    seed = [name for name in ONLINE_TABLE if name not in AFTER_THE_SEED]
    assert list(ALGORITHMS) == [*seed, *AFTER_THE_SEED, *PREFERENCE_TABLE, *SUPERVISED_TABLE]
    assert all(name == preset.name for name, preset in ALGORITHMS.items())
    assert posttrain.algorithm is algorithm and posttrain.ALGORITHMS is ALGORITHMS


@pytest.mark.parametrize("name", ONLINE_TABLE)
def test_online_preset_fields_equal_the_table(name):
    preset = ALGORITHMS[name]
    assert isinstance(preset, OnlineAlgorithm)
    expected = {**dict(zip(ONLINE_COLUMNS, ONLINE_TABLE[name])), **ONLINE_DEFAULTS, **ONLINE_EXTRAS.get(name, {})}
    actual = {f.name: getattr(preset, f.name) for f in dataclasses.fields(preset)}
    assert {k: v for k, v in actual.items() if k not in DESCRIPTIVE_FIELDS} == expected


@pytest.mark.parametrize("name", ONLINE_TABLE)
def test_each_online_preset_cites_its_update_structure(name):
    """Where the paper gives the count, the citation names the paper's arXiv id (or, for a paper silent on
    it, says so and whose count it takes)."""
    preset = ALGORITHMS[name]
    papers = re.findall(r"arxiv.org/abs/(\d+\.\d+)", preset.paper)
    text = preset.update_structure
    assert any(f"arXiv:{paper}" in text for paper in papers) or "states no" in text, text
    assert f"{preset.mini_batches} " in text.replace("four", "4") or preset.mini_batches == 1, text


@pytest.mark.parametrize("name", PREFERENCE_TABLE)
def test_preference_preset_fields_equal_the_table(name):
    preset = ALGORITHMS[name]
    assert isinstance(preset, PreferenceAlgorithm)
    assert tuple(getattr(preset, column) for column in PREFERENCE_COLUMNS) == PREFERENCE_TABLE[name]


@pytest.mark.parametrize("name", SUPERVISED_TABLE)
def test_supervised_preset_fields_equal_the_table(name):
    preset = ALGORITHMS[name]
    assert isinstance(preset, SupervisedAlgorithm)
    columns = ("objective", "completion_only_loss", "center_rewards_coefficient")
    assert tuple(getattr(preset, column) for column in columns) == SUPERVISED_TABLE[name]


def test_a_supervised_preset_refuses_the_other_objectives_settings():
    with pytest.raises(ValueError, match="center_rewards_coefficient is not used by objective='sft'"):
        algorithm("sft", center_rewards_coefficient=0.01)
    with pytest.raises(ValueError, match="completion_only_loss is not used by objective='reward_model'"):
        algorithm("reward_model", completion_only_loss=True)
    with pytest.raises(ValueError, match="center_rewards_coefficient=-1 must be >= 0"):
        algorithm("reward_model", center_rewards_coefficient=-1)
    assert algorithm("reward_model", center_rewards_coefficient=0.01).center_rewards_coefficient == 0.01
    with pytest.raises(ValueError, match="student_fraction is not used by objective='sft' \\(it belongs to gkd\\)"):
        algorithm("sft", student_fraction=0.5)
    with pytest.raises(ValueError, match="jsd_beta=1.5 must lie in \\[0, 1\\]"):
        algorithm("gkd", jsd_beta=1.5)


@pytest.mark.parametrize("name", ARXIV)
def test_each_preset_cites_its_paper_and_summarises_its_change(name):
    preset = ALGORITHMS[name]
    assert f"https://arxiv.org/abs/{ARXIV[name]}" in preset.paper
    assert preset.summary and "\n" not in preset.summary


def test_every_field_has_a_one_line_help():
    for cls in (OnlineAlgorithm, PreferenceAlgorithm):
        helps = field_help(cls)
        assert list(helps) == [f.name for f in dataclasses.fields(cls) if f.name not in DESCRIPTIVE_FIELDS]
        assert all(text and "\n" not in text for text in helps.values())
    assert "max_num_gen_batches" in field_help(OnlineAlgorithm)["max_generation_rounds"]
    assert field_help(ALGORITHMS["dpo"]) == field_help(PreferenceAlgorithm)


DERIVED = {  # needs_reference, needs_old_logprobs, needs_value_model, needs_greedy_baseline, is_group_estimator
    # needs_old_logprobs: several updates per rollout (mini_batches x num_epochs > 1) or dynamic sampling
    "ppo": (True, True, True, False, False), "remax": (True, False, False, True, False),
    "rloo": (True, False, False, False, True), "grpo": (True, False, False, False, True),
    "reinforce_pp": (True, True, False, False, False), "reinforce_pp_baseline": (True, True, False, False, True),
    "dapo": (False, True, False, False, True), "dr_grpo": (False, True, False, False, True),
    "cispo": (False, True, False, False, True), "gspo": (False, True, False, False, True),
    "gspo_token": (False, True, False, False, True), "best_of_n": (False, False, False, False, False),
}


@pytest.mark.parametrize("name", DERIVED)
def test_derived_flags_of_online_presets(name):
    p = ALGORITHMS[name]
    flags = (p.needs_reference, p.needs_old_logprobs, p.needs_value_model, p.needs_greedy_baseline,
             p.is_group_estimator)
    assert flags == DERIVED[name]


def test_derived_flags_of_preference_presets():
    flags = {n: (p.needs_reference, p.paired, p.needs_scores) for n, p in ALGORITHMS.items() if n in PREFERENCE_TABLE}
    assert flags == {"dpo": (True, True, False), "odpo": (True, True, True), "simpo": (False, True, False),
                     "orpo": (False, True, False), "ipo": (True, True, False), "kto": (True, False, False)}


def test_zero_beta_drops_the_reference_and_one_epoch_needs_no_recorded_old_logprobs():
    assert not algorithm("grpo", beta=0.0).needs_reference
    assert algorithm("grpo", num_epochs=2).needs_old_logprobs
    assert algorithm("grpo", mini_batches=2).needs_old_logprobs
    assert not algorithm("dapo", dynamic_sampling=False, mini_batches=1).needs_old_logprobs


# --- overrides and validation -------------------------------------------------------------


def test_override_returns_a_new_frozen_object_and_leaves_the_registry_alone():
    custom = algorithm("dapo", eps_high=0.3, history_resampling=True)
    assert (custom.eps_high, custom.history_resampling) == (0.3, True)
    assert (ALGORITHMS["dapo"].eps_high, ALGORITHMS["dapo"].history_resampling) == (0.28, False)
    assert custom is not ALGORITHMS["dapo"] and algorithm("dapo") == ALGORITHMS["dapo"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        custom.eps_high = 0.5
    assert algorithm("dapo", binary_reward=[-1, 1]).binary_reward == (-1, 1)  # YAML lists become tuples


def test_unknown_name_lists_the_valid_ones_and_a_close_match():
    with pytest.raises(ValueError, match="unknown algorithm 'dr-grpo'") as info:
        algorithm("dr-grpo")
    assert "Did you mean 'dr_grpo'" in str(info.value)
    assert all(name in str(info.value) for name in ALGORITHMS)


def test_unknown_field_names_it_and_lists_the_fields_of_that_kind():
    with pytest.raises(ValueError, match=r"unknown field 'epsilon_high' for 'dapo' \(OnlineAlgorithm\)") as info:
        algorithm("dapo", epsilon_high=0.3)
    assert "Did you mean 'eps_high'" in str(info.value)
    assert all(name in str(info.value) for name in setting_names(OnlineAlgorithm))
    assert "summary" not in str(info.value)  # what a preset is, not a setting
    with pytest.raises(ValueError, match=r"unknown field 'eps_high' for 'dpo' \(PreferenceAlgorithm\)") as info:
        algorithm("dpo", eps_high=0.3)
    assert "label_smoothing" in str(info.value) and "advantage" not in str(info.value)


@pytest.mark.parametrize("name, overrides, message", [
    ("grpo", dict(eps=-1e-6), "eps=-1e-06 must be >= 0"),
    ("grpo", dict(eps_low=-0.1), r"eps_low=-0.1 must be in \[0, 1\)"),
    ("grpo", dict(eps_low=1.0), "None = no lower bound"),
    ("grpo", dict(eps_high=-0.2), "eps_high=-0.2 must be >= 0"),
    ("grpo", dict(dual_clip=1.0), "dual_clip=1.0 must be > 1"),
    ("cispo", dict(dual_clip=3.0), "dual_clip applies to clip='ppo' only"),
    ("grpo", dict(beta=-0.04), "beta=-0.04 must be >= 0"),
    ("ppo", dict(num_epochs=0), "num_epochs=0 must be >= 1"),
    ("dapo", dict(max_generation_rounds=0), "max_generation_rounds=0 must be >= 1"),
    ("grpo", dict(aggregation="mean"), "aggregation='mean' is not one of 'sequence_mean', 'token_mean'"),
    ("grpo", dict(advantage="grpo"), "advantage='grpo' is not one of"),
    ("grpo", dict(kl_estimator="k4"), "kl_estimator='k4' is not one of"),
    ("dapo", dict(overlong_buffer_ratio=0.0), r"overlong_buffer_ratio=0.0 must be in \(0, 1\]"),
    ("reinforce_pp", dict(reward_clip=0.0), "reward_clip=0.0 must be > 0"),
    ("dapo", dict(binary_reward=(1.0, -1.0)), "incorrect < correct"),
    ("dapo", dict(kl_placement="loss", beta=0.04), "kl_placement='loss' needs a kl_estimator"),
    ("grpo", dict(kl_placement="none"), "beta=0.04 does nothing with kl_placement='none'"),
    ("rloo", dict(kl_estimator="k3"), "uses kl_estimator='k1'"),
    ("grpo", dict(kl_placement="token_reward", kl_estimator="k1"), "needs a token-level estimator"),
    ("ppo", dict(kl_placement="sequence_reward"), "needs a sequence-level estimator"),
    ("grpo", dict(loss="nll"), "advantage='best_of_n' and loss='nll' go together"),
    ("best_of_n", dict(loss="policy"), "advantage='best_of_n' and loss='nll' go together"),
    ("best_of_n", dict(kl_placement="loss", kl_estimator="k3", beta=0.1), "loss='nll' .* takes no KL"),
    ("cispo", dict(ratio="sequence"), "ratio='sequence' .* needs clip='ppo'"),
    ("ppo", dict(gamma=None), "advantage='gae' needs gamma in"),
    ("ppo", dict(lam=1.5), "advantage='gae' needs gamma in"),
    ("grpo", dict(lam=0.95), "belong to advantage='gae'"),
    ("ppo", dict(value_clip=-0.2), "value_clip=-0.2 must be > 0"),
    ("grpo", dict(min_reward=0.5), "min_reward applies to advantage='best_of_n' only"),
    ("grpo", dict(skip_ties=True), "skip_ties applies to advantage='best_of_n' only"),
    ("remax", dict(dynamic_sampling=True), "only for a group estimator"),
    ("dpo", dict(beta=0.0), "beta=0.0 must be > 0"),
    ("dpo", dict(label_smoothing=0.5), r"label_smoothing=0.5 must be in \[0, 0.5\)"),
    ("dpo", dict(gamma=1.0), r"gamma is not used by loss='dpo' \(it uses beta, label_smoothing\)"),
    ("simpo", dict(gamma=None), "loss='simpo' needs gamma"),
    ("odpo", dict(alpha=-1.0), "alpha=-1.0 must be >= 0"),
    ("kto", dict(desirable_weight=0.0), "desirable_weight=0.0 must be > 0"),
    ("kto", dict(loss="hinge"), "loss='hinge' is not one of"),
])
def test_invalid_values_raise_with_what_to_change(name, overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        algorithm(name, **overrides)
    assert repr(name) in str(info.value)  # the message names the preset


@pytest.mark.parametrize("name, overrides", [
    ("grpo", dict(beta=0.0)), ("cispo", dict(eps_high=None)), ("grpo", dict(aggregation="constant")),
    ("gspo", dict(history_resampling=True)), ("grpo", dict(dual_clip=3.0)),
    ("reinforce_pp", dict(kl_placement="loss", kl_estimator="k3")), ("dapo", dict(overlong_filter=True)),
    ("grpo", dict(dynamic_sampling=True)), ("best_of_n", dict(min_reward=0.5)), ("dpo", dict(label_smoothing=0.1)),
])
def test_valid_combinations_build(name, overrides):
    assert algorithm(name, **overrides).name == name


# --- advantages ---------------------------------------------------------------------------


def test_group_advantages_by_hand_and_dapo_cispo_gspo_equal_grpo():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    std = math.sqrt(4 * 0.5**2 / 3)  # Bessel: sum of squared deviations / (G - 1)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (std + 1e-6)  # = +-0.8660
    grpo = ALGORITHMS["grpo"].advantages(rewards)
    torch.testing.assert_close(grpo, expected)
    for name in ("dapo", "cispo", "gspo", "gspo_token"):
        torch.testing.assert_close(ALGORITHMS[name].advantages(rewards), grpo)
    torch.testing.assert_close(ALGORITHMS["dr_grpo"].advantages(rewards), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))


def test_sequence_advantages_broadcast_to_tokens_and_zero_padding():
    rewards = torch.tensor([[1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    advantages, returns = ALGORITHMS["dr_grpo"].advantages_and_returns(rewards, mask=mask)
    assert returns is None
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="mask must be"):
        ALGORITHMS["dr_grpo"].advantages(rewards, mask=mask[:1])
    with pytest.raises(ValueError, match=r"rewards must be \[B, G\]"):
        ALGORITHMS["grpo"].advantages(rewards.flatten())


# Two completions of one prompt; padded entries hold garbage that must not matter.
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
LOGP = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 7.0, 7.0]])
REF = torch.tensor([[-1.5, -1.0, -50.0], [-1.0, 3.0, 3.0]])
# k1 = logp - ref over valid tokens: row 0: 0.5 - 1.0 = -0.5; row 1: 0.5


def test_rloo_with_sequence_kl_by_hand():
    rloo = algorithm("rloo", beta=0.1)
    rewards = torch.tensor([[1.0, 0.0]])
    # shaped: 1 - 0.1 * (-0.5) = 1.05 and 0 - 0.1 * 0.5 = -0.05; leave-one-out with G = 2: +-1.10
    advantages = rloo.advantages(rewards, mask=MASK, logprobs=LOGP, ref_logprobs=REF)
    torch.testing.assert_close(advantages, torch.tensor([[1.1, 1.1, 0.0], [-1.1, 0.0, 0.0]]))
    torch.testing.assert_close(algorithm("rloo", beta=0.0).advantages(torch.tensor([[1.0, 2.0, 6.0]])),
                               torch.tensor([[1 - 4.0, 2 - 3.5, 6 - 1.5]]))  # r_i - mean of the others
    with pytest.raises(ValueError, match="needs logprobs, ref_logprobs"):
        rloo.advantages(rewards, mask=MASK)


def test_remax_baseline_is_the_raw_greedy_reward():
    remax = algorithm("remax", beta=0.1)
    advantages = remax.advantages(torch.tensor([[1.0, 0.0]]), logprobs=LOGP, ref_logprobs=REF, mask=MASK,
                                  baseline=torch.tensor([0.5]))
    # (1.05 - 0.5, -0.05 - 0.5): the KL shapes the samples' rewards, not the greedy baseline
    torch.testing.assert_close(advantages, torch.tensor([[0.55, 0.55, 0.0], [-0.55, 0.0, 0.0]]))


def test_reinforce_pp_clips_rewards_to_ten_before_whitening():
    rewards = torch.tensor([[20.0], [-3.0], [1.0]])  # B = 3 prompts, G = 1
    mask = torch.ones(3, 1)
    logp = torch.tensor([[-1.0], [-2.0], [-0.5]])
    advantages = ALGORITHMS["reinforce_pp"].advantages(rewards, mask=mask, logprobs=logp, ref_logprobs=logp)
    clipped = torch.tensor([10.0, -3.0, 1.0])  # one token each, no KL: the return is the clipped reward
    mean = 8.0 / 3
    std = math.sqrt(((10 - mean) ** 2 + (-3 - mean) ** 2 + (1 - mean) ** 2) / 2)
    torch.testing.assert_close(advantages, ((clipped - mean) / (std + 1e-6))[:, None])  # 1.1014, -0.8511, -0.2503
    unclipped = algorithm("reinforce_pp", reward_clip=None).advantages(rewards, mask=mask, logprobs=logp,
                                                                       ref_logprobs=logp)
    assert not torch.allclose(unclipped, advantages)


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_delegates_with_the_token_kl(name):
    rewards = torch.tensor([[1.0, 0.0], [0.5, 2.0]])
    mask = torch.cat([MASK, MASK])
    logp, ref = torch.cat([LOGP, LOGP + 0.3]), torch.cat([REF, REF])
    advantages = ALGORITHMS[name].advantages(rewards, mask=mask, logprobs=logp, ref_logprobs=ref)
    baseline = name == "reinforce_pp_baseline"
    expected = F.reinforce_pp_advantages(rewards.flatten(), logp, ref, mask, kl_coef=0.01, baseline=baseline,
                                         group_size=2 if baseline else None)
    torch.testing.assert_close(advantages, expected)


def test_gae_returns_are_advantages_plus_values_before_whitening():
    ppo = ALGORITHMS["ppo"]
    rewards = torch.tensor([[1.0], [0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    values = torch.tensor([[0.5, 0.25], [0.2, 9.0]])
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    advantages, returns = ppo.advantages_and_returns(rewards, mask=mask, logprobs=logp, ref_logprobs=logp,
                                                     values=values)
    # row 0: delta_1 = 1 - 0.25 = 0.75, delta_0 = 0 + 0.25 - 0.5 = -0.25, A_0 = -0.25 + 0.95 * 0.75 = 0.4625
    # row 1: delta_0 = 0 + 0 - 0.2 = -0.2 (V after the last token is 0)
    raw = torch.tensor([0.4625, 0.75, -0.2])
    torch.testing.assert_close(returns[mask.bool()], raw + torch.tensor([0.5, 0.25, 0.2]))  # A + V
    whitened = (raw - raw.mean()) / (raw.std() + 1e-6)
    torch.testing.assert_close(advantages[mask.bool()], whitened)
    assert advantages[1, 1] == 0


def test_gae_shapes_the_reward_with_k1():
    ppo, mask, values = ALGORITHMS["ppo"], MASK, torch.zeros(2, 3)
    rewards = torch.tensor([[1.0], [0.0]])
    _, returns = ppo.advantages_and_returns(rewards, mask=mask, logprobs=LOGP, ref_logprobs=REF, values=values)
    token_rewards = F.kl_shaped_rewards(rewards.flatten(), LOGP, REF, mask, kl_coef=0.01)
    torch.testing.assert_close(returns, F.gae(token_rewards, values, mask, gamma=1.0, lam=0.95)[1])
    with pytest.raises(ValueError, match="needs values"):
        ppo.advantages(rewards, mask=mask, logprobs=LOGP, ref_logprobs=REF)


def test_best_of_n_selects_the_best_completion_per_prompt():
    rewards = torch.tensor([[0.1, 0.9, 0.5], [0.2, 0.2, 0.0], [0.0, 0.0, 0.0]])
    # ties: the first; the third prompt's samples all tie (no right answer on a 0/1 reward): skipped
    torch.testing.assert_close(ALGORITHMS["best_of_n"].advantages(rewards),
                               torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    rewards = rewards[:2]
    strict = algorithm("best_of_n", min_reward=0.3)  # the second prompt's best (0.2) is below: skipped
    torch.testing.assert_close(strict.advantages(rewards), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


# --- losses -------------------------------------------------------------------------------


def _policy_batch():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 5, generator=g) * 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(4, 5, generator=g)
    ref = logp.detach() - 0.5 * torch.rand(4, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    advantages = torch.tensor([1.0, -0.5, 0.25, -2.0])
    return logp, old, ref, mask, advantages


@pytest.mark.parametrize("name", [n for n, row in ONLINE_TABLE.items() if row[6] == "policy"])
def test_policy_loss_is_f_policy_loss_with_the_table_pieces(name):
    logp, old, ref, mask, advantages = _policy_batch()
    row = dict(zip(ONLINE_COLUMNS, ONLINE_TABLE[name]))
    kl_in_loss = row["kl_placement"] == "loss"
    torch.manual_seed(0)  # Clip-Cov draws its tokens
    loss, metrics = ALGORITHMS[name].policy_loss(logp, old, advantages, mask, ref, normalizer=3, max_tokens=8)
    torch.manual_seed(0)
    expected, _ = F.policy_loss(
        logp, old, advantages, mask, ratio=row["ratio"], clip=row["clip"], eps_low=row["eps_low"],
        eps_high=row["eps_high"], aggregation=row["aggregation"], max_tokens=8, normalizer=3,
        ref_logprobs=ref if kl_in_loss else None, kl_coef=row["beta"] if kl_in_loss else 0.0, kl_estimator="k3",
        clip_options={k: v for k, v in ONLINE_EXTRAS.get(name, {}).items() if k in CLIP_OPTIONS.get(row["clip"], ())})
    torch.testing.assert_close(loss, expected)
    assert "clip_fraction" in metrics


def test_grpo_adds_the_k3_kl_and_dapo_does_not():
    logp, old, ref, mask, advantages = _policy_batch()
    grpo, _ = ALGORITHMS["grpo"].policy_loss(logp, old, advantages, mask, ref)
    without, _ = algorithm("grpo", beta=0.0).policy_loss(logp, old, advantages, mask, ref)
    kl = F.aggregate(F.kl_estimate(logp, ref, "k3"), mask, "sequence_mean")
    torch.testing.assert_close(grpo, without + 0.04 * kl)
    dapo, _ = ALGORITHMS["dapo"].policy_loss(logp, old, advantages, mask, ref)
    dapo_without_ref, _ = ALGORITHMS["dapo"].policy_loss(logp, old, advantages, mask)
    torch.testing.assert_close(dapo, dapo_without_ref)
    with pytest.raises(ValueError, match="KL in the loss needs ref_logprobs"):
        ALGORITHMS["grpo"].policy_loss(logp, old, advantages, mask)


def test_best_of_n_loss_is_the_nll_of_the_selected_completions():
    logp, old, _, mask, _ = _policy_batch()
    selection = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # rows 1 and 2 of the [4, 5] batch
    loss, _ = ALGORITHMS["best_of_n"].policy_loss(logp, old, selection.flatten(), mask)
    expected, _ = F.nll_loss(logp[1:3], mask[1:3], aggregation="token_mean")
    torch.testing.assert_close(loss, expected)
    # -(sum of the selected rows' valid log-probs) / their 3 + 2 tokens
    torch.testing.assert_close(loss, -(logp[1, :3].sum() + logp[2, :2].sum()) / 5)


def test_value_loss_is_ppo_only():
    values, old_values = torch.tensor([[0.5, 0.9]]), torch.tensor([[0.4, 0.3]])
    returns, mask = torch.tensor([[1.0, 0.0]]), torch.tensor([[1, 1]])
    loss, _ = ALGORITHMS["ppo"].value_loss(values, old_values, returns, mask)
    expected, _ = F.value_loss(values, old_values, returns, mask, clip=0.2, aggregation="sequence_mean")
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match="no value model"):
        ALGORITHMS["grpo"].value_loss(values, old_values, returns, mask)


PAIRS = dict(chosen_logps=torch.tensor([-10.0, -12.0, -7.0]), rejected_logps=torch.tensor([-11.0, -11.5, -9.0]),
             ref_chosen_logps=torch.tensor([-10.5, -12.0, -8.0]), ref_rejected_logps=torch.tensor([-10.8, -11.0, -8.5]),
             chosen_scores=torch.tensor([0.9, 0.7, 3.0]), rejected_scores=torch.tensor([0.1, 0.6, 1.0]),
             chosen_lengths=torch.tensor([5, 6, 4]), rejected_lengths=torch.tensor([6, 5, 5]))
UNPAIRED = dict(logps=torch.tensor([-10.0, -12.0, -7.0]), ref_logps=torch.tensor([-10.5, -11.0, -7.5]),
                desirable=torch.tensor([True, False, True]), kl_logps=torch.tensor([-11.0, -9.0, -13.0]),
                kl_ref_logps=torch.tensor([-10.0, -9.5, -12.0]))


@pytest.mark.parametrize("name, expected", [
    ("dpo", lambda x: F.dpo_loss(x["chosen_logps"], x["rejected_logps"], x["ref_chosen_logps"],
                                 x["ref_rejected_logps"], beta=0.1, label_smoothing=0.0)),
    ("odpo", lambda x: F.dpo_loss(x["chosen_logps"], x["rejected_logps"], x["ref_chosen_logps"],
                                  x["ref_rejected_logps"], beta=0.1,
                                  offset=F.odpo_offset(x["chosen_scores"], x["rejected_scores"], alpha=1.0))),
    ("simpo", lambda x: F.simpo_loss(x["chosen_logps"], x["rejected_logps"], x["chosen_lengths"],
                                     x["rejected_lengths"], beta=2.0, gamma=1.0)),
    ("orpo", lambda x: F.orpo_loss(x["chosen_logps"], x["rejected_logps"], x["chosen_lengths"],
                                   x["rejected_lengths"], lam=0.1)),
    ("kto", lambda x: F.kto_loss(x["logps"], x["ref_logps"], x["desirable"], x["kl_logps"], x["kl_ref_logps"],
                                 beta=0.1, desirable_weight=1.0, undesirable_weight=1.0)),
])
def test_preference_loss_is_the_f_call_with_the_preset_defaults(name, expected):
    inputs = UNPAIRED if name == "kto" else PAIRS
    loss, _ = ALGORITHMS[name].preference_loss(**inputs)  # unused inputs (lengths for DPO, ...) are ignored
    torch.testing.assert_close(loss, expected(inputs)[0])


def test_dpo_by_hand_and_preference_input_errors():
    x = PAIRS
    h = 0.1 * ((x["chosen_logps"] - x["ref_chosen_logps"]) - (x["rejected_logps"] - x["ref_rejected_logps"]))
    loss, _ = ALGORITHMS["dpo"].preference_loss(**x)
    torch.testing.assert_close(loss, -torch.nn.functional.logsigmoid(h).mean())  # h = 0.03, -0.05, 0.15
    with pytest.raises(ValueError, match="needs chosen_scores, rejected_scores"):
        ALGORITHMS["odpo"].preference_loss(**{k: v for k, v in x.items() if "scores" not in k})
    with pytest.raises(ValueError, match="unknown input.* chosen_logp\\b"):
        ALGORITHMS["dpo"].preference_loss(chosen_logp=x["chosen_logps"])


# --- lineage views ------------------------------------------------------------------------


def test_presets_table_lists_every_preset_with_its_paper():
    table = format_presets_table()
    lines = table.splitlines()
    for name, arxiv in ARXIV.items():
        assert any(line.startswith(name + " ") and arxiv in line for line in lines), name
    assert (table.index("Online") < table.index("\nppo ") < table.index("after the seed") < table.index("\nsapo ")
            < table.index("Preference") < table.index("\ndpo "))
    dapo = next(line for line in lines if line.startswith("dapo "))
    assert "0.2, 0.28" in dapo and "dynamic_sampling=True" in dapo and "token_mean" in dapo


def _marked(view: str) -> tuple[set[str], set[str]]:
    """(marked, unmarked) field names of a side-by-side view."""
    table = view.split("\n\n")[1].splitlines()[2:]
    marked = {line.split()[1] for line in table if line.startswith("*")}
    return marked, {line.split()[0] for line in table if not line.startswith("*")}


def test_side_by_side_marks_what_dapo_changed_in_grpo():
    view = format_side_by_side(["grpo", "dapo"])
    assert ALGORITHMS["grpo"].summary in view and ALGORITHMS["dapo"].summary in view
    marked, unmarked = _marked(view)
    assert marked == {"eps_high", "aggregation", "kl_placement", "kl_estimator", "beta", "binary_reward",
                      "dynamic_sampling", "overlong_buffer_ratio", "needs_reference", "needs_old_logprobs",
                      "mini_batches"}
    assert {"advantage", "ratio", "clip", "eps_low", "num_epochs", "eps"} <= unmarked
    eps_high = next(line for line in view.splitlines() if line.startswith("*") and line.split()[1] == "eps_high")
    assert eps_high.split()[2:] == ["0.2", "0.28"]


def test_side_by_side_shows_what_dr_grpo_removed():
    marked, _ = _marked(format_side_by_side(["grpo", "dr_grpo"]))
    assert marked == {"advantage", "aggregation", "kl_placement", "kl_estimator", "beta", "needs_reference",
                      "mini_batches", "needs_old_logprobs"}  # and its paper's 8 updates per rollout
    marked, _ = _marked(format_side_by_side(["dpo", "simpo", "orpo"]))
    assert marked == {"loss", "beta", "label_smoothing", "gamma", "lam", "needs_reference"}


def test_side_by_side_errors():
    with pytest.raises(ValueError, match=r"cannot compare presets of different kinds .*OnlineAlgorithm: grpo.*"
                                         r"PreferenceAlgorithm: dpo"):
        format_side_by_side(["grpo", "dpo"])
    with pytest.raises(ValueError, match="unknown algorithm 'gpro'. Did you mean .*'grpo'"):
        format_side_by_side(["gpro"])
    with pytest.raises(ValueError, match="at least one preset"):
        format_side_by_side([])


@pytest.mark.parametrize("name", ["dpo", "odpo", "simpo", "kto"])
def test_rpo_alpha_adds_the_chosen_nll_by_hand(name):
    """loss(rpo_alpha=0.5) = loss + 0.5 * mean(-pi_w / |y_w|); here -(-6)/3 = 2 and -(-2)/4 = 0.5 (KTO: the
    desirable example's 2 and the undesirable one's 0, over both examples: 1)."""
    base, with_nll = algorithm(name), algorithm(name, rpo_alpha=0.5)
    if base.paired:
        inputs = dict(chosen_logps=torch.tensor([-6.0, -2.0]), rejected_logps=torch.tensor([-7.0, -3.0]),
                      ref_chosen_logps=torch.tensor([-6.5, -2.5]), ref_rejected_logps=torch.tensor([-6.5, -2.5]),
                      chosen_scores=torch.tensor([1.0, 1.0]), rejected_scores=torch.tensor([-1.0, 0.0]),
                      chosen_lengths=torch.tensor([3, 4]), rejected_lengths=torch.tensor([3, 4]))
        nll = (2.0 + 0.5) / 2
    else:
        inputs = dict(logps=torch.tensor([-6.0, -2.0]), lengths=torch.tensor([3, 4]),
                      ref_logps=torch.tensor([-6.5, -2.5]), desirable=torch.tensor([True, False]),
                      kl_logps=torch.tensor([-5.0, -5.0]), kl_ref_logps=torch.tensor([-5.0, -5.0]))
        nll = (2.0 + 0.0) / 2
    loss, _ = base.preference_loss(**inputs)
    total, metrics = with_nll.preference_loss(**inputs)
    assert total.item() == pytest.approx(loss.item() + 0.5 * nll)
    assert metrics["nll"].item() == pytest.approx(nll)
    with pytest.raises(ValueError, match="rpo_alpha"):
        algorithm("orpo", rpo_alpha=0.5)


def test_a_presets_default_learning_rate_applies_only_where_none_is_given(monkeypatch):
    from posttrain.algorithms import presets as algorithms
    from posttrain.config import Config

    slower = dataclasses.replace(algorithms.ALGORITHMS["grpo"], default_learning_rate=3e-5)
    monkeypatch.setitem(algorithms.ALGORITHMS, "grpo", slower)
    assert Config.from_flat({"algorithm": "grpo"}).optim.learning_rate == 3e-5
    assert Config.from_flat({"algorithm": "grpo", "learning_rate": 1e-3}).optim.learning_rate == 1e-3  # given: wins
    assert Config.from_flat({"algorithm": "dapo"}).optim.learning_rate == 1e-4  # no default of its own
    saved = Config.from_flat({"algorithm": "grpo"}).to_flat()
    assert saved["learning_rate"] == 3e-5  # a saved run keeps the rate it trained with
    with pytest.raises(ValueError, match="default_learning_rate"):
        algorithm("grpo", default_learning_rate=1e-3)  # what the preset says, not a setting
