"""Tool calls as the model families people train write them, and results as their chat templates render them.

Two kinds of format. A **mid-turn** format (``json``, ``inline``) closes a call with a marker
(``</tool_call>``, ``]``); the turn stops there and the result is inserted as the format writes it.
A **chat-template** format (``hermes``, ``llama3``, ``mistral``, ``qwen3_coder``, ``harmony``) is how
the family's own template writes an assistant message with ``tool_calls``: the call ends the
assistant's turn (its end-of-turn token), and the results are inserted as the tokenizer's chat template
renders ``tool`` messages after that turn, up to where the next assistant turn starts. Nothing of the
template is written here: the inserted text is the template's, found by rendering the conversation
with and without the results.

| format | a call | the result (as the template renders it) |
|---|---|---|
| ``hermes`` (Hermes, Qwen2/2.5/3) | ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one or more | a user turn of ``<tool_response>`` blocks |
| ``llama3`` (Llama 3.1-3.3) | the turn is ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>`` allowed) | an ``ipython`` turn |
| ``mistral`` (Mistral v3 tokenizer) | ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "9 chars"}]`` | ``[TOOL_RESULTS] ... [/TOOL_RESULTS]`` |
| ``qwen3_coder`` (Qwen3-Coder, Qwen3.5) | ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``, one or more | a user turn of ``<tool_response>`` blocks |
| ``harmony`` (gpt-oss) | a message to ``functions.NAME`` with JSON arguments, ending the turn with ``<|call|>`` | a ``functions.NAME to=assistant`` message on the commentary channel |

``qwen3_coder`` is named after the parser that serves this format in vLLM and SGLang
(``--tool-call-parser qwen3_coder``), whichever Qwen model writes it. A value is the text between the
newlines the template writes around it. Those parsers then convert it by the type the tool's JSON
schema gives; with no schema here, a value that is JSON (a number, ``true``/``false``, ``null``, an
object, a list) is that JSON value and any other is the text, so a string parameter written ``84``
arrives as the number 84.

``harmony``: gpt-oss writes messages ``<|start|>assistant<|channel|>CHANNEL<|message|>...<|end|>``,
reasoning on ``analysis``, answers on ``final``, and ends its turn with ``<|return|>`` after an answer
or ``<|call|>`` after a call: ``<|end|>`` ends a message within the turn, so the turn ends on those two
(:data:`TURN_ENDS`), which gpt-oss's generation config lists as end-of-sequence ids. A call is the
turn's last message with a recipient: the chat template writes ``<|start|>assistant
to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>``, openai-harmony's renderer
``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``;
both are read. The result is what the template writes, ``<|start|>functions.NAME
to=assistant<|channel|>commentary<|message|>"RESULT"<|end|><|start|>assistant`` (the result as a JSON
string), where openai-harmony writes ``<|start|>functions.NAME<|message|>RESULT<|end|>``: an episode
inserts the template's, as it does for every chat-template format. The template renders one call per
assistant message, so a turn makes one call.

``tool_format auto`` picks one from the chat template (:func:`detect_format`). Tests check each against
the family's real template, token for token (``tests/fixtures/chat_templates``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("hermes", "llama3", "mistral", "qwen3_coder", "harmony")
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


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


def qwen3_coder_calls(turn: str) -> list[ToolCall]:
    """Every ``<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function></tool_call>`` block
    of the turn (the text before the first is reasoning or a preamble); [] when it has none."""
    if "<tool_call>" not in turn:
        return []
    blocks = _HERMES_BLOCK.findall(turn)
    if not blocks:
        raise ValueError("a call is <tool_call><function=NAME>...</function></tool_call>: this one is not closed")
    return [_xml_call(block) for block in blocks]


def _xml_call(block: str) -> ToolCall:
    """One ``<tool_call>`` block's function and its parameters, each once."""
    function = _XML_FUNCTION.fullmatch(block)
    if function is None:
        raise ValueError("a call is <tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function>"
                         "</tool_call>: this one has no <function=NAME>...</function>")
    name, body = function.groups()
    if not name:
        raise ValueError("the call's <function=NAME> has no name")
    outside = _XML_PARAMETER.sub("", body).strip()
    if outside:
        raise ValueError(f"the call to {name} has text outside its <parameter=ARG>...</parameter> blocks: "
                         f"{outside[:60]!r}")
    arguments: dict[str, Any] = {}
    for parameter, value in _XML_PARAMETER.findall(body):
        if parameter in arguments:
            raise ValueError(f"the call to {name} gives parameter {parameter!r} twice")
        arguments[parameter] = _xml_value(value)
    return ToolCall(name, arguments)


