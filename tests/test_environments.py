"""Episodes played in an environment: a scripted policy, so every token of the transcript is known.

Each policy turn that ends with EOS goes to the environment; its observation is inserted (marked
``inserted``) before the next turn, its rewards add up to the episode's, and ``done`` or ``max_turns``
ends the episode. GEM's Guess the Number is played through the adapter the same way.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_episodes import Script

from posttrain.data.environments import Step
from posttrain.models.tiny import char_tokenizer
from posttrain.rollout.episodes import (
    ENVIRONMENT_FAULT_REWARD,
    EnvironmentFault,
    EpisodeGenerator,
    user_turn,
)

TOKENIZER = char_tokenizer("".join(chr(c) for c in range(32, 127)) + "\n")
EOS, PAD = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id
E = TOKENIZER.eos_token


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class SayTheNumber:
    """The policy must write the row's number; a wrong one costs 0.25 and is answered ``no, N``."""

    def reset(self, row):
        self.target = str(row["target"])

    def step(self, turn):
        if turn == self.target:
            return Step("ok", 1.0, done=True)
        return Step(f"no, {self.target}", -0.25)


def play(turns, environment=SayTheNumber, *, rows=({"prompt": "say 7:", "target": 7},), max_turns=4,
         max_new_tokens=40, num_samples=2, on_error="feedback", tokenizer=TOKENIZER):
    script = Script(turns, num_samples)
    episodes = EpisodeGenerator(script.make([]), tokenizer, environment=environment, on_error=on_error,
                                render=user_turn(tokenizer, E), max_new_tokens=max_new_tokens,
                                max_turns=max_turns, eos_ids=[EOS], pad_id=PAD)
    prompts = [torch.tensor(ids(row["prompt"])) for row in rows]
    return episodes.generate(prompts, num_samples=num_samples, rows=list(rows)), episodes, script, prompts


def test_an_episode_is_the_policys_turns_and_the_environments_observations_token_for_token():
    comp, episodes, script, prompts = play({0: ["5" + E, "7" + E], 1: ["7" + E]})
    row0 = ids("5") + [EOS] + ids("no, 7") + ids("7") + [EOS]
    policy0 = [1.0, 1.0] + [0.0] * 5 + [1.0, 1.0]
    assert comp.completion_ids[0, : len(row0)].tolist() == row0
    assert comp.mask[0, : len(row0)].tolist() == policy0
    assert comp.inserted[0, : len(row0)].tolist() == [m == 0.0 for m in policy0]
    assert comp.completion_ids[1, :2].tolist() == ids("7") + [EOS] and comp.mask[1].sum() == 2
    # the second turn read the prompt, the first turn with its EOS and the observation, exactly
    assert script.calls[1][1] == [prompts[0].tolist() + ids("5") + [EOS] + ids("no, 7")]
    assert comp.rewards.tolist() == [0.75, 1.0] and not comp.truncated.any()
    assert episodes.stats.turns == [2, 1] and episodes.stats.inserted_tokens == 5
    assert episodes.stats.tool_calls == 0 and episodes.stats.environment_errors == 0


def test_max_turns_ends_an_episode_the_environment_has_not_ended_and_its_last_turn_still_counts():
    comp, episodes, _, _ = play({0: ["1" + E, "2" + E], 1: ["3" + E, "4" + E]}, max_turns=2)
    assert episodes.stats.turns == [2, 2] and comp.rewards.tolist() == [-0.5, -0.5]
    assert comp.inserted.sum() == 2 * 5  # one observation each: none after the last turn


def test_the_token_budget_truncates_an_episode_mid_turn_without_stepping_the_environment():
    comp, _, _, _ = play({0: ["5" + E, "777777"], 1: ["7" + E]}, max_new_tokens=10)
    assert comp.truncated.tolist() == [True, False] and comp.mask[0].sum() == 2 + 3
    assert comp.rewards.tolist() == [-0.25, 1.0]


def test_observations_are_rendered_as_the_chat_templates_next_user_turn():
    chat = char_tokenizer("".join(chr(c) for c in range(32, 127)) + "\n")
    chat.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}" + E + "\n{% endfor %}"
                          "{% if add_generation_prompt %}[assistant]{% endif %}")
    render = user_turn(chat, E)
    assert render("no, 7") == "\n[user]no, 7" + E + "\n[assistant]"
    comp, _, _, _ = play({0: ["5" + E, "7" + E], 1: ["7" + E]}, tokenizer=chat)
    assert chat.decode(comp.completion_ids[0][comp.mask[0] + comp.inserted[0] > 0]) == (
        "5" + E + "\n[user]no, 7" + E + "\n[assistant]7" + E)
    assert TOKENIZER.decode(comp.completion_ids[0], skip_special_tokens=True).startswith("5\n[user]no, 7\n")
    assert user_turn(TOKENIZER, E)("as is") == "as is"  # no template: the observation's own text


class Raises(SayTheNumber):
    def step(self, turn):
        raise ZeroDivisionError("division by zero")


class ResetRaises(SayTheNumber):
    def reset(self, row):
        raise KeyError("target")


class NotAStep(SayTheNumber):
    def step(self, turn):
        return ("ok", 1.0, True)


