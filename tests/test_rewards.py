"""Built-in rewards on exact strings; the reward model against a manual forward; loading user files; rewards
by name, with settings, and registered by a user."""

import json
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from posttrain.config import Config, ConfigError, is_reward_name
from posttrain.data import rewards
from posttrain.data.rewards import (
    REWARDS,
    RewardModel,
    exact_match,
    extract_answer,
    format_reward,
    length_penalty,
    load_reward,
    load_reward_function,
    numeric_match,
    register_reward,
)
from posttrain.models.tiny import char_tokenizer


@pytest.mark.parametrize(
    "text, delimiter, expected",
    [
        ("7+5=12|12", "|", "12"),
        ("a|b| 34 ", "|", "34"),  # last delimiter, stripped
        ("no delimiter, the answer is 5.", "|", "5"),  # falls back when the delimiter is absent
        ("so $\\boxed{\\frac{1}{2}}$ done", None, "\\frac{1}{2}"),  # nested braces
        ("\\boxed{1} then \\boxed{2}", None, "2"),
        ("The answer is Paris.\nMore", None, "Paris"),
        ("The answer is 3.5", None, "3.5"),
        ("I had 3 apples and 1,250 pears", None, "1,250"),
        ("-4 degrees", None, "-4"),
        ("no digits here", None, None),
        ("\\boxed{unclosed", None, None),
    ],
)
def test_extract_answer(text, delimiter, expected):
    assert extract_answer(text, delimiter) == expected


def test_exact_match_strings_chat_and_none():
    fn = exact_match(delimiter="####")
    assert fn.__name__ == "exact_match"
    completions = ["work #### 42", "work #### 41", "no answer", [{"role": "assistant", "content": "#### 7"}], "#### 1"]
    answers = ["42", "42", "42", " 7 ", None]
    assert fn([""] * 5, completions, answer=answers) == [1.0, 0.0, 0.0, 1.0, None]


def test_exact_match_needs_answer_column():
    with pytest.raises(ValueError, match="needs an 'answer' column"):
        exact_match()(["p"], ["c"])


def test_numeric_match_tolerance():
    fn = numeric_match()
    assert fn.__name__ == "numeric_match"
    completions = ["it is 1,234", "\\boxed{0.30000000000000004}", "answer is $5", "answer is 5.001", "no idea", "7"]
    answers = ["1234", "0.3", 5, "5", "5", "not a number"]
    # 0.1+0.2 is within rel_tol 1e-6 of 0.3; 5.001 is not within 1e-6 of 5; an unparseable gold is not applicable
    assert fn([""] * 6, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0, None]
    assert numeric_match(rel_tol=1e-3)([""], ["answer is 5.001"], answer=["5"]) == [1.0]


def test_format_reward_fullmatch():
    fn = format_reward(r"<think>.*</think>\d+", name="think_format")
    assert fn.__name__ == "think_format"
    assert fn([""] * 3, ["<think>x</think>12", "<think>x</think>12!", "12"]) == [1.0, 0.0, 0.0]


def test_length_penalty_by_hand():
    fn = length_penalty(max_chars=10, scale=0.5)
    # 10 chars: 0; 15 chars: -0.5 * 5/10 = -0.25; 30 chars: capped at -0.5
    assert fn([""] * 3, ["a" * 10, "a" * 15, "a" * 30]) == [0.0, -0.25, -0.5]
    with pytest.raises(ValueError):
        length_penalty(max_chars=0)


@pytest.fixture
def tiny_reward_model():
    tokenizer = char_tokenizer("abcdefgh ")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return LlamaForSequenceClassification(config).eval(), tokenizer


def _manual_score(model, tokenizer, text):
    ids = tokenizer(text, return_tensors="pt")["input_ids"]  # one unpadded sequence
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        return model.score(hidden[0, -1]).item()


def test_reward_model_equals_manual_forward(tiny_reward_model, tmp_path):
    model, tokenizer = tiny_reward_model
    prompts = ["abc", "a", "hhh ga"]
    completions = [" dd", "bcdefgh", [{"role": "assistant", "content": "e"}]]
    expected = [_manual_score(model, tokenizer, text) for text in ["abc dd", "abcdefgh", "hhh gae"]]
    scorer = RewardModel(model, tokenizer, batch_size=2)  # batches of unequal lengths get padded
    assert scorer.__name__ == "reward_model"
    assert scorer(prompts, completions) == pytest.approx(expected, abs=1e-5)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert RewardModel(tmp_path, batch_size=3)(prompts, completions) == pytest.approx(expected, abs=1e-5)


