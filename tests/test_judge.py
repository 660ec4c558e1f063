"""LLM-as-judge: scripted judges with hand-computed scores, the cache, both-order pairwise verdicts, and the
judge wired into an online run (as a reward) and a preference run (as the labeller of the policy's pairs)."""

from __future__ import annotations

import pytest

from posttrain.config import Config, ConfigError
from posttrain.data.judge import PAIRWISE, POINTWISE, Judge, load_rubric


class Scripted:
    """A judge's replies by rule, counting the texts it is asked about."""

    def __init__(self, reply):
        self.reply, self.asked = reply, []

    def __call__(self, texts):
        self.asked += texts
        return [self.reply(t) for t in texts]


def answer_of(text: str) -> str:
    return text.split("Answer:\n")[1].split("\n")[0]


def test_pointwise_scores_map_the_scale_to_zero_one_and_unreadable_replies_to_none():
    replies = {"4": "Score: 10", "5": "7", "22": "I think 1.", "x": "no idea", "11": "11"}
    judge = Judge(complete=Scripted(lambda t: replies[answer_of(t)]))
    scores = judge(["2+2="] * 5, ["4", "5", "22", "x", "11"])
    assert scores == [1.0, pytest.approx(6 / 9), 0.0, None, None]  # (s - 1) / 9; 11 is off the scale
    assert judge.step_metrics() == {"judge/replies": 5, "judge/parse_failures": 2, "judge/cached": 0}


def test_replies_are_cached_per_prompt_and_completion():
    script = Scripted(lambda t: "5")
    judge = Judge(complete=script)
    judge(["a", "a", "b"], ["x", "x", "x"])  # ("a", "x") twice in one batch: asked once
    judge(["a", "b", "a"], ["x", "x", "y"])
    assert len(script.asked) == 3
    assert judge.step_metrics() == {"judge/replies": 3, "judge/parse_failures": 0, "judge/cached": 3}


def test_the_rubric_sees_the_prompt_messages_and_the_scale():
    script = Scripted(lambda t: "3")
    Judge(complete=script, scale=(0, 5))([[{"role": "user", "content": "What is 2+2?"}]],
                                         [[{"role": "assistant", "content": "4"}]])
    assert script.asked == [POINTWISE.format(prompt="What is 2+2?", completion="4", low=0, high=5)]


def test_pairwise_keeps_a_verdict_only_when_both_orders_agree():
    def fair(text):  # prefers the answer that says 4, wherever it is
        first = text.split("Answer A:\n")[1].split("\n")[0]
        return "A" if first == "4" else "B"

    judge = Judge(complete=Scripted(fair))
    assert judge.prefer(["2+2="] * 2, ["4", "5"], ["5", "4"]) == [0, 1]
    biased = Judge(complete=Scripted(lambda t: "Answer A"))  # always the first shown: no verdict survives
    assert biased.prefer(["2+2="] * 2, ["4", "5"], ["5", "4"]) == [None, None]
    assert biased.step_metrics()["judge/parse_failures"] == 0
    mute = Judge(complete=Scripted(lambda t: "hmm"))
    assert mute.prefer(["q"], ["a"], ["b"]) == [None] and mute.step_metrics()["judge/parse_failures"] == 2


def test_bad_rubrics_and_arguments_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"judge rubric: the template has no \{completion\}"):
        Judge(complete=Scripted(str), rubric="Rate {prompt}")
    with pytest.raises(ValueError, match="not both"):
        Judge()
    with pytest.raises(ValueError, match="lowest < highest"):
        Judge(complete=Scripted(str), scale=(5, 5))
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Q {prompt} A {completion} from {low} to {high}")
    assert load_rubric(str(rubric), "pointwise") == rubric.read_text()
    assert load_rubric("pairwise", "pairwise") == PAIRWISE
    with pytest.raises(ConfigError, match="judge_rubric: 'nope.txt' is neither"):
        Config.from_flat({"judge": "x", "judge_rubric": "nope.txt"})


def test_a_judge_model_scores_an_online_run(tiny_model_dir, reward_file):
    """A real (tiny, untrained) model as the judge: greedy replies, batched, counted in the step's metrics."""
    from posttrain.training.online import train_step
    from posttrain.training.session import OnlineSession
    from test_online import make_config

    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, judge=str(tiny_model_dir), max_steps=1))
    judges = [fn for fn in s.work.reward_fns if isinstance(fn, Judge)]
    assert len(judges) == 1 and len(s.work.reward_fns) == 2
    metrics = train_step(s)
    assert metrics["judge/replies"] + metrics["judge/cached"] == 16  # 4 prompts x 4 samples
    assert 0 <= metrics["judge/parse_failures"] <= metrics["judge/replies"]


def test_a_judge_labels_the_policy_s_pairs_in_a_preference_run(tiny_model_dir, monkeypatch):
    from posttrain.training import preference
    from posttrain.training.preference import PreferenceSession, sample_policy_pairs

    longer = Judge(complete=Scripted(lambda t: "A" if len(t.split("Answer A:\n")[1].split("\n")[0]) >
                                     len(t.split("Answer B:\n")[1].split("\n")[0]) else "B"))
    monkeypatch.setattr(preference, "make_judge", lambda config: longer)
    config = Config.from_flat(dict(algorithm="dpo", model=str(tiny_model_dir), task="addition", judge="scripted",
                                   prompts_per_step=4, group_size=4, max_new_tokens=12, pairs_per_step=2,
                                   eval_size=4, max_steps=1, progress=False, report_to="none", temperature=1.0))
    s = PreferenceSession.create(config)
    metrics = sample_policy_pairs(s)
    assert s.pair_rows and all(len(p["chosen"]) > len(p["rejected"]) for p in s.pair_rows)
    assert metrics["judge/replies"] >= 2 * len(s.pair_rows)  # each pair asked in both orders; ties dropped
    with pytest.raises(ConfigError, match="judge: a preference run uses the judge to label pairs"):
        PreferenceSession.create(Config.from_flat(dict(algorithm="dpo", model=str(tiny_model_dir), task="addition",
                                                       judge="x", pairs_from="dataset", progress=False)))


def test_judged_pairs_say_whether_the_chosen_is_the_right_one_per_pair():
    """The same text can be right for one prompt and wrong for another: labels go by sample, not by text."""
    from posttrain.training.policy_pairs import judged_pairs

    judge = Judge(complete=Scripted(lambda t: "A" if t.split("Answer A:\n")[1].startswith("4") else "B"))
    rows = [{"prompt": "2+2="}, {"prompt": "2+3="}]
    texts = ["4", "5", "4", "5"]  # "4" right for the first prompt, wrong for the second
    pairs, chosen_right = judged_pairs(judge, rows, texts, 2, [True, False, False, True])
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [("2+2=", "4", "5"), ("2+3=", "4", "5")]
    assert chosen_right == [True, False]

