"""Multi-turn episodes with tools: a scripted policy, so every token of the transcript is known.

The policy's turns come from a script instead of a model; the episode runner must stop each turn
where a call closes, run the tool, insert its result's tokens (marked ``inserted``), continue from
everything so far, and keep the policy's sampled ids as they were.
"""

from __future__ import annotations

import time

import pytest
import torch

from posttrain.models.tiny import char_tokenizer
from posttrain.rollout.completions import Completions, completion_mask
from posttrain.rollout.episodes import (
    EpisodeGenerator,
    InlineCalls,
    JSONCalls,
    ToolError,
    Tools,
)

TOKENIZER = char_tokenizer("".join(chr(c) for c in range(32, 127)))  # printable ASCII, one token each
EOS, PAD = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class Script:
    """A policy that writes the next scripted turn of each row, cut at the first stop id or EOS, and records
    the contexts it was given."""

    def __init__(self, turns: dict[int, list[str]], num_samples: int):
        self.turns, self.num_samples = turns, num_samples
        self.calls: list[tuple[int, list[list[int]]]] = []  # (budget, contexts)
        self.next = {row: 0 for row in turns}

    def make(self, stop_ids: list[int]):
        script = self

        class Turn:
            def __init__(self, budget):
                self.budget = budget

            def generate(self, prompt_ids, *, num_samples, greedy=False, rows=None):
                rows = (list(range(len(prompt_ids) * num_samples)) if not script.calls
                        else [r for r in script.turns if script.next[r] < len(script.turns[r]) and r in script.waiting])
                script.calls.append((self.budget, [p.tolist() for p in prompt_ids]))
                out = []
                for r in rows:
                    text = script.turns[r][script.next[r]]
                    script.next[r] += 1
                    out.append(ids(text)[: self.budget])
                script.waiting = rows
                width = max(len(o) for o in out)
                tokens = torch.tensor([o + [PAD] * (width - len(o)) for o in out])
                mask, truncated = completion_mask(tokens, torch.tensor([EOS, *stop_ids]))
                real = torch.tensor([[1.0] * len(o) + [0.0] * (width - len(o)) for o in out])
                return Completions(tokens, mask * real, truncated)

        return Turn


def calculate(argument: str) -> str:
    a, op, b = argument.partition("+") if "+" in argument else argument.partition("*")
    return str(int(a) + int(b) if op == "+" else int(a) * int(b))


def run(turns, tools, *, max_turns=4, max_new_tokens=40, num_samples=2, fmt=InlineCalls()):
    script = Script(turns, num_samples)
    stop = ids(fmt.call_end)[-1]
    episodes = EpisodeGenerator(script.make([stop]), TOKENIZER, tools, fmt, max_new_tokens=max_new_tokens,
                                max_turns=max_turns, eos_ids=[EOS], pad_id=PAD)
    prompts = [torch.tensor(ids("12+30="))]
    return episodes.generate(prompts, num_samples=num_samples), episodes, script, prompts


def test_an_episode_is_the_policys_tokens_and_the_tools_token_for_token():
    eos = TOKENIZER.eos_token
    comp, episodes, script, prompts = run({0: ["[calc 12+30]", "42" + eos], 1: ["41" + eos]},
                                          Tools([calculate], timeout=0), fmt=InlineCalls())
    # a tool named calc does not exist: the policy reads the error (counted), then answers
    assert episodes.stats.errors["unknown_tool"] == 1
    comp, episodes, script, prompts = run({0: ["[calculate 12+30]", "42" + eos], 1: ["41" + eos]},
                                          Tools([calculate], timeout=0))
    row0 = ids("[calculate 12+30]") + ids("=42;") + ids("42") + [EOS]
    policy0 = [1.0] * len("[calculate 12+30]") + [0.0] * 4 + [1.0] * 3
    assert comp.completion_ids[0, : len(row0)].tolist() == row0
    assert comp.mask[0, : len(row0)].tolist() == policy0 and comp.inserted[0, : len(row0)].tolist() == [
        m == 0.0 for m in policy0]
    assert comp.completion_ids[1].tolist()[:3] == ids("41") + [EOS] and comp.mask[1].sum() == 3
    assert not comp.inserted[1].any() and not comp.truncated.any()
    # the second turn continued from the prompt, the call and the inserted result, exactly
    assert script.calls[1][1] == [prompts[0].tolist() + ids("[calculate 12+30]=42;")]
    assert episodes.stats.turns == [2, 1] and episodes.stats.tool_calls == 1
    assert episodes.stats.inserted_tokens == 4 and sum(episodes.stats.errors.values()) == 0
    assert TOKENIZER.decode(comp.completion_ids[0], skip_special_tokens=True) == "[calculate 12+30]=42;42"


def slow(argument: str) -> str:
    time.sleep(30)
    return "never"


def raises(argument: str) -> str:
    raise ZeroDivisionError("division by zero")


def not_text(argument: str) -> list:
    return [1, 2]


