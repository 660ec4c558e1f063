"""Tool calls in the formats of real model families, checked token for token against their own chat templates.

For each family (``tests/fixtures/chat_templates``), a scripted policy writes the assistant's call exactly
as the family's template renders it; the episode runner must parse the call, run the tool and insert the
result, so that the whole transcript (prompt, call, result, final answer) is, token for token, what the
template renders for that conversation. The tokenizer is a byte-level BPE built here with the family's
special tokens: the test is about the template's text and its token boundaries, not a vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.rollout.completions import Completions, completion_mask
from posttrain.rollout.episodes import EpisodeGenerator, Tools, tool_format
from posttrain.rollout.tool_formats import (
    ChatTemplateCalls,
    ToolCall,
    detect_format,
    hermes_calls,
    llama3_calls,
    mistral_calls,
)

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
FAMILIES = {  # template, bos, eos, special tokens
    "hermes": ("qwen2.5.jinja", None, "<|im_end|>", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
    "llama3": ("llama3.2.jinja", "<|begin_of_text|>", "<|eot_id|>",
               ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]),
    "mistral": ("mistral-v0.3.jinja", "<s>", "</s>",
                ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
}
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
                                         "parameters": {"type": "object", "properties": {
                                             "expression": {"type": "string"}}, "required": ["expression"]}}}


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - the test's own expressions


def family_tokenizer(family: str):
    """A byte-level BPE over the template's own text, with the family's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    name, bos, eos, specials = FAMILIES[family]
    template = (TEMPLATES / name).read_text()
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = [template, '{"name": "calc", "arguments": {"expression": "12*7"}}', "What is 12*7? The answer is 84."] * 3
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=700, special_tokens=["<pad>", *specials],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token="<pad>")
    tokenizer.chat_template = template
    return tokenizer


