"""Process rewards: a reward function's step rewards, placed on the tokens where the steps end, taken as
token rewards by the presets with token-level returns and as DeepSeekMath's process supervision by GRPO and
Dr.GRPO. Hand-computed values on tiny tensors, then the whole path on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

import posttrain.functional as F
from posttrain.algorithms.presets import algorithm
from posttrain.config import Config
from posttrain.data.scoring import RewardError, StepRewards, score
from posttrain.data.tasks.addition import column_steps
from posttrain.training.groups import step_tensors, token_char_ends
from posttrain.training.online import train_step
from posttrain.training.session import OnlineSession

# Two completions of one prompt (G = 2), T = 4. Row 0 has steps ending at tokens 1 (reward 1) and 3 (reward 0);
# row 1 (3 tokens) one step ending at token 2 (reward 1).
STEP_REWARDS = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
STEP_ENDS = torch.tensor([[False, True, False, True], [False, False, True, False]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])


def test_process_advantages_against_hand_computed_values():
    # the group's step rewards R = (1, 0, 1): mean 2/3, unbiased std sqrt(((1/3)^2 + (2/3)^2 + (1/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    first, second, third = (1 / 3) / std, (-2 / 3) / std, (1 / 3) / std
    expected = torch.tensor([[first + second, first + second, second, second],  # steps ending at or after t
                             [third, third, third, 0.0]])
    advantages = F.process_advantages(STEP_REWARDS, STEP_ENDS, MASK, group_size=2, eps=0.0)
    torch.testing.assert_close(advantages, expected)
    centred = F.process_advantages(STEP_REWARDS, STEP_ENDS, MASK, group_size=2, scale=False)  # Dr.GRPO
    torch.testing.assert_close(centred, torch.tensor([[-1 / 3, -1 / 3, -2 / 3, -2 / 3], [1 / 3, 1 / 3, 1 / 3, 0.0]]))


def test_process_advantages_are_zero_for_a_group_of_equal_step_rewards_and_reject_bad_input():
    equal = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 0.5, 0.0]])
    assert (F.process_advantages(equal, STEP_ENDS, MASK, group_size=2) == 0).all()
    with pytest.raises(ValueError, match="at least 2 completions"):
        F.process_advantages(STEP_REWARDS, STEP_ENDS, MASK, group_size=1)
    with pytest.raises(ValueError, match="padding position"):
        F.process_advantages(STEP_REWARDS, torch.ones(2, 4, dtype=torch.bool), MASK, group_size=2)


def test_step_rewards_are_added_at_their_tokens_of_the_token_rewards():
    zeros = torch.zeros(2, 4)
    token_rewards = F.kl_shaped_rewards(torch.tensor([2.0, 3.0]), zeros, zeros, MASK, kl_coef=0.1,
                                        step_rewards=STEP_REWARDS)
    torch.testing.assert_close(token_rewards, torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 4.0, 0.0]]))


def test_reinforce_pp_returns_carry_the_steps_from_each_token_on():
    # unwhitened gamma=1 returns: row 0 (1, 1, 0, 0) + outcome 1 -> (2, 2, 1, 1); row 1 (1, 1, 1) + outcome 0
    preset = algorithm("reinforce_pp", beta=0.0, kl_placement="none", kl_estimator=None)
    advantages = preset.advantages(torch.tensor([[1.0, 0.0]]), mask=MASK, step_rewards=STEP_REWARDS,
                                   step_ends=STEP_ENDS.float())
    returns = torch.tensor([2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    whitened = (returns - returns.mean()) / (returns.std() + 1e-6)  # over the batch's valid tokens
    torch.testing.assert_close(advantages[MASK.bool()], whitened, rtol=1e-4, atol=1e-5)


def test_grpo_takes_the_outcome_as_the_last_step():
    # the outcomes (1, 0) join the step at each row's last token: row 0's token 3 (0 + 1), row 1's token 2 (1 + 0)
    rewards = torch.tensor([[1.0, 0.0]])
    got = algorithm("grpo").advantages(rewards, mask=MASK, step_rewards=STEP_REWARDS, step_ends=STEP_ENDS.float())
    steps = torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]])  # row 0's last token: 0 + outcome 1
    expected = F.process_advantages(steps, STEP_ENDS, MASK, group_size=2)
    torch.testing.assert_close(got, expected)
    # so the group's rewards are R = (1, 1, 1): no signal, all zero; with both outcomes 0, R = (1, 0, 1)
    assert (got == 0).all()
    got = algorithm("dr_grpo").advantages(torch.tensor([[0.0, 0.0]]), mask=MASK, step_rewards=STEP_REWARDS,
                                          step_ends=STEP_ENDS.float())
    torch.testing.assert_close(got, torch.tensor([[-1 / 3, -1 / 3, -2 / 3, -2 / 3], [1 / 3, 1 / 3, 1 / 3, 0.0]]))


def test_an_estimator_without_a_use_for_steps_refuses_them():
    with pytest.raises(ValueError, match="advantage='rloo' does not take; estimators that do: group, group_mean, gae, "
                                         "reinforce_pp, reinforce_pp_baseline"):
        algorithm("rloo").advantages(torch.tensor([[1.0, 0.0]]), mask=MASK, step_rewards=STEP_REWARDS,
                                     step_ends=STEP_ENDS.float())


class PieceTokenizer:
    """Decodes each id to a fixed piece; id 0 is special (decodes to nothing)."""

    pieces = {0: "", 1: "ab", 2: "c", 3: ",", 4: "def"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def test_steps_land_on_the_token_holding_their_last_character():
    ids = [1, 2, 3, 4, 0]  # "ab" "c" "," "def" <eos>: character ends 2, 3, 4, 7, 7
    assert token_char_ends(PieceTokenizer(), ids) == [2, 3, 4, 7, 7]
    mask = torch.tensor([[1, 1, 1, 1, 1]])
    rewards, ends = step_tensors(PieceTokenizer(), torch.tensor([ids]), mask, [[(3, 0.5), (5, 1.0), (7, 2.0)]])
    # "abc" ends in token 1; character 5 ("e") and 7 ("f") are both in token 3: their rewards add up
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.5, 0.0, 3.0, 0.0]]))
    torch.testing.assert_close(ends, torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0]]))
    # a step ending on a token the policy did not write (a tool's output) moves to the policy's token before it
    rewards, _ = step_tensors(PieceTokenizer(), torch.tensor([ids]), torch.tensor([[1, 1, 1, 0, 0]]), [[(7, 2.0)]])
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 2.0, 0.0, 0.0]]))


def test_scoring_keeps_steps_apart_from_the_outcome():
    def steps(prompts, completions, **columns):
        return [StepRewards(((2, 0.5), (4, 0.25)), final=1.0), 3.0]

    scores = score([steps], [2.0], ["p", "q"], ["abcd", "xyz"], {})
    assert scores.total.tolist() == [2.0, 6.0]  # the weighted final / number: the outcome
    assert scores.terms["steps"].tolist() == [1.75, 3.0]  # what the function gave, summed
    assert scores.steps == [[(2, 1.0), (4, 0.5)], []]  # weighted


@pytest.mark.parametrize("value, message", [
    (StepRewards(((5, 1.0),)), "step ending at character 5 of sample 0, whose completion has 4 characters"),
    (StepRewards(((2, 1.0), (2, 0.5))), "step ends \\[2, 2\\]; they must increase"),
    (StepRewards(((2, math.nan),)), "step 0 has reward nan"),
    (StepRewards((("2", 1.0),)), "step 0 is \\('2', 1.0\\); a step is \\(end character offset: int"),
])
def test_bad_step_rewards_are_named(value, message):
    with pytest.raises(RewardError, match=message):
        score([lambda prompts, completions: [value]], [1.0], ["p"], ["abcd"], {})


def test_the_addition_process_reward_rewards_each_right_column():
    reference = "7+5=12,4+8+1=13,0+3+1=4|432"  # 47 + 385
    got = column_steps(None, [reference, "7+5=12,4+8=12|42", "|5", "7+5=12,,0+3=3|312"], [reference] * 4)
    third = 1 / 3
    assert got[0] == StepRewards(((6, third), (15, third), (23, third)))
    assert got[1] == StepRewards(((6, third), (13, 0.0)))  # the carry is missing in the second column
    assert got[2] == StepRewards(())  # no column written
    assert got[3] == StepRewards(((6, third), (13, 0.0)))  # an empty column holds nothing; the third is wrong


@pytest.mark.parametrize("name", ["grpo", "reinforce_pp", "ppo"])
def test_a_step_with_a_process_reward_trains_on_token_advantages(name):
    # the warm-started built-in model: it writes scratchpads, some columns right and some wrong
    config = Config.from_flat(dict(algorithm=name, model="tiny-addition", task="addition-process",
                                   prompts_per_step=4, group_size=4, max_new_tokens=12, eval_size=8, max_steps=1,
                                   progress=False, report_to="none", seed=0))
    s = OnlineSession.create(config)
    metrics = train_step(s)
    g = s.last_groups
    assert g.step_rewards is not None and g.step_ends.sum() > 0
    assert g.step_ends[~g.completions.mask.bool()].sum() == 0  # steps end on the policy's tokens
    assert math.isfinite(metrics["loss"])
    advantages = s.alg.advantages(g.rewards, mask=g.completions.mask, logprobs=g.old_logprobs,
                                  ref_logprobs=g.old_logprobs, values=g.old_values,
                                  step_rewards=g.step_rewards, step_ends=g.step_ends)
    varies_in_a_row = ((advantages.max(1).values - advantages.min(1).values) > 1e-6).any()
    assert varies_in_a_row  # advantages are per token, not one per completion