@pytest.mark.parametrize("environment, turns, message, tokens", [
    (Raises, {0: ["5" + E], 1: ["7" + E]}, ("the environment's step at turn 1 of the row with prompt 'say 7:' "
                                            "raised ZeroDivisionError('division by zero')"), [2, 2]),
    (ResetRaises, {0: [], 1: []}, "resetting the environment for the row with prompt 'say 7:' raised KeyError('target')",
     [0, 0]),
    (NotAStep, {0: ["5" + E], 1: ["7" + E]},
     "raised TypeError('step returned tuple, not posttrain.data.environments.Step')", [2, 2]),
])
def test_an_environment_that_fails_ends_its_episode_with_a_counted_penalty_or_stops_the_run(
        environment, turns, message, tokens):
    comp, episodes, _, _ = play(turns, environment)
    assert comp.rewards.tolist() == [ENVIRONMENT_FAULT_REWARD] * 2 and episodes.stats.environment_errors == 2
    assert comp.mask.sum(-1).tolist() == tokens and not comp.inserted.any()
    assert episodes.stats.metrics()["episode/environment_errors"] == 1.0
    with pytest.raises(EnvironmentFault) as error:
        play(turns, environment, on_error="raise")
    assert message in str(error.value)


def test_an_environment_needs_the_rows_its_episodes_start_from():
    episodes = EpisodeGenerator(Script({}, 1).make([]), TOKENIZER, environment=SayTheNumber, max_new_tokens=4,
                                max_turns=2, eos_ids=[EOS], pad_id=PAD)
    with pytest.raises(ValueError, match="pass one row per prompt"):
        episodes.generate([torch.tensor(ids("say 7:"))], num_samples=1)


needs_gem = pytest.mark.skipif(importlib.util.find_spec("gem") is None, reason="needs gem-llm (the gem extra)")


@needs_gem
def test_gem_guess_the_number_played_through_the_adapter_transcript_reward_and_verdict():
    from posttrain.data.tasks import get_task

    task = get_task("gem:game:GuessTheNumber-v0-easy")
    row = {**task.train[3], "prompt": "guess:"}  # seed 3: the secret is 4
    assert task.train[3]["seed"] == 3 and "guess the number between 1 and 10" in task.train[3]["prompt"][0]["content"]
    comp, episodes, _, _ = play({0: ["\\boxed{5}" + E, "\\boxed{4}" + E], 1: ["\\boxed{9}" + E, "7" + E]},
                                task.environment, rows=(row,), max_new_tokens=200)
    hint = "At turn 1, you guessed 5, and the target number is lower than 5.\nEnter your next guess."
    assert TOKENIZER.decode(comp.completion_ids[0], skip_special_tokens=True) == "\\boxed{5}" + hint + "\\boxed{4}"
    # row 1 guessed 9 (lower), then wrote no \boxed{}: GEM ends the game with its format penalty
    assert comp.rewards.tolist() == pytest.approx([1.0, -0.1]) and episodes.stats.turns == [2, 2]
    assert task.correct([], [], environment_reward=comp.rewards.tolist()) == [True, False]


@needs_gem
def test_gem_tasks_replay_their_seeds_and_hold_out_others():
    from posttrain.data.tasks import get_task

    task = get_task("gem:game:GuessTheNumber-v0-easy")
    assert {r["seed"] for r in task.train}.isdisjoint(r["seed"] for r in task.test)
    assert get_task("gem:game:GuessTheNumber-v0-easy").test[:5] == task.test[:5]
    with pytest.raises(ValueError, match="GEM has no environment 'game:Chess-v0'; its games: .*game:Wordle-v0-easy"):
        get_task("gem:game:Chess-v0")


ENVIRONMENT_FILE = '''
from posttrain.data.environments import Step


class SayTheNumber:
    def reset(self, row):
        self.target = str(row["answer"])

    def step(self, turn):
        return Step("ok", 1.0, done=True) if turn.strip() == self.target else Step("no, " + self.target, -0.25)
'''


def test_posttrain_train_with_an_environment_file_plays_episodes_and_adds_their_reward(tmp_path, printable_model_dir):
    """The real decode loop plays episodes against an environment named as FILE.py:CLASS; config.yaml
    records it; the step's reward is the environment's plus the reward functions'."""
    import posttrain
    from posttrain.config import load_yaml
    from posttrain.tracking.metrics import read_metrics

    env_file = tmp_path / "env.py"
    env_file.write_text(ENVIRONMENT_FILE)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    result = posttrain.train(model=str(printable_model_dir), train_dataset=rows, environment=f"{env_file}:SayTheNumber",
                             reward_funcs=lambda prompts, completions, environment_reward, **_: [
                                 10.0 + r for r in environment_reward],
                             max_steps=2, prompts_per_step=2, group_size=4, max_new_tokens=24, max_turns=2,
                             eval_size=0, report_to="none", progress=False, output=str(tmp_path / "run"), seed=1)
    assert load_yaml(result["run_dir"] / "config.yaml")["environment"] == f"{env_file}:SayTheNumber"
    steps = [row for row in read_metrics(result["run_dir"]) if "loss" in row]
    assert len(steps) == 2 and all(1.0 <= row["episode/turns"] <= 2.0 for row in steps)
    for row in steps:  # reward = environment_reward + (10 + environment_reward)
        assert row["reward/mean"] == pytest.approx(10.0 + 2 * row["reward/environment_reward"])