def conversation(family: str) -> list[dict]:
    call = {"type": "function", "id": "abc123xyz", "function": {"name": "calc", "arguments": {"expression": "12*7"}}}
    return [{"role": "user", "content": "What is 12*7?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "abc123xyz", "name": "calc", "content": "84"},
            {"role": "assistant", "content": "The answer is 84."}]


class Replay:
    """A policy that writes, at each turn, the expected transcript's next tokens up to its next end of turn."""

    def __init__(self, expected: list[int], start: int, eos: int, pad: int):
        self.expected, self.eos, self.pad, self.position = expected, eos, pad, start

    def make(self, budget: int):
        replay = self

        class Turn:
            def generate(self, prompt_ids, *, num_samples, greedy=False, rows=None):
                context = prompt_ids[0].tolist()
                assert context == replay.expected[:len(context)], "the context drifted from the template's transcript"
                end = replay.expected.index(replay.eos, len(context)) + 1
                turn = replay.expected[len(context):end][:budget]
                tokens = torch.tensor([turn])
                mask, truncated = completion_mask(tokens, torch.tensor([replay.eos]))
                return Completions(tokens, mask, truncated)

        return Turn()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_calls_and_results_are_the_family_templates_token_for_token(family):
    tokenizer = family_tokenizer(family)
    messages = conversation(family)
    expected = tokenizer.apply_chat_template(messages, tools=[CALC], tokenize=True, return_dict=False)
    prompt = tokenizer.apply_chat_template(messages[:1], tools=[CALC], tokenize=True, return_dict=False,
                                           add_generation_prompt=True)
    assert expected[:len(prompt)] == prompt
    expected = expected[:len(expected) - expected[::-1].index(tokenizer.eos_token_id)]  # up to the last end of turn
    assert detect_format(tokenizer) == family
    replay = Replay(expected, len(prompt), tokenizer.eos_token_id, tokenizer.pad_token_id)
    episodes = EpisodeGenerator(replay.make, tokenizer, Tools([calc]), tool_format("auto", tokenizer),
                                max_new_tokens=400, max_turns=3, eos_ids=[tokenizer.eos_token_id],
                                pad_id=tokenizer.pad_token_id)
    out = episodes.generate([torch.tensor(prompt)], num_samples=1)
    n = int((out.completion_ids[0] != tokenizer.pad_token_id).sum())
    assert prompt + out.completion_ids[0, :n].tolist() == expected
    assert episodes.stats.tool_calls == 1 and sum(episodes.stats.errors.values()) == 0
    inserted = out.inserted[0, :n].bool()
    assert "84" in tokenizer.decode(out.completion_ids[0, :n][inserted])  # the result is context, not trained on
    assert out.mask[0, :n][inserted].sum() == 0


def test_each_family_parses_its_calls_and_tells_answers_apart():
    assert hermes_calls('<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>'
                        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == [
        ToolCall("calc", {"expression": "1+2"}), ToolCall("f", {"x": 1})]
    assert hermes_calls("The answer is 3.") == []
    assert llama3_calls('<|python_tag|>{"name": "calc", "parameters": {"expression": "1+2"}}') == [
        ToolCall("calc", {"expression": "1+2"})]
    assert llama3_calls("The answer is 3.") == []
    assert mistral_calls('[TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "1+2"}, "id": "abc123xyz"}]') == [
        ToolCall("calc", {"expression": "1+2"}, id="abc123xyz")]
    assert mistral_calls('[TOOL_CALLS] [{"name": "calc", "arguments": {}}]')[0].id == "call00000"  # 9 characters
    for parse, bad, message in [(hermes_calls, "<tool_call>{\"name\": 1", "not closed"),
                                (hermes_calls, "<tool_call>{oops}</tool_call>", "not JSON"),
                                (llama3_calls, '{"name": "calc", "parameters": [1]}', "parameters must be a JSON object"),
                                (mistral_calls, "[TOOL_CALLS] 42", "JSON list of calls")]:
        with pytest.raises(ValueError, match=message):
            parse(bad)


def test_a_malformed_call_is_answered_with_its_error_in_the_template_s_tool_turn():
    tokenizer = family_tokenizer("hermes")
    prompt = tokenizer.apply_chat_template(conversation("hermes")[:1], tools=[CALC], tokenize=True, return_dict=False,
                                           add_generation_prompt=True)
    bad = tokenizer.encode("<tool_call>\n{oops}\n</tool_call>", add_special_tokens=False) + [tokenizer.eos_token_id]
    answer = tokenizer.encode("84", add_special_tokens=False) + [tokenizer.eos_token_id]
    turns = iter([bad, answer])

    class Turn:
        def generate(self, prompt_ids, *, num_samples, greedy=False, rows=None):
            tokens = torch.tensor([next(turns)])
            mask, truncated = completion_mask(tokens, torch.tensor([tokenizer.eos_token_id]))
            return Completions(tokens, mask, truncated)

    episodes = EpisodeGenerator(lambda budget: Turn(), tokenizer, Tools([calc]), ChatTemplateCalls("hermes"),
                                max_new_tokens=300, max_turns=3, eos_ids=[tokenizer.eos_token_id],
                                pad_id=tokenizer.pad_token_id)
    out = episodes.generate([torch.tensor(prompt)], num_samples=1)
    text = tokenizer.decode(out.completion_ids[0], skip_special_tokens=False)
    assert "<tool_response>\nerror: malformed tool call: the call is not JSON" in text
    assert episodes.stats.errors["malformed_call"] == 1 and text.replace("<pad>", "").endswith("84<|im_end|>")


def test_the_template_outputs_match_jinja_s_own():
    """The fixtures are the families' templates: Jinja's rendering of a one-turn chat, as recorded from Jinja2."""
    qwen, llama = family_tokenizer("hermes"), family_tokenizer("llama3")
    hi = [{"role": "user", "content": "Hi"}]
    assert qwen.apply_chat_template(hi, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    rendered = llama.apply_chat_template(hi, tokenize=False, add_generation_prompt=True, date_string="26 Jul 2024")
    assert rendered == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                        "December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>"
                        "\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_auto_falls_back_to_json_without_a_tool_template():
    from posttrain.models.tiny import char_tokenizer

    assert detect_format(char_tokenizer("0123456789")) == "json"
    assert type(tool_format("auto", char_tokenizer("0123456789"))).__name__ == "JSONCalls"


def test_gsm_calculator_demonstrations_are_calls_the_json_format_parses_and_results_it_writes():
    from posttrain.data.tasks.gsm import calculator, make_tool_task
    from posttrain.rollout.episodes import JSONCalls

    fmt, task = JSONCalls(), make_tool_task()
    for row in task.train[:50] + task.test[:50]:
        call, result, answer = row["solution"]
        parsed = fmt.parse(call["text"])
        assert (parsed.name, parsed.arguments) == ("calculator", {"expression": row["expression"]})
        assert result == {"text": fmt.result(calculator(row["expression"])), "train": False}
        assert calculator(row["expression"]) == row["answer"] and answer["text"] == f"The answer is {row['answer']}."
