"""Tool calls as the model families people train write them, and results as their chat templates render them.

Two kinds of format. A **mid-turn** format (``json``, ``inline``) closes a call with a marker
(``</tool_call>``, ``]``); the turn stops there and the result is inserted as the format writes it.
A **chat-template** format (``hermes``, ``llama3``, ``mistral``) is how the family's own template
writes an assistant message with ``tool_calls``: the call ends the assistant's turn (its end-of-turn
token), and the results are inserted as the tokenizer's chat template renders ``tool`` messages after
that turn, up to where the next assistant turn starts. Nothing of the template is written here: the
inserted text is the template's, found by rendering the conversation with and without the results.

| format | a call | the result (as the template renders it) |
|---|---|---|
| ``hermes`` (Hermes, Qwen2/2.5/3) | ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one or more | a user turn of ``<tool_response>`` blocks |
| ``llama3`` (Llama 3.1-3.3) | the turn is ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>`` allowed) | an ``ipython`` turn |
| ``mistral`` (Mistral v3 tokenizer) | ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "9 chars"}]`` | ``[TOOL_RESULTS] ... [/TOOL_RESULTS]`` |

``tool_format auto`` picks one from the chat template (:func:`detect_format`). Tests check each against
the family's real template, token for token (``tests/fixtures/chat_templates``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("hermes", "llama3", "mistral")
MISTRAL_ID_LENGTH = 9
"""Mistral's template requires tool-call ids of 9 alphanumeric characters; a call without one gets one."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments."""
    positional: tuple[Any, ...] = ()
    """Positional arguments, before the keyword ones."""
    id: str | None = None
    """The call's id where the format carries one (Mistral); its result refers to it."""


def _json_object(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{what} is not JSON ({error.msg} at column {error.colno})") from None


def _call(value: Any, arguments_key: str, index: int = 0) -> ToolCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError(f'a call is {{"name": TOOL, "{arguments_key}": {{...}}}}')
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        arguments = _json_object(arguments, f"the {arguments_key} string")
    if not isinstance(arguments, dict):
        raise ValueError(f"{arguments_key} must be a JSON object, got {type(arguments).__name__}")
    call_id = value.get("id")
    return ToolCall(value["name"], arguments, id=call_id if isinstance(call_id, str) else None)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def hermes_calls(turn: str) -> list[ToolCall]:
    """Every ``<tool_call>{...}</tool_call>`` block of the turn; [] when it has none."""
    if "<tool_call>" not in turn:
        return []
    blocks = _HERMES_BLOCK.findall(turn)
    if not blocks:
        raise ValueError("a call is <tool_call>{...}</tool_call>: this one is not closed")
    return [_call(_json_object(block.strip(), "the call"), "arguments") for block in blocks]


def llama3_calls(turn: str) -> list[ToolCall]:
    """The turn as one JSON call ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>``, if any); []
    when the turn is not a JSON object."""
    text = turn.strip().removeprefix("<|python_tag|>").strip()
    if not text.startswith("{"):
        return []
    value = _json_object(text, "the call")
    return [_call(value, "parameters" if "parameters" in value or "arguments" not in value else "arguments")]


def mistral_calls(turn: str) -> list[ToolCall]:
    """The JSON list after ``[TOOL_CALLS]``; [] when the turn has none. Each call keeps its id, or gets one."""
    if "[TOOL_CALLS]" not in turn:
        return []
    value = _json_object(turn.split("[TOOL_CALLS]", 1)[1].strip(), "the calls")
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("[TOOL_CALLS] is followed by a JSON list of calls")
    calls = []
    for index, item in enumerate(value):
        call = _call(item, "arguments")
        valid = call.id is not None and len(call.id) == MISTRAL_ID_LENGTH and call.id.isalnum()
        calls.append(call if valid else ToolCall(call.name, call.arguments, id=f"call{index:05d}"))
    return calls


PARSERS = {"hermes": hermes_calls, "llama3": llama3_calls, "mistral": mistral_calls}


@dataclass(frozen=True)
class ChatTemplateCalls:
    """A family's calls, ending the assistant's turn; results rendered by the tokenizer's chat template."""

    family: str
    call_end = None  # no mid-turn marker: a call ends the turn

    def __post_init__(self) -> None:
        if self.family not in PARSERS:
            raise ValueError(f"tool format: unknown family {self.family!r}; use {', '.join(PARSERS)}")

    def find_calls(self, turn: str) -> list[ToolCall]:
        """The calls a finished turn (its text without the end-of-turn token) makes: [] for an answer, a
        ValueError (its message says what is wrong) for a call that is malformed."""
        return PARSERS[self.family](turn)

    def render_results(self, tokenizer: Any, eos_text: str, calls: Sequence[ToolCall], results: Sequence[str]) -> str:
        """The text the chat template puts after an assistant turn making ``calls`` (which ended with
        ``eos_text``): the ``tool`` messages of ``results`` and the next assistant turn's start."""
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"tool format {self.family}: the tokenizer has no chat template to render results with")
        ids = [call.id or f"call{i:05d}" for i, call in enumerate(calls)]
        assistant = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": i, "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in zip(ids, calls)]}
        before = [{"role": "user", "content": "-"}, assistant]
        tool_messages = [{"role": "tool", "tool_call_id": i, "name": c.name, "content": r}
                         for i, c, r in zip(ids, calls, results)]
        prefix = tokenizer.apply_chat_template(before, tokenize=False)
        full = tokenizer.apply_chat_template(before + tool_messages, tokenize=False, add_generation_prompt=True)
        cut = prefix.rfind(eos_text)
        if not full.startswith(prefix) or cut < 0:
            raise ValueError(f"tool format {self.family}: the chat template does not render tool results after an "
                             f"assistant turn ending with {eos_text!r}; choose another tool_format")
        return prefix[cut + len(eos_text):] + full[len(prefix):]


def detect_format(tokenizer: Any) -> str:
    """The chat-template format a tokenizer's template writes calls in, else ``json`` (no template, or one
    that renders no tool calls)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return "json"
    if isinstance(template, dict):  # several named templates: the default one, or any
        template = template.get("default") or next(iter(template.values()))
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "ipython" in template and "<|start_header_id|>" in template:
        return "llama3"
    if "<tool_call>" in template and "tool_calls" in template:
        return "hermes"
    return "json"
