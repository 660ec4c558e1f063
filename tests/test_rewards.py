"""Built-in rewards on exact strings; the reward model against a manual forward; loading user files."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from posttrain.models.tiny import char_tokenizer
from posttrain.data.rewards import (
    RewardModel,
    exact_match,
    extract_answer,
    format_reward,
    length_penalty,
    load_reward_function,
    numeric_match,
)


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
