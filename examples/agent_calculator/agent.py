"""A calculator agent written against the OpenAI client, as it would run against any chat-completions server.

posttrain runs ``solve`` once per episode with a client pointed at the policy; the policy writes a call as
``[calc 123+456]``, which reaches this loop as a tool call whose arguments are ``{"expression": "123+456"}``.
"""

import json

from openai import OpenAI

CALC = {"type": "function", "function": {
    "name": "calc", "description": "The sum A+B of two whole numbers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calc(expression: str) -> str:
    a, b = expression.split("+")
    return str(int(a) + int(b))


def solve(client: OpenAI, row: dict) -> float:
    """Ask, run the calls the model makes, and score its final answer: 1.0 for the right sum."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(4):
        message = client.chat.completions.create(model="policy", messages=messages, tools=[CALC]).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(message.content.strip() == row["answer"])
        for call in message.tool_calls:
            try:
                result = calc(json.loads(call.function.arguments)["expression"])
            except (ValueError, KeyError) as error:  # a malformed call: the model reads what went wrong
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