def test_reward_model_rejects_several_labels(tiny_reward_model):
    model, tokenizer = tiny_reward_model
    model.config.num_labels = 2
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModel(model, tokenizer)


def test_load_reward_function(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("LIMIT = 3\n\ndef short(prompts, completions, **kw):\n"
                    "    return [float(len(c) <= LIMIT) for c in completions]\n")
    fn = load_reward_function(f"{path}:short")
    assert fn(["p", "p"], ["abc", "abcd"]) == [1.0, 0.0]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward_function(f"{tmp_path / 'missing.py'}:short")
    with pytest.raises(AttributeError, match="defines no 'long'; functions defined there: short"):
        load_reward_function(f"{path}:long")
    with pytest.raises(TypeError, match="not a callable"):
        load_reward_function(f"{path}:LIMIT")
    with pytest.raises(ValueError, match="file.py:func_name"):
        load_reward_function(str(path))


def test_every_built_in_is_named_and_a_bare_name_uses_the_defaults():
    assert sorted(REWARDS) == ["code_tests", "exact_match", "format_reward", "length_penalty", "math_answer", "numeric_match"]
    # the last completion's final answer is its last number, 3 (no box, no "answer is")
    completions = ["the answer is 5.001", "\\boxed{5}", "<think>2 + 3\nis</think>\n<answer>five</answer> 3"]
    answers = ["5"] * 3
    for name in ("exact_match", "numeric_match", "math_answer"):
        assert load_reward(name)([""] * 3, completions, answer=answers) == [0.0, 1.0, 0.0], name
    # the R1 format by default: reasoning in <think>, then the answer in <answer>, the parts spanning lines
    assert load_reward("format_reward")([""] * 3, completions[:2] + [completions[2][:-2]]) == [0.0, 0.0, 1.0]
    assert load_reward("format_reward").__name__ == "format"


def test_settings_in_parentheses_reach_the_factory():
    # rel_tol 1e-3: |5.001 - 5| = 1e-3 <= 1e-3 * 5.001; the default 1e-6 refuses it (above)
    loose = load_reward("numeric_match(rel_tol=1e-3)")
    assert loose([""], ["the answer is 5.001"], answer=["5"]) == [1.0]
    # 10 chars: 0; 15: -0.5 * 5/10 = -0.25; 30: capped at -0.5 (as length_penalty(10, 0.5) above)
    penalty = load_reward(" length_penalty( max_chars=10, scale=0.5 ) ")
    assert penalty([""] * 3, ["a" * 10, "a" * 15, "a" * 30]) == [0.0, -0.25, -0.5]
    # a quoted value keeps its commas and colons: the pattern is one setting, not a file spec
    pattern = load_reward("format_reward(pattern='a:b,c', name='colon')")
    assert (pattern.__name__, pattern([""] * 2, ["a:b,c", "a:b"])) == ("colon", [1.0, 0.0])


@pytest.mark.parametrize("spec, message", [
    ("numeric_mach", "unknown reward 'numeric_mach' (did you mean numeric_match?); the rewards by name are "
                     "code_tests, exact_match, format_reward, length_penalty, math_answer, numeric_match"),
    ("length_penalty", "length_penalty needs max_chars (no default): give --reward 'length_penalty(max_chars=VALUE)'"),
    ("exact_match(delim='|')", "exact_match has no setting 'delim'; its settings: delimiter"),
    ("length_penalty(max_chars='many')", "setting max_chars='many' of length_penalty must be of type int"),
    ("numeric_match(rel_tol=True)", "setting rel_tol=True of numeric_match must be of type float or int"),
    ("length_penalty(max_chars=0)", "length_penalty(max_chars=0): length_penalty needs max_chars > 0, got 0"),
    ("length_penalty(max_chars)", "setting 'max_chars' of reward 'length_penalty' is not NAME=VALUE"),
])
def test_a_bad_name_or_setting_is_named(spec, message):
    with pytest.raises(ConfigError, match="^" + re.escape("reward: " + message)):
        load_reward(spec)


@pytest.mark.parametrize("spec, named", [
    ("numeric_match", True), ("length_penalty(max_chars=4)", True), ("format_reward(pattern='a:b')", True),
    ("rewards.py:fn", False), ("/abs/dir/rewards.py:fn", False), ("dir/rewards:fn", False),
])
def test_a_name_is_told_from_a_file_spec(spec, named):
    assert is_reward_name(spec) is named


def test_a_file_spec_still_loads_through_load_reward(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("def short(prompts, completions, **kw):\n    return [float(len(c) <= 3) for c in completions]\n")
    assert load_reward(f"{path}:short")(["p", "p"], ["abc", "abcd"]) == [1.0, 0.0]


def test_a_user_registers_a_reward_by_name(monkeypatch):
    monkeypatch.setattr(rewards, "REWARDS", dict(REWARDS))  # the registration stays in this test

    @register_reward("brevity")
    def brevity(max_words: int = 2):
        def brevity(prompts, completions, **columns):
            return [float(len(c.split()) <= max_words) for c in completions]
        return brevity

    assert load_reward("brevity")([""] * 2, ["one two", "one two three"]) == [1.0, 0.0]
    assert load_reward("brevity(max_words=3)")([""] * 2, ["one two", "one two three"]) == [1.0, 1.0]
    register_reward("brevity")(brevity)  # the same function again (its module imported twice): accepted
    with pytest.raises(ValueError, match="reward 'brevity' is already registered .*pass replace=True"):
        register_reward("brevity")(lambda: None)
    register_reward("brevity", replace=True)(numeric_match)
    assert rewards.REWARDS["brevity"] is numeric_match
    with pytest.raises(ValueError, match="must be an identifier"):
        register_reward("my-reward")


def test_a_config_keeps_names_as_they_are_and_files_absolute(tmp_path, monkeypatch, reward_file):
    monkeypatch.chdir(reward_file.parent)
    config = Config.from_flat({"reward": ["numeric_match", "length_penalty(max_chars=50)", "rewards.py:sevens"]})
    # a name is no path: it must not become one under the working directory
    assert config.with_absolute_paths().data.reward == (
        "numeric_match", "length_penalty(max_chars=50)", f"{reward_file.resolve()}:sevens")
    with pytest.raises(ConfigError, match="reward: file 'missing.py' of 'missing.py:f' does not exist"):
        Config.from_flat({"reward": ["missing.py:f"]})


BREVITY_PLUGIN = '''import posttrain


@posttrain.register_reward("brevity")
def brevity(max_chars: int = 3):
    def brevity(prompts, completions, **columns):
        return [float(len(c) <= max_chars) for c in completions]
    return brevity
'''


def test_the_cli_trains_on_rewards_named_built_in_and_registered_by_a_plugin(tmp_path, tiny_model_dir, monkeypatch):
    from posttrain.cli import main
    from posttrain.config import load_yaml

    monkeypatch.setattr(rewards, "REWARDS", dict(REWARDS))  # the plugin's registration stays in this test
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]))
    plugin = tmp_path / "brevity.py"
    plugin.write_text(BREVITY_PLUGIN)
    code = main(["train", "--model", str(tiny_model_dir), "--dataset", str(rows), "--reward", "numeric_match",
                 "--reward", "length_penalty(max_chars=2)", "--plugin", str(plugin), "--reward", "brevity(max_chars=4)",
                 "--max-steps", "1", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6",
                 "--report-to", "none", "--no-progress", "--log-samples-every", "1", "--output", str(tmp_path / "run")])
    assert code == 0
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8
    for sample in samples:  # each reward's value by hand, from the completion's text
        n = len(sample["completion"])
        assert sample["reward/length_penalty"] == -min(1.0, max(0, n - 2) / 2)
        assert sample["reward/brevity"] == float(n <= 4)
        assert sample["reward"] == pytest.approx(sample["reward/numeric_match"] + sample["reward/length_penalty"]
                                                 + sample["reward/brevity"])
    assert {s["reward/brevity"] for s in samples} == {0.0, 1.0}  # the check above saw both outcomes
    # the saved config names them as given, so the run resumes with the same rewards
    assert load_yaml(tmp_path / "run" / "config.yaml")["reward"] == [
        "numeric_match", "length_penalty(max_chars=2)", "brevity(max_chars=4)"]