def _xml_value(text: str) -> Any:
    """A parameter's value: the text inside the newlines the template writes around it, as the JSON value
    it spells where it spells one (``84``, ``true``, ``[1, 2]``), else as text (``12*7``)."""
    text = text.removeprefix("\n").removesuffix("\n")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


_HARMONY_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def harmony_calls(turn: str) -> list[ToolCall]:
    """The call that the turn's last message makes, ``to=functions.NAME`` with a JSON object as its content
    (its header written either way: see the module docstring); [] when that message has no recipient (an
    answer, or reasoning)."""
    message = turn.rsplit("<|start|>", 1)[-1]
    header, has_content, content = message.partition("<|message|>")
    recipient = _HARMONY_RECIPIENT.search(header)
    if recipient is None:
        return []
    name = recipient.group(1).removeprefix("functions.")
    if name == recipient.group(1) or not name:
        raise ValueError(f"a call goes to functions.NAME, not to {recipient.group(1)!r}")
    if not has_content:
        raise ValueError(f"the call to functions.{name} has no <|message|> with its arguments")
    arguments = _json_object(content.strip(), f"the call to functions.{name}")
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of functions.{name} must be a JSON object, got {type(arguments).__name__}")
    return [ToolCall(name, arguments)]


PARSERS = {"hermes": hermes_calls, "llama3": llama3_calls, "mistral": mistral_calls,
           "qwen3_coder": qwen3_coder_calls, "harmony": harmony_calls}
TURN_ENDS = {"harmony": ("<|call|>", "<|return|>")}
"""Tokens besides the tokenizer's end-of-sequence that end a family's assistant turn. gpt-oss ends its turn
with ``<|call|>`` after a call and ``<|return|>`` after an answer; ``<|end|>`` ends a message within it."""


@dataclass(frozen=True)
class ChatTemplateCalls:
    """A family's calls, ending the assistant's turn; results rendered by the tokenizer's chat template."""

    family: str
    call_end = None  # no mid-turn marker: a call ends the turn

    def __post_init__(self) -> None:
        if self.family not in PARSERS:
            raise ValueError(f"tool format: unknown family {self.family!r}; use {', '.join(PARSERS)}")

    def turn_end_ids(self, tokenizer: Any) -> list[int]:
        """The ids of the family's :data:`TURN_ENDS` tokens, at which a turn stops besides the end-of-sequence."""
        ids = []
        for token in TURN_ENDS.get(self.family, ()):
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"tool format {self.family}: the tokenizer has no {token} token to end a turn "
                                 "with; choose another tool_format")
            ids += encoded
        return ids

    def find_calls(self, turn: str) -> list[ToolCall]:
        """The calls a finished turn (its text without the end-of-turn token) makes: [] for an answer, a
        ValueError (its message says what is wrong) for a call that is malformed."""
        return PARSERS[self.family](turn)

    def content(self, turn: str) -> str:
        """What a finished turn says besides its calls and its reasoning, as a chat API returns it in
        ``content``: the text before the first call, after a ``</think>`` (none for Llama 3's call, which is
        the whole turn); gpt-oss's answer on its ``final`` channel, none with a call (its analysis channel is
        reasoning)."""
        if self.family == "harmony":
            if harmony_calls(turn) or "<|channel|>final<|message|>" not in turn:
                return ""
            return turn.rsplit("<|channel|>final<|message|>", 1)[1].split("<|end|>", 1)[0]
        text = turn.rsplit("</think>", 1)[-1]
        if self.family == "llama3":
            return "" if llama3_calls(text) else text.strip()
        marker = "[TOOL_CALLS]" if self.family == "mistral" else "<tool_call>"
        return text.split(marker, 1)[0].strip()

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
    if "<|channel|>" in template and "<|call|>" in template:
        return "harmony"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "ipython" in template and "<|start_header_id|>" in template:
        return "llama3"
    if "<function=" in template and "<tool_call>" in template and "tool_calls" in template:  # XML inside hermes's tags
        return "qwen3_coder"
    if "<tool_call>" in template and "tool_calls" in template:
        return "hermes"
    return "json"
