"""The public registries: a user's estimator, policy loss, preference loss and preset, each added with
one call, work like the built-in ones from a preset, from Python and from the CLI (``--plugin``)."""

from __future__ import annotations

import textwrap

import pytest
import torch

import posttrain
import posttrain.functional as F
from posttrain.algorithms import registry
from posttrain.algorithms.presets import OnlineAlgorithm, PreferenceAlgorithm


@pytest.fixture
def clean_registries():
    """Every test adds to copies of the registries, which are restored afterwards."""
    saved = [dict(t) for t in (registry.ADVANTAGES, registry.POLICY_LOSSES, registry.PREFERENCE_LOSSES,
                               posttrain.ALGORITHMS)]
    yield
    for table, before in zip((registry.ADVANTAGES, registry.POLICY_LOSSES, registry.PREFERENCE_LOSSES,
                              posttrain.ALGORITHMS), saved):
        table.clear()
        table.update(before)


def test_the_built_in_pieces_are_registered_like_a_users():
    builtin = {name: e for name, e in registry.ADVANTAGES.items() if e.fn.__module__ == "posttrain.algorithms.pieces"}
    assert set(builtin) == {"gae", "greedy_baseline", "rloo", "group", "group_mean", "reinforce_pp",
                            "reinforce_pp_baseline", "best_of_n", "group_batch_std", "reverse_kl", "gdpo", "maxrl"}
    assert {"policy", "nll"} <= set(registry.POLICY_LOSSES)
    assert {"dpo", "odpo", "simpo", "orpo", "kto"} <= set(registry.PREFERENCE_LOSSES)
    assert registry.ADVANTAGES["gae"].level == "token" and registry.ADVANTAGES["gae"].needs_values
    assert registry.ADVANTAGES["greedy_baseline"].needs_baseline
    assert {n for n, e in builtin.items() if e.compares_group} == {
        "group", "group_mean", "group_batch_std", "rloo", "reinforce_pp_baseline", "gdpo", "maxrl"}
    assert not registry.PREFERENCE_LOSSES["kto"].paired and registry.PREFERENCE_LOSSES["dpo"].needs_reference
    assert not registry.PREFERENCE_LOSSES["simpo"].needs_reference


def test_a_registered_sequence_estimator_gives_the_presets_advantages(clean_registries):
    @posttrain.register_advantage("median_baseline", compares_group=True)
    def median_baseline(rewards, preset, **inputs):
        """Reward minus the group's (lower) median."""
        return rewards - rewards.median(dim=1, keepdim=True).values

    preset = posttrain.algorithm("grpo", advantage="median_baseline")
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 5.0]])  # medians 0 and 2
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 8)
    advantages = preset.advantages(rewards, mask=mask)
    expected = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, -1.0, 0.0, 3.0])
    assert torch.equal(advantages, expected[:, None] * mask)
    assert preset.is_group_estimator and not preset.needs_value_model


def test_a_registered_token_estimator_gets_the_token_inputs_and_the_kl(clean_registries):
    seen = {}

    @posttrain.register_advantage("last_token", level="token")
    def last_token(rewards, preset, *, mask, logprobs, ref_logprobs, kl_coef, **_):
        """The reward on each completion's last token, minus kl_coef * (logp - ref) everywhere."""
        seen.update(kl_coef=kl_coef)
        last = mask.cumsum(-1) == mask.sum(-1, keepdim=True)
        return (rewards.flatten()[:, None] * (last & mask.bool()) - kl_coef * (logprobs - ref_logprobs)) * mask

    preset = posttrain.algorithm("reinforce_pp", advantage="last_token")  # KL in the token reward, beta 0.01
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, 0.0, 0.0]])
    advantages = preset.advantages(torch.tensor([[2.0, 4.0]]), mask=mask, logprobs=logprobs, ref_logprobs=ref)
    assert seen["kl_coef"] == 0.01
    assert torch.allclose(advantages, torch.tensor([[-0.005, 2.01, 0.0], [4.0, 0.0, 0.0]]))