@pytest.mark.parametrize("tool, kind, message", [
    (slow, "timeout", "slow failed: timed out after 1 s (tool_timeout)"),
    (raises, "error", "raises failed: ZeroDivisionError: division by zero"),
    (not_text, "not_text", "not_text returned list, not text"),
])
def test_a_faulty_tool_is_read_as_an_error_and_counted(tool, kind, message):
    eos = TOKENIZER.eos_token
    name = tool.__name__
    started = time.perf_counter()
    comp, episodes, script, prompts = run({0: [f"[{name} 1]", "0" + eos], 1: ["1" + eos]},
                                          Tools([tool], timeout=1.0), max_new_tokens=120)
    assert time.perf_counter() - started < 20  # the hung tool was killed at its limit
    assert episodes.stats.errors[kind] == 1
    inserted = comp.completion_ids[0][comp.inserted[0]].tolist()
    assert TOKENIZER.decode(inserted) == InlineCalls().result(f"error: {message}")
    with pytest.raises(ToolError, match=message.replace("(", "\\(").replace(")", "\\)")):
        run({0: [f"[{name} 1]", "0" + eos], 1: ["1" + eos]}, Tools([tool], timeout=1.0, on_error="raise"),
            max_new_tokens=120)


def test_a_malformed_call_and_a_json_call():
    fmt = JSONCalls()
    with pytest.raises(ValueError, match="not JSON"):
        fmt.parse('<tool_call>{"name": "calc", </tool_call>')
    with pytest.raises(ValueError, match="arguments must be a JSON object"):
        fmt.parse('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>')
    call = fmt.parse('I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert (call.name, call.arguments) == ("add", {"a": 1, "b": 2})

    def add(a: int, b: int) -> int:
        return a + b

    assert Tools([add]).run(call) == ("3", None)


def test_the_budget_truncates_an_episode_and_max_turns_ends_it():
    eos = TOKENIZER.eos_token
    comp, episodes, _, _ = run({0: ["[calculate 1+1]", "[calculate 2+2]", "[calculate 3+3]"], 1: ["5" + eos]},
                               Tools([calculate]), max_turns=2)
    assert episodes.stats.turns == [2, 1] and episodes.stats.tool_calls == 1  # the 2nd call is the last turn
    assert not comp.truncated[0] and comp.inserted[0].sum() == len("=2;")
    comp, episodes, _, _ = run({0: ["[calculate 1+1]", "1234567890123" + eos], 1: ["5" + eos]},
                               Tools([calculate]), max_new_tokens=24)
    assert comp.truncated.tolist() == [True, False]
    assert comp.present[0].sum() == 24 and comp.mask[0].sum() == 24 - len("=2;")


def calculator_tool(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses
    """
    return expression


def test_tools_are_described_in_a_system_message_where_the_chat_template_does_not_render_them():
    import json

    from posttrain.data.prompts import encode_prompt, renders_tools

    chat = char_tokenizer("".join(chr(c) for c in range(32, 127)) + "\n")
    chat.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    assert not renders_tools(chat)
    text = chat.decode(encode_prompt(chat, [{"role": "user", "content": "2+3?"}], tools=[calculator_tool]))
    system, user = text.split("\n[user]")
    schema = {"type": "function", "function": {
        "name": "calculator_tool", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "description": "numbers with + - * / and parentheses"}}, "required": ["expression"]},
        "return": {"type": "string"}}}
    assert system.startswith("[system]You may call these tools") and json.dumps(schema) in system
    assert system.endswith('<tool_call>{"name": "calculator_tool", "arguments": {"expression": "..."}}</tool_call>')
    assert user == "2+3?\n"
    # after the conversation's own system message; without tools, nothing changes
    own = chat.decode(encode_prompt(chat, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                    tools=[calculator_tool]))
    assert own.startswith("[system]Be brief.\n\nYou may call these tools")
    assert chat.decode(encode_prompt(chat, [{"role": "user", "content": "hi"}])) == "[user]hi\n"
    # a template that renders tools itself gets them as they are
    chat.chat_template = ("{% for t in tools or [] %}<{{ t['function']['name'] }}>{% endfor %}"
                          "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}")
    assert renders_tools(chat)
    assert chat.decode(encode_prompt(chat, [{"role": "user", "content": "hi"}], tools=[calculator_tool])) == (
        "<calculator_tool>[user]hi\n")


@pytest.mark.parametrize("expression, value", [("(12 + 30) * 2", "84"), ("7 / 2", "3.5"), ("3 x 4", "12"),
                                               ("-5 + 2", "-3"), ("1/3", "0.333333")])
def test_the_gsm_calculator_evaluates_arithmetic_and_nothing_else(expression, value):
    from posttrain.data.tasks.gsm import calculator

    assert calculator(expression) == value
    with pytest.raises(ValueError, match=r"not arithmetic: '2 \*\* 10'"):
        calculator("2 ** 10")
    with pytest.raises(ValueError, match=r"not arithmetic: \"open\('x'\)\""):
        calculator("open('x')")


def test_gsm_calculator_is_the_gsm_split_with_the_tool():
    from posttrain.data.tasks import get_task
    from posttrain.data.tasks.gsm import INSTRUCTION, TOOL_INSTRUCTION, calculator

    gsm, tool = get_task("gsm"), get_task("gsm-calculator")
    assert tool.tools == (calculator,) and tool.tool_format == "json" and tool.max_new_tokens == 256
    assert [r["answer"] for r in tool.test] == [r["answer"] for r in gsm.test]
    assert tool.test[0]["prompt"][0]["content"] == gsm.test[0]["prompt"][0]["content"].replace(
        INSTRUCTION, TOOL_INSTRUCTION)
