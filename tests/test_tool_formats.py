"""Tool calls in the formats of real model families, checked token for token against their own chat templates.

For each family (``tests/fixtures/chat_templates``), a scripted policy writes the assistant's call exactly
as the family's template renders it; the episode runner must parse the call, run the tool and insert the
result, so that the whole transcript (prompt, call, result, final answer) is, token for token, what the
template renders for that conversation. The tokenizer is a byte-level BPE built here with the family's
special tokens: the test is about the template's text and its token boundaries, not a vocabulary. gpt-oss's
calls are also read as openai-harmony's renderer writes them (its own test data, a fixture too).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from posttrain.rollout.completions import Completions, SamplingParams, completion_mask
from posttrain.rollout.episodes import EpisodeGenerator, Tools, make_episode_generator, tool_format
from posttrain.rollout.tool_formats import (
    TURN_ENDS,
    ToolCall,
    detect_format,
    harmony_calls,
    hermes_calls,
    llama3_calls,
    mistral_calls,
    qwen3_coder_calls,
)

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
QWEN3 = [*QWEN, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
FIXTURES = {  # template: family, bos, eos, special tokens
    "qwen2.5.jinja": ("hermes", None, "<|im_end|>", QWEN),
    "llama3.2.jinja": ("llama3", "<|begin_of_text|>", "<|eot_id|>",
                       ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                        "<|python_tag|>"]),
    "mistral-v0.3.jinja": ("mistral", "<s>", "</s>",
                           ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
    "qwen3-coder.jinja": ("qwen3_coder", None, "<|im_end|>", QWEN3),
    "qwen3.5.jinja": ("qwen3_coder", None, "<|im_end|>", QWEN3),
    "gpt-oss-120b.jinja": ("harmony", None, "<|return|>",
                           ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                            "<|call|>", "<|endoftext|>"]),
}
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
                                         "parameters": {"type": "object", "properties": {
                                             "expression": {"type": "string"}}, "required": ["expression"]}}}


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - the test's own expressions


def family_tokenizer(fixture: str):
    """A byte-level BPE over the template's own text, with the family's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _, bos, eos, specials = FIXTURES[fixture]
    template = (TEMPLATES / fixture).read_text()
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = [template, '{"name": "calc", "arguments": {"expression": "12*7"}}', "What is 12*7? The answer is 84."] * 3
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=700, special_tokens=["<pad>", *specials],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token="<pad>")
    tokenizer.chat_template = template
    return tokenizer


def turn_end_ids(fixture: str, tokenizer) -> list[int]:
    """Where the family's assistant turns end: its end-of-sequence token and, for gpt-oss, ``<|call|>`` too (as
    its generation config lists them)."""
    return [tokenizer.convert_tokens_to_ids(token)
            for token in dict.fromkeys([FIXTURES[fixture][2], *TURN_ENDS.get(FIXTURES[fixture][0], ())])]


