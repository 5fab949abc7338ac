"""τ²-bench scenarios as a scripted user's facts: `scenario_from_tau2(task)` flattens τ²'s structured
user instructions into a `UserScenario`.

Reads τ²-bench task JSON (its `user_scenario`); writes nothing. The known info is read mechanically with
regexes (names, zip codes, emails, user ids, order ids such as #W1234567, reservation ids, flight numbers),
the unknown info is kept, and how the user answers a confirmation request is read where the instructions
say so in a recognisable sentence. The deterministic user that plays such a scenario is
`trace_lib.envs.user.ScriptedUser`, used as is; the LLM user is `trace_lib.envs.llm_user`.
"""

from __future__ import annotations

import re
from typing import Any

from trace_lib.records import UserScenario


_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")
_USER_ID = re.compile(r"\b[a-z]+(?:_[a-z]+)+_\d{4}\b")
_ZIP = re.compile(r"\b\d{5}\b")
_ORDER_ID = re.compile(r"#W?\d{7}\b")
_FLIGHT = re.compile(r"\bHAT\d{3}\b")
# Six upper-case letters/digits with at least one of each (EHGLP3, 1N99U6); flight numbers excluded.
_RESERVATION = re.compile(r"\b(?=[A-Z0-9]*\d)(?=[A-Z0-9]*[A-Z])[A-Z0-9]{6}\b")
_NAME = re.compile(
    r"\b(?:[Yy]ou are|[Yy]ou're|[Yy]our? name is|[Mm]y name is|called)[ \t]+"
    r"([A-Z][A-Za-z'-]+)(?:[ \t]+([A-Z][A-Za-z'-]+))?"
)
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
# A sentence of unknown info states not knowing/having/remembering something; anything else in
# that field ("If the agent asks for payment method, say ...") is an instruction.
_NOT_KNOWN = re.compile(r"\b(?:not|never|cannot|no)\b|n't", re.I)
_ASKS_CONFIRM = re.compile(r"\basks?\b[^.]*\bconfirm", re.I)
_NOT_YES = re.compile(
    r"\b(?:do not|don't|not|regret|rethink|another request|only|instead|prefer|keep)\b"
    r"|change (?:your|her|his) mind", re.I)
_CONDITIONAL = re.compile(r"\bonly\b[^.]*\bif\b", re.I)


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text or "") if s.strip() and s.strip() != "."]


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def parse_known_info(known: str, context: str = "") -> dict[str, str]:
    """Fields the user can state, read from τ²'s known info (ids also from the rest of the scenario).

    Keys follow `trace_lib.envs.user` so the scripted user finds them: first_name, last_name, zip,
    email (other_email for a second one), user_id, order_id, reservation_id, flight_number.
    """
    out: dict[str, str] = {}
    name = _NAME.search(known or "")
    if name:
        out["first_name"] = name.group(1)
        if name.group(2):
            out["last_name"] = name.group(2)
    user_ids = _unique(_USER_ID.findall(known or ""))
    if user_ids:
        out["user_id"] = user_ids[0]
        parts = user_ids[0].split("_")[:-1]
        # The user id spells the name (noah_ito_3850): fill a part the sentence left out.
        if len(parts) == 2 and out.get("first_name", parts[0].title()).lower() == parts[0]:
            out.setdefault("first_name", parts[0].title())
            out.setdefault("last_name", parts[1].title())
    zips = _unique(_ZIP.findall(known or ""))
    if zips:
        out["zip"] = zips[0]
    emails = _unique(_EMAIL.findall(known or ""))
    if emails:
        out["email"] = emails[0]
        if len(emails) > 1:
            out["other_email"] = " or ".join(emails[1:])
    everything = f"{known}\n{context}"
    orders = _unique(_ORDER_ID.findall(everything))
    if orders:
        out["order_id"] = " and ".join(orders)
    flights = _unique(_FLIGHT.findall(everything))
    reservations = _unique([r for r in _RESERVATION.findall(everything) if r not in flights])
    if reservations:
        out["reservation_id"] = " and ".join(reservations)
    if flights:
        out["flight_number"] = " and ".join(flights)
    return out


def confirmation_answer(text: str) -> bool:
    """How the user answers 'shall I proceed?': False when a sentence says that, on a request for
    confirmation, the user declines, hesitates or changes the request; True otherwise (also when
    the condition cannot be read mechanically, e.g. 'only if the cost is below $1000')."""
    for sentence in _sentences(text):
        if _ASKS_CONFIRM.search(sentence) and _NOT_YES.search(sentence) and not _CONDITIONAL.search(sentence):
            return False
    return True


def _instructions(task: Any) -> dict[str, Any]:
    """τ²'s structured user instructions from a τ² Task (object or JSON dict)."""
    data = task.model_dump(mode="json") if hasattr(task, "model_dump") else task
    if not isinstance(data, dict):
        raise ValueError(f"expected a τ² task (dict or tau2 Task), got {type(task).__name__}")
    instr = (data.get("user_scenario") or {}).get("instructions")
    if isinstance(instr, str):  # τ² also allows free-text instructions
        return {"reason_for_call": instr, "known_info": None, "unknown_info": None, "task_instructions": ""}
    if not isinstance(instr, dict) or not instr.get("reason_for_call"):
        raise ValueError(f"τ² task {data.get('id')!r}: user_scenario.instructions has no reason_for_call")
    return instr


def scenario_from_tau2(task: Any) -> UserScenario:
    """A `UserScenario` from a τ² task (tau2 Task or its JSON), parsed mechanically (see module doc)."""
    instr = _instructions(task)
    reason = instr["reason_for_call"].strip()
    known = instr.get("known_info") or ""
    task_instructions = (instr.get("task_instructions") or "").strip()
    unknown: list[str] = []
    extra: list[str] = []
    for sentence in _sentences(instr.get("unknown_info") or ""):
        (unknown if _NOT_KNOWN.search(sentence) else extra).append(sentence)
    if extra:
        task_instructions = " ".join([task_instructions, *extra]).strip()
    return UserScenario(
        reason_for_call=reason,
        known_info=parse_known_info(known, f"{reason}\n{task_instructions}"),
        unknown_info=unknown,
        task_instructions=task_instructions,
        confirm=confirmation_answer(f"{reason}\n{task_instructions}"),
    )
