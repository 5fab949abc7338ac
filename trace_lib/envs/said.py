"""What the agent said to the user: the one place that decides "the agent said X".

Reads records only; writes nothing. Every check of the form "did the agent tell the user this" goes
through `said_to_user`: the built-in retail reward (a required output must have been said, as
τ²-bench's COMMUNICATE check), the synthesized environments (`trace_lib.synth_sdk.said`) and the
rules analyst's `communicate_result` detector. Keeping one matcher means the analyst cannot label a
trajectory PRESENT for a capability that the reward failed it for.

Matching rules: case-insensitive, after number normalisation (`normalize_text`: thousands separators
dropped, trailing decimal zeros stripped, so "$1,234.50", "1234.5" and "1234.50" all match), and
only whole tokens: "100" does not match "1000", "delivered" does not match "undelivered". τ²-bench
itself only drops commas. A message that names the required value beside another candidate of the same
kind (`rival_values`: two order statuses, two amounts of money, two long numbers such as a tracking number
and an item id) does not count as saying it, so text that hedges over several values earns nothing; nor does
a status said only in the negative ("not delivered").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def _canonical_number(match: re.Match) -> str:
    s = match.group(0).replace(",", "")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s


def normalize_text(text: str) -> str:
    """Lower-case, thousands separators dropped, trailing decimal zeros stripped."""
    return _NUMBER.sub(_canonical_number, text.lower())


ORDER_STATUSES = ("pending", "processed", "delivered", "cancelled", "return requested", "exchange requested")
"""The order statuses of τ²-bench retail: candidates of one kind, so an answer may name only one of them."""
_STATUS = re.compile(r"(?<![0-9a-z])(?<!be )(?<!been )(" + "|".join(ORDER_STATUSES) + r")(?![0-9a-z])(?! orders?\b)")
"""A status stated of an order: not the verb ("can be cancelled") nor a class of orders ("pending orders")."""
_AMOUNT = re.compile(r"^\$?\d+(?:\.\d+)?$")
_AMOUNT_IN_TEXT = re.compile(r"(?:\$\d+(?:\.\d+)?|(?<![0-9a-z#])\d+\.\d+)(?![0-9a-z])")
"""Money in lower-cased text: a number after '$' or with decimals (ids, zips and counts have neither)."""
_LONG_NUMBER = re.compile(r"^\d{6,}$")
_LONG_NUMBER_IN_TEXT = re.compile(r"(?<![0-9a-z#.$])\d{6,}(?![0-9a-z])")
"""A free-standing number of six digits or more (a tracking number, an item id); not an order id ('#w...')."""


def rival_values(needle: str, text: str) -> list[str]:
    """Other candidates of `needle`'s kind named in `text`, normalised: other order statuses where `needle` (normalised)
    is one, other numbers of six digits or more where it is one, else other amounts of money where it is a number;
    [] for any other kind. `text` is lower-cased with its numbers as written, so "5.00" is still money."""
    if needle in ORDER_STATUSES:
        return sorted({m.group(1) for m in _STATUS.finditer(text)} - {needle})
    if _LONG_NUMBER.match(needle):
        return sorted({m.group(0) for m in _LONG_NUMBER_IN_TEXT.finditer(text.replace(",", ""))} - {needle})
    if _AMOUNT.match(needle):
        amount = needle.lstrip("$")
        found = {normalize_text(m.group(0)).lstrip("$") for m in _AMOUNT_IN_TEXT.finditer(text.replace(",", ""))}
        return sorted(found - {amount})
    return []


def output_found(required: str, texts: Iterable[str], also_required: Iterable[str] = (), strict: bool = True) -> bool:
    """Whether `required` appears as a whole token sequence in one of `texts` that names no rival value
    (rules above); the task's other required outputs (`also_required`) are never rivals. `strict=False` skips the
    rival and negation rules (the phone's facts, where an answer restates the question's own numbers)."""
    needle = normalize_text(required.strip())
    allowed = {normalize_text(a.strip()).lstrip("$") for a in also_required}
    if not needle:
        return True
    negated = r"(?<!not )(?<!n't )(?<!never )" if strict and needle in ORDER_STATUSES else ""  # "not delivered"
    pattern = re.compile(negated + r"(?<![0-9a-z])" + re.escape(needle) + r"(?![0-9a-z])")
    for text in texts:
        if pattern.search(normalize_text(text)) and not (strict and set(rival_values(needle, text.lower())) - allowed):
            return True
    return False


def is_said_to_user(message: Any) -> bool:
    """Whether a message (a `Message` or its dict) is the agent talking to the user: an assistant
    turn with no tool call that was not an invalid action."""
    get = message.get if isinstance(message, dict) else (lambda key, default=None: getattr(message, key, default))
    return get("role") == "assistant" and not get("tool_calls") and get("invalid") is None


def texts_said(messages: Iterable[Any]) -> list[str]:
    """The texts of every message in which the agent talked to the user, in order."""
    out = []
    for m in messages:
        if is_said_to_user(m):
            out.append(m.get("content", "") if isinstance(m, dict) else m.content)
    return out


def said_to_user(messages: Iterable[Any], required: str, also_required: Iterable[str] = ()) -> bool:
    """Whether the agent told the user `required` anywhere in `messages` (rules above; `also_required`: the
    task's other required outputs, which are no rivals)."""
    return output_found(required, texts_said(messages), also_required)