def conversation() -> list[dict]:
    """A question, a call, its result and the answer, with reasoning where a template renders it (Qwen3.5's
    ``reasoning_content`` in ``<think>``, gpt-oss's ``thinking`` on the analysis channel; the others ignore it)."""
    call = {"type": "function", "id": "abc123xyz", "function": {"name": "calc", "arguments": {"expression": "12*7"}}}
    return [{"role": "user", "content": "What is 12*7?"},
            {"role": "assistant", "content": "", "reasoning_content": "Let me compute.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "abc123xyz", "name": "calc", "content": "84"},
            {"role": "assistant", "content": "The answer is 84.", "reasoning_content": "It is 84.",
             "thinking": "It is 84."}]


class Replay:
    """A policy that writes, at each turn, the expected transcript's next tokens up to its next end of turn."""

    def __init__(self, expected: list[int], ends: list[int]):
        self.expected, self.ends = expected, ends

    def make(self, budget: int):
        replay = self

        class Turn:
            def generate(self, prompt_ids, *, num_samples, greedy=False, rows=None):
                context = prompt_ids[0].tolist()
                assert context == replay.expected[:len(context)], "the context drifted from the template's transcript"
                end = next(i for i in range(len(context), len(replay.expected)) if replay.expected[i] in replay.ends)
                tokens = torch.tensor([replay.expected[len(context):end + 1][:budget]])
                mask, truncated = completion_mask(tokens, torch.tensor(replay.ends))
                return Completions(tokens, mask, truncated)

        return Turn()


def replay_episode(tokenizer, ends: list[int], prompt: list[int], expected: list[int]):
    """The episode a policy replaying ``expected`` from ``prompt`` plays with ``calc``: (the prompt and the
    completion's ids, which of the completion's were inserted, its loss mask, the episode's stats)."""
    episodes = EpisodeGenerator(Replay(expected, ends).make, tokenizer, Tools([calc]),
                                tool_format("auto", tokenizer), max_new_tokens=400, max_turns=3, eos_ids=ends,
                                pad_id=tokenizer.pad_token_id)
    out = episodes.generate([torch.tensor(prompt)], num_samples=1)
    n = int((out.completion_ids[0] != tokenizer.pad_token_id).sum())
    return prompt + out.completion_ids[0, :n].tolist(), out.inserted[0, :n].bool(), out.mask[0, :n], episodes.stats


@pytest.mark.parametrize("fixture", list(FIXTURES))
def test_calls_and_results_are_the_family_templates_token_for_token(fixture):
    tokenizer = family_tokenizer(fixture)
    ends = turn_end_ids(fixture, tokenizer)
    messages = conversation()
    expected = tokenizer.apply_chat_template(messages, tools=[CALC], tokenize=True, return_dict=False)
    prompt = tokenizer.apply_chat_template(messages[:1], tools=[CALC], tokenize=True, return_dict=False,
                                           add_generation_prompt=True)
    assert expected[:len(prompt)] == prompt
    expected = expected[:max(i for i, token in enumerate(expected) if token in ends) + 1]  # up to the last end of turn
    assert detect_format(tokenizer) == FIXTURES[fixture][0]
    transcript, inserted, mask, stats = replay_episode(tokenizer, ends, prompt, expected)
    assert transcript == expected
    assert stats.tool_calls == 1 and sum(stats.errors.values()) == 0
    completion = torch.tensor(transcript[len(prompt):])
    assert "84" in tokenizer.decode(completion[inserted])  # the result is context, not trained on
    assert mask[inserted].sum() == 0 and mask[~inserted].min() == 1


def test_a_gpt_oss_call_after_its_reasoning_gets_the_result_the_template_prompts_with():
    """gpt-oss reasons on the analysis channel (``<|end|>`` ends that message, not the turn), then calls: what
    the policy reads before answering is the template's prompt for that conversation, reasoning kept (the
    template drops it only once a final answer follows)."""
    fixture = "gpt-oss-120b.jinja"
    tokenizer = family_tokenizer(fixture)
    ends = turn_end_ids(fixture, tokenizer)
    messages = conversation()[:3]
    messages[1] = {**messages[1], "thinking": "Multiply."}
    prompt = tokenizer.apply_chat_template(messages[:1], tools=[CALC], tokenize=True, return_dict=False,
                                           add_generation_prompt=True)
    before_answer = tokenizer.apply_chat_template(messages, tools=[CALC], tokenize=True, return_dict=False,
                                                  add_generation_prompt=True)
    answer = tokenizer.encode("<|channel|>final<|message|>84<|return|>", add_special_tokens=False)
    assert "<|channel|>analysis<|message|>Multiply.<|end|><|start|>assistant to=functions.calc" in tokenizer.decode(
        before_answer)
    transcript, inserted, _, stats = replay_episode(tokenizer, ends, prompt, before_answer + answer)
    assert transcript == before_answer + answer and stats.tool_calls == 1 and sum(stats.errors.values()) == 0
    assert tokenizer.decode(torch.tensor(transcript[len(prompt):])[inserted]) == (
        '<|start|>functions.calc to=assistant<|channel|>commentary<|message|>"84"<|end|><|start|>assistant')


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


def test_qwen3_coder_calls_read_each_parameter_as_json_where_it_is_json_else_as_text():
    """After its reasoning, one or more XML calls; a value is the text inside the newlines the template writes
    around it, read as JSON where it is JSON (``3``, ``[true, null]``) and as text otherwise (``12*7``, lines)."""
    turn = ("Let me compute.\n</think>\n\n<tool_call>\n<function=calc>\n<parameter=expression>\n12*7\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=flags>\n"
            "[true, null]\n</parameter>\n<parameter=text>\nline one\nline two\n</parameter>\n</function>\n</tool_call>")
    assert qwen3_coder_calls(turn) == [ToolCall("calc", {"expression": "12*7"}),
                                       ToolCall("f", {"n": 3, "flags": [True, None], "text": "line one\nline two"})]
    assert qwen3_coder_calls("<tool_call>\n<function=now>\n</function>\n</tool_call>") == [ToolCall("now", {})]
    assert qwen3_coder_calls("No tool needed.\n</think>\n\nThe answer is 3.") == []
    for bad, message in [("<tool_call>\n<function=calc>\n", "not closed"),
                         ('<tool_call>\n{"name": "calc"}\n</tool_call>', "no <function=NAME>"),
                         ("<tool_call><function=>\n</function></tool_call>", "has no name"),
                         ("<tool_call>\n<function=calc>\n<parameter=expression>\n1+2\n</function>\n</tool_call>",
                          "the call to calc has text outside its <parameter=ARG>"),
                         ("<tool_call><function=f><parameter=a>1</parameter><parameter=a>2</parameter></function>"
                          "</tool_call>", "gives parameter 'a' twice")]:
        with pytest.raises(ValueError, match=message):
            qwen3_coder_calls(bad)


def test_harmony_calls_are_the_turn_s_last_message_to_a_function_as_either_renderer_writes_it():
    """A turn continues the template's ``<|start|>assistant``: the call is its last message, written as the
    chat template writes it or as openai-harmony's renderer does (its own test data, verbatim); a last
    message with no recipient is an answer."""
    template_style = ' to=functions.calc<|channel|>commentary json<|message|>{"expression": "1+2"}'
    assert harmony_calls(template_style) == [ToolCall("calc", {"expression": "1+2"})]
    rendered = (TEMPLATES / "harmony-tool-call.txt").read_text(encoding="utf-8")  # openai-harmony's rendering
    turn = rendered.split("<|start|>assistant", 1)[1].split("<|call|>")[0]
    assert turn.startswith("<|channel|>analysis<|message|>User asks")
    assert harmony_calls(turn) == [ToolCall("lookup_weather", {"location": "San Francisco"})]
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>3"
    assert harmony_calls(answer) == []
    for bad, message in [("<|channel|>analysis to=browser.search<|message|>{}", "goes to functions.NAME, not to"),
                         (" to=functions.calc<|channel|>commentary json", "no <|message|>"),
                         (" to=functions.calc<|channel|>commentary json<|message|>{oops", "functions.calc is not JSON"),
                         (" to=functions.calc<|channel|>commentary json<|message|>[1]", "must be a JSON object")]:
        with pytest.raises(ValueError, match=message):
            harmony_calls(bad)


@pytest.mark.parametrize("fixture, bad, error, answer", [
    ("qwen2.5.jinja", "<tool_call>\n{oops}\n</tool_call><|im_end|>",
     "<tool_response>\nerror: malformed tool call: the call is not JSON", "84<|im_end|>"),
    ("qwen3-coder.jinja",
     "<tool_call>\n<function=calc>\n<parameter=expression>\n12*7\n</function>\n</tool_call><|im_end|>",
     "<tool_response>\nerror: malformed tool call: the call to calc has text outside", "84<|im_end|>"),
    ("gpt-oss-120b.jinja", "<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{oops}<|call|>",
     '<|channel|>commentary<|message|>"error: malformed tool call: the call to functions.calc is not JSON',
     "<|channel|>final<|message|>84<|return|>"),
])
def test_a_malformed_call_is_answered_with_its_error_in_the_template_s_tool_turn(fixture, bad, error, answer):
    tokenizer = family_tokenizer(fixture)
    ends = turn_end_ids(fixture, tokenizer)
    prompt = tokenizer.apply_chat_template(conversation()[:1], tools=[CALC], tokenize=True, return_dict=False,
                                           add_generation_prompt=True)
    turns = iter([tokenizer.encode(bad, add_special_tokens=False), tokenizer.encode(answer, add_special_tokens=False)])

    class Turn:
        def generate(self, prompt_ids, *, num_samples, greedy=False, rows=None):
            tokens = torch.tensor([next(turns)])
            mask, truncated = completion_mask(tokens, torch.tensor(ends))
            return Completions(tokens, mask, truncated)

    episodes = EpisodeGenerator(lambda budget: Turn(), tokenizer, Tools([calc]), tool_format("auto", tokenizer),
                                max_new_tokens=300, max_turns=3, eos_ids=ends, pad_id=tokenizer.pad_token_id)
    out = episodes.generate([torch.tensor(prompt)], num_samples=1)
    text = tokenizer.decode(out.completion_ids[0], skip_special_tokens=False)
    assert error in text
    assert episodes.stats.errors["malformed_call"] == 1 and text.replace("<pad>", "").endswith(answer)


@pytest.mark.parametrize("fixture", ["qwen2.5.jinja", "qwen3.5.jinja", "gpt-oss-120b.jinja"])
def test_episodes_built_for_a_chat_template_format_end_turns_where_the_family_does(fixture):
    """The trainer's episode generator stops each turn at the end-of-sequence ids it is given and the family's
    own end-of-turn tokens (gpt-oss's ``<|call|>``, which a checkpoint's generation config may leave out)."""
    tokenizer = family_tokenizer(fixture)
    episodes = make_episode_generator("hf", None, tokenizer, SamplingParams(max_new_tokens=64),
                                      [tokenizer.eos_token_id], Tools([calc]), tool_format("auto", tokenizer),
                                      max_turns=2)
    assert episodes.eos_ids == set(turn_end_ids(fixture, tokenizer))
    assert episodes.turn_generator.stop_ids == turn_end_ids(fixture, tokenizer)
    if FIXTURES[fixture][0] != "harmony":
        with pytest.raises(ValueError, match=re.escape("has no <|call|> token to end a turn with")):
            tool_format("harmony", tokenizer).turn_end_ids(tokenizer)


def test_the_template_outputs_match_jinja_s_own():
    """The fixtures are the families' templates: Jinja's rendering of a one-turn chat, as recorded from Jinja2,
    and gpt-oss's system message as the harmony format's documentation writes it."""
    qwen, llama = family_tokenizer("qwen2.5.jinja"), family_tokenizer("llama3.2.jinja")
    hi = [{"role": "user", "content": "Hi"}]
    assert qwen.apply_chat_template(hi, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    rendered = llama.apply_chat_template(hi, tokenize=False, add_generation_prompt=True, date_string="26 Jul 2024")
    assert rendered == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                        "December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>"
                        "\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    gpt_oss = family_tokenizer("gpt-oss-120b.jinja").apply_chat_template(hi, tools=[CALC], tokenize=False,
                                                                         reasoning_effort="high")
    system = re.sub(r"Current date: \d{4}-\d{2}-\d{2}", "Current date: 2025-06-28", gpt_oss.split("<|end|>")[0])
    assert system + "<|end|>" == (  # docs/format.md of openai/harmony, "Example system message"
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: "
        "2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n# Valid channels: analysis, commentary, final. "
        "Channel must be included for every message.\nCalls to these tools must go to the commentary channel: "
        "'functions'.<|end|>")


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