def test_a_registered_policy_loss_is_what_the_preset_computes(clean_registries):
    @posttrain.register_policy_loss("plain_pg")
    def plain_pg(logprobs, old_logprobs, advantages, mask, preset, *, ref_logprobs, normalizer, max_tokens):
        """-A * log p per token, token mean: the unclipped REINFORCE surrogate."""
        loss = F.aggregate(-advantages * logprobs, mask, "token_mean", normalizer=normalizer)
        return loss, {"tokens": mask.sum().detach()}

    preset = posttrain.algorithm("dr_grpo", loss="plain_pg")  # no KL: plain_pg adds none
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    advantages = torch.tensor([[1.0, 1.0], [-2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = preset.policy_loss(logprobs, logprobs.detach(), advantages, mask)
    assert loss.item() == pytest.approx((1.0 + 2.0 - 1.0) / 3)  # (-1*-1 + -1*-2 + 2*-0.5) / 3 tokens
    assert metrics["tokens"].item() == 3


def test_a_policy_loss_that_takes_no_kl_refuses_a_kl_in_the_loss(clean_registries):
    posttrain.register_policy_loss("no_kl")(lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match="loss='no_kl' does not add a KL term"):
        posttrain.algorithm("grpo", loss="no_kl", kl_placement="loss", kl_estimator="k3", beta=0.04)


def test_a_registered_preference_loss_with_its_coefficients(clean_registries):
    @posttrain.register_preference_loss("margin_hinge", inputs=("chosen_logps", "rejected_logps"),
                                        coefficients=("gamma",))
    def margin_hinge(preset, *, chosen_logps, rejected_logps):
        """max(0, gamma - (chosen - rejected)), mean over pairs."""
        return (preset.gamma - (chosen_logps - rejected_logps)).clamp(min=0).mean(), {}

    preset = PreferenceAlgorithm(name="hinge", paper="-", summary="-", loss="margin_hinge", gamma=1.0)
    assert preset.paired and not preset.needs_reference and not preset.needs_scores
    loss, _ = preset.preference_loss(chosen_logps=torch.tensor([-1.0, -3.0]), rejected_logps=torch.tensor([-4.0, -2.5]),
                                     chosen_lengths=torch.tensor([2.0, 2.0]))  # inputs it does not take: ignored
    assert loss.item() == pytest.approx((0.0 + 1.5) / 2)
    with pytest.raises(ValueError, match="beta is not used by loss='margin_hinge'"):
        PreferenceAlgorithm(name="hinge", paper="-", summary="-", loss="margin_hinge", gamma=1.0, beta=0.1)
    with pytest.raises(ValueError, match="loss='margin_hinge' needs gamma"):
        PreferenceAlgorithm(name="hinge", paper="-", summary="-", loss="margin_hinge")


def test_a_registered_preset_is_found_by_name(clean_registries):
    preset = OnlineAlgorithm(name="grpo_median", paper="-", summary="GRPO with RLOO's baseline", advantage="rloo")
    posttrain.register_algorithm(preset)
    assert posttrain.algorithm("grpo_median") == preset
    with pytest.raises(ValueError, match="'grpo_median' is already registered"):
        posttrain.register_algorithm(OnlineAlgorithm(name="grpo_median", paper="-", summary="-", advantage="group"))


def test_registering_a_taken_name_is_an_error_unless_replaced(clean_registries):
    def other(rewards, preset, **_):
        return rewards

    with pytest.raises(ValueError, match="advantage estimator 'rloo' is already registered"):
        posttrain.register_advantage("rloo")(other)
    posttrain.register_advantage("rloo", replace=True)(other)
    assert registry.ADVANTAGES["rloo"].fn is other
    with pytest.raises(ValueError, match="must be an identifier"):
        posttrain.register_advantage("my estimator")
    with pytest.raises(ValueError, match="unknown input.*chosen_logp\\b"):
        posttrain.register_preference_loss("typo", inputs=("chosen_logp",))


def test_an_unknown_piece_names_the_registered_ones():
    with pytest.raises(ValueError, match="advantage='median'.*group_mean"):
        posttrain.algorithm("grpo", advantage="median")


def test_an_estimator_of_the_wrong_shape_is_named(clean_registries):
    posttrain.register_advantage("flat")(lambda rewards, preset, **_: rewards.flatten())
    with pytest.raises(ValueError, match="'flat' \\(level='sequence'\\) returned shape \\(4,\\); it must return "
                                         "\\[B, G\\] = \\(2, 2\\)"):
        posttrain.algorithm("grpo", advantage="flat").advantages(torch.ones(2, 2))


PLUGIN = textwrap.dedent('''
    import posttrain

    CALLS = []  # the rewards of each call (the test reads them)

    @posttrain.register_advantage("sign_of_centered", compares_group=True)
    def sign_of_centered(rewards, preset, **inputs):
        """+1 above the group's mean reward, -1 below, 0 at it."""
        CALLS.append(rewards.clone())
        return (rewards - rewards.mean(dim=1, keepdim=True)).sign()
''')


def test_the_cli_trains_with_a_plugins_estimator(tmp_path, tiny_model_dir, reward_file, clean_registries):
    """``posttrain train --plugin FILE.py --advantage NAME``: the file is imported before the config is
    built, and the run's config.yaml records it, so a resume imports it too."""
    from posttrain.cli import main
    from posttrain.config import load_yaml

    plugin = tmp_path / "my_pieces.py"
    plugin.write_text(PLUGIN)
    run = tmp_path / "run"
    args = ["train", "--plugin", str(plugin), "--advantage", "sign_of_centered", "--model", str(tiny_model_dir),
            "--reward", f"{reward_file}:sevens", "--max-steps", "2", "--prompts-per-step", "2", "--group-size", "4",
            "--max-new-tokens", "6", "--eval-size", "4", "--output", str(run), "--report-to", "none", "--no-progress"]
    assert main(args) == 0
    assert load_yaml(run / "config.yaml")["plugin"] == [str(plugin)]
    assert registry.ADVANTAGES["sign_of_centered"].compares_group
    # the steps' advantages came from the plugin: once per step, on its 2 prompts x 4 samples
    calls = registry.ADVANTAGES["sign_of_centered"].fn.__globals__["CALLS"]
    assert [tuple(rewards.shape) for rewards in calls] == [(2, 4), (2, 4)]


def test_an_unknown_piece_without_its_plugin_says_how_to_add_it(tmp_path, capsys):
    from posttrain.cli import main

    assert main(["train", "--advantage", "sign_of_centered", "--max-steps", "1"]) == 2
    assert "--plugin FILE.py" in capsys.readouterr().err
