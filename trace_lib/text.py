"""Untrusted text made safe once, where it enters: model output, tool results, LLM user and analyst replies.

Reads and writes nothing. After `clean_text`, no later step can fail on a string: the tokenizer, the
chat template, the JSONL writer (strict UTF-8), the analyst renderer, the HTML report and notebook
outputs all accept it. What it does:

- code points that cannot be encoded as UTF-8 (lone surrogates, e.g. from a JSON `\\ud800` escape)
  become U+FFFD;
- control characters other than tab and newline are dropped (`\\r\\n` and `\\r` become `\\n`);
  they have no meaning in a chat turn and some break terminals, XML-based viewers or JSON readers;
- text longer than `max_chars` is cut, and a marker says how many characters were left out.

`clean_json` applies the same to every string (keys included) of a parsed JSON value.
"""

from __future__ import annotations

import re
from typing import Any

REPLACEMENT = "\ufffd"
_SURROGATES = re.compile("[\ud800-\udfff]")
_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def truncation_marker(left_out: int) -> str:
    return f"…[{left_out} characters cut]"


def clean_text(text: str, max_chars: int | None = None) -> str:
    """`text` with unencodable code points replaced, control characters dropped and length capped."""
    if not isinstance(text, str):
        text = str(text)
    if not text.isascii():
        text = _SURROGATES.sub(REPLACEMENT, text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROLS.sub("", text)
    if max_chars is not None and len(text) > max_chars:
        text = text[:max_chars] + truncation_marker(len(text) - max_chars)
    return text


def clean_json(value: Any, max_chars: int | None = None) -> Any:
    """A JSON value (from `json.loads`) with every string cleaned; other values unchanged."""
    if isinstance(value, str):
        return clean_text(value, max_chars)
    if isinstance(value, list):
        return [clean_json(v, max_chars) for v in value]
    if isinstance(value, dict):
        return {clean_text(str(k)): clean_json(v, max_chars) for k, v in value.items()}
    return value
