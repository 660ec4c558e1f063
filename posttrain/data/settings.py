"""Settings written in a spec string, ``NAME=VALUE,...``: one parser for every spec that takes them.

A reasoning-gym task (``reasoning-gym:chain_sum(min_terms=2)``) and a reward named on the command line
(``--reward 'length_penalty(max_chars=400)'``) both write their settings this way. A VALUE is a Python
literal (``4``, ``0.5``, ``True``, ``'+'``, ``('+', '-')``) or else a bare word read as a string
(``format_style=natural``); commas inside parentheses, brackets and quotes do not separate settings.
"""

from __future__ import annotations

import ast
from typing import Any

from posttrain.config import ConfigError


def split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses, brackets and quotes, each part stripped.

    >>> split_top_level("a(x=1,y=(2,3))=2, b")
    ['a(x=1,y=(2,3))=2', 'b']
    """
    parts, depth, quote, start = [], 0, None, 0
    for i, char in enumerate(text):
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def parse_value(text: str) -> Any:
    """A setting's value: a Python literal, or else the bare word as a string.

    >>> parse_value("4"), parse_value("('+', '-')"), parse_value("natural")
    (4, ('+', '-'), 'natural')
    """
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_settings(text: str, owner: str, field: str) -> dict[str, Any]:
    """``NAME=VALUE,...`` -> {name: value}; a ConfigError on ``field`` naming the setting of ``owner`` (e.g.
    ``reasoning-gym family 'chain_sum'``) that is not ``NAME=VALUE`` or is given twice.

    >>> parse_settings("max_chars=400, scale=0.5", "reward 'length_penalty'", "reward")
    {'max_chars': 400, 'scale': 0.5}
    """
    settings: dict[str, Any] = {}
    for item in split_top_level(text):
        name, equals, value_text = item.partition("=")
        name = name.strip()
        if not equals or not name or not value_text.strip():
            raise ConfigError(f"{field}: setting {item!r} of {owner} is not NAME=VALUE")
        if name in settings:
            raise ConfigError(f"{field}: setting {name!r} of {owner} is given twice")
        settings[name] = parse_value(value_text.strip())
    return settings
