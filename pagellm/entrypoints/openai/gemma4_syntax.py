"""Gemma 4's tool-call syntax, read back into JSON values.

Gemma 4's chat template writes an assistant's call as `<|tool_call>call:NAME{ARGS}<tool_call|>`,
and the model writes its own calls the same way. ARGS is not JSON: keys are bare (`city:`),
strings sit between `<|"|>` delimiters (one special token each side, the text between them
as is: no escapes), and the rest is JSON-like: `{...}`, `[...]`, numbers, `true`, `false`.
The template prints a null as Jinja prints None (`None`); `null` is read too.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

QUOTE = '<|"|>'
_SPACE = " \t\r\n"
# A number as JSON and Python print one (Python's floats may have an exponent: 1e-05).
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORDS = {"true": True, "false": False, "null": None, "None": None}
_WORD = re.compile(r"true|false|null|None")
# A bare key: what comes before its colon, never a structural character or a string's delimiter.
_KEY = re.compile(r"[^:{}\[\],<>\s]+")


def parse_object(text: str, i: int) -> tuple[dict[str, Any], int]:
    """The `{...}` that starts at text[i] (after any whitespace), and the index just past it.
    ValueError when it is not one (malformed, or cut short)."""
    i = _skip(text, i)
    if not text.startswith("{", i):
        raise ValueError(f"expected '{{' at {i}: {text[i:i + 20]!r}")
    return _object(text, i)


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _value(text: str, i: int) -> tuple[Any, int]:
    i = _skip(text, i)
    if text.startswith(QUOTE, i):
        return _string(text, i)
    if text.startswith("{", i):
        return _object(text, i)
    if text.startswith("[", i):
        return _array(text, i)
    m = _NUMBER.match(text, i) or _WORD.match(text, i)
    if m is None:
        raise ValueError(f"expected a value at {i}: {text[i:i + 20]!r}")
    word = m.group(0)
    return (_WORDS[word] if word in _WORDS else json.loads(word)), m.end()


def _string(text: str, i: int) -> tuple[str, int]:
    start = i + len(QUOTE)
    end = text.find(QUOTE, start)
    if end < 0:
        raise ValueError(f"a string opened at {i} is not closed")
    return text[start:end], end + len(QUOTE)


def _key(text: str, i: int) -> tuple[str, int]:
    """A member's key: bare, as the template writes an argument's, or quoted, as it writes a
    declaration's; then its colon."""
    if text.startswith(QUOTE, i):
        key, i = _string(text, i)
    else:
        m = _KEY.match(text, i)
        if m is None:
            raise ValueError(f"expected a key at {i}: {text[i:i + 20]!r}")
        key, i = m.group(0), m.end()
    i = _skip(text, i)
    if not text.startswith(":", i):
        raise ValueError(f"expected ':' after the key {key!r} at {i}")
    return key, i + 1


def _items(text: str, i: int, close: str, item: Callable[[str, int], tuple[Any, int]]) -> tuple[list[Any], int]:
    """The comma-separated items of the object or array opening at i, up to `close`, each read by
    `item`; and the index after `close`."""
    out: list[Any] = []
    i = _skip(text, i + 1)
    if text.startswith(close, i):
        return out, i + 1
    while True:
        value, i = item(text, i)
        out.append(value)
        i = _skip(text, i)
        if text.startswith(close, i):
            return out, i + 1
        if not text.startswith(",", i):
            raise ValueError(f"expected ',' or '{close}' at {i}: {text[i:i + 20]!r}")
        i += 1


def _member(text: str, i: int) -> tuple[tuple[str, Any], int]:
    key, i = _key(text, _skip(text, i))
    value, i = _value(text, i)
    return (key, value), i


def _object(text: str, i: int) -> tuple[dict[str, Any], int]:
    members, i = _items(text, i, "}", _member)
    return dict(members), i


def _array(text: str, i: int) -> tuple[list[Any], int]:
    return _items(text, i, "]", _value)
