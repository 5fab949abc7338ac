"""The phone's world state and its tools: settings, contacts, messages, reminders, and utilities.

Reads the places dataset shipped next to this file (`places.json`, in place of a web search API);
writes nothing. A `PhoneWorld` is one episode's state; `execute(world, name, arguments)` runs one tool
call on it and returns (observation text, is_error). Tools follow the ToolSandbox design (arXiv
2408.04682): stateful tools over four tables and stateless utilities, with *implicit* dependencies
that the agent only learns from a tool's error:

* sending a message needs cellular service on;
* cellular, wifi and location service cannot be turned on while low battery mode is on, and turning
  low battery mode on turns the three of them off;
* searching places near the phone needs location service on; every web-backed tool (place search,
  currency rates, web search) needs wifi on;
* a setter refuses to set what is already set.

Values are canonical on the tool side: phone numbers are stored as given (the agent must write them as
`+1` and ten digits), timestamps are ISO 8601 strings, units and currencies are closed vocabularies
that refuse other spellings. Two tools do a near-miss of common jobs (`send_email`, `search_web`): the
distraction tools of ToolSandbox's "all tools available" setting, always in the list.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any

from trace_lib.envs.base import ToolSpec

PLACES_PATH = Path(__file__).resolve().parent / "places.json"
SETTINGS = ("cellular", "wifi", "location_service", "low_battery_mode")
DEFAULT_SETTINGS = {"cellular": True, "wifi": True, "location_service": True, "low_battery_mode": False}
"""A world's settings where it names none (a hand-written world may name only some)."""
TABLES = ("settings", "contacts", "messages", "reminders")
ID_COLUMNS = {"contacts": "person_id", "messages": "message_id", "reminders": "reminder_id"}
"""Each row table's id column (ids are `<kind>_<n>`, n from one counter across the tables)."""
ISO = "%Y-%m-%dT%H:%M:%S"
MAX_NUMBER = 1e9
"""Largest magnitude a number argument may have (amounts, shifts): beyond it a call is refused."""

UNITS: dict[str, tuple[str, float, float]] = {
    # unit -> (dimension, factor to the dimension's base unit, offset); base: meter, kilogram, liter, celsius
    "meter": ("length", 1.0, 0.0), "kilometer": ("length", 1000.0, 0.0), "mile": ("length", 1609.344, 0.0),
    "foot": ("length", 0.3048, 0.0), "inch": ("length", 0.0254, 0.0),
    "kilogram": ("mass", 1.0, 0.0), "pound": ("mass", 0.45359237, 0.0), "ounce": ("mass", 0.028349523125, 0.0),
    "liter": ("volume", 1.0, 0.0), "gallon": ("volume", 3.785411784, 0.0),
    "celsius": ("temperature", 1.0, 0.0), "fahrenheit": ("temperature", 5 / 9, -32.0 * 5 / 9),
}
"""Units `unit_conversion` accepts, by their canonical names (singular, lower case)."""
USD_RATES: dict[str, float] = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.0, "CAD": 1.36, "MXN": 17.0,
                               "INR": 83.0}
"""Fixed exchange rates (units per US dollar) behind `convert_currency`: an offline stand-in for a rates API."""


class ToolFailure(Exception):
    """A tool refused the call; `kind` names the failure the way a phone API would (ConnectionError, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class PhoneWorld:
    """One episode's device state. Rows are plain dicts with an id column; `snapshot()` is a deep copy."""

    now: str
    """The device clock (ISO 8601); fixed for the episode."""
    settings: dict[str, bool] = field(default_factory=lambda: dict(DEFAULT_SETTINGS))
    contacts: list[dict[str, Any]] = field(default_factory=list)
    """{person_id, name, phone_number, relationship, is_self}."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """{message_id, recipient_phone_number, content, creation_timestamp}."""
    reminders: list[dict[str, Any]] = field(default_factory=list)
    """{reminder_id, content, reminder_timestamp}."""
    location: tuple[float, float] = (37.3346, -122.0091)
    counter: int = 0
    """Ids handed out so far in this episode (new rows get `<table>_<n>` ids after the initial ones)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PhoneWorld:
        """A world from `to_dict`'s form, or a hand-written one (a synthesized environment's): settings not
        given take their defaults, and without a `counter` new ids continue after the largest given one
        (one counter across the tables, as `new_id` hands them out). A bad shape is a ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"phone world: expected a dict, got {type(data).__name__}")
        data = copy.deepcopy(data)
        known = {f.name for f in fields(cls)}
        if set(data) - known or "now" not in data:
            raise ValueError(f"phone world: keys {sorted(data)}; expected 'now' (ISO 8601) and any of "
                             f"{sorted(known - {'now'})}")
        settings = data.get("settings", {})
        if not isinstance(settings, dict) or set(settings) - set(SETTINGS):
            raise ValueError(f"phone world: settings must map some of {list(SETTINGS)} to true/false, got {settings!r}")
        if set(settings) != set(SETTINGS):
            data["settings"] = {**DEFAULT_SETTINGS, **settings}
        data["location"] = tuple(data.get("location", (37.3346, -122.0091)))
        if "counter" not in data:
            ids = [str(row.get(col, "")) for t, col in ID_COLUMNS.items() for row in data.get(t, [])
                   if isinstance(row, dict)]
            data["counter"] = max((int(m[1]) for i in ids if (m := re.search(r"_(\d+)$", i))), default=0)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["location"] = list(self.location)
        return out

    def snapshot(self) -> dict[str, Any]:
        """The four tables as they stand (what milestones are matched against)."""
        return copy.deepcopy({t: getattr(self, t) for t in TABLES})

    def new_id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}_{self.counter:03d}"


# --- the tools -----------------------------------------------------------------------------------
def _spec(tool: str, description: str, kind: str = "read", required: tuple[str, ...] = (),
          **props: dict[str, Any]) -> ToolSpec:
    return ToolSpec(name=tool, description=description, kind=kind,
                    parameters={"type": "object", "properties": props, "required": list(required)})


_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_NUM = {"type": "number"}


def _setting_tools(setting: str, label: str) -> list[ToolSpec]:
    return [_spec(f"get_{setting}_status", f"Whether {label} is on."),
            _spec(f"set_{setting}_status", f"Turn {label} on or off.", "write", ("on",), on=_BOOL)]


@lru_cache(maxsize=1)
def phone_tool_specs() -> tuple[ToolSpec, ...]:
    """Every tool of the phone environment, in the order the agent sees them."""
    phone = {"type": "string", "description": "+1 followed by 10 digits, e.g. +14155550132"}
    when = {"type": "string", "description": "ISO 8601, e.g. 2026-03-14T17:00:00"}
    return (
        *_setting_tools("cellular_service", "cellular service"),
        *_setting_tools("wifi", "wifi"),
        *_setting_tools("location_service", "location service"),
        *_setting_tools("low_battery_mode", "low battery mode"),
        _spec("search_contacts", "Find contacts by name, phone number or relationship; returns their person_id.",
              name=_STR, phone_number=phone, relationship=_STR),
        _spec("add_contact", "Add a contact.", "write", ("name", "phone_number"), name=_STR, phone_number=phone,
              relationship=_STR),
        _spec("modify_contact", "Change a contact's name, phone number or relationship.", "write", ("person_id",),
              person_id=_STR, name=_STR, phone_number=phone, relationship=_STR),
        _spec("remove_contact", "Delete a contact.", "write", ("person_id",), person_id=_STR),
        _spec("send_message_with_phone_number", "Send a text message to a phone number.", "write",
              ("phone_number", "content"), phone_number=phone, content=_STR),
        _spec("search_messages", "Find sent messages by recipient phone number or content.",
              phone_number=phone, content=_STR),
        _spec("add_reminder", "Add a reminder at a time.", "write", ("content", "reminder_timestamp"),
              content=_STR, reminder_timestamp=when),
        _spec("search_reminder", "Find reminders by content.", content=_STR),
        _spec("remove_reminder", "Delete a reminder.", "write", ("reminder_id",), reminder_id=_STR),
        _spec("get_current_timestamp", "The current date and time (ISO 8601).", "generic"),
        _spec("shift_timestamp", "Add days, hours and minutes to a timestamp.", "generic", ("timestamp",),
              timestamp=when, days=_NUM, hours=_NUM, minutes=_NUM),
        _spec("unit_conversion", "Convert an amount between units: " + ", ".join(UNITS) + ".", "generic",
              ("amount", "from_unit", "to_unit"), amount=_NUM, from_unit=_STR, to_unit=_STR),
        _spec("convert_currency", "Convert money between currencies given as ISO codes (USD, EUR, ...).",
              "generic", ("amount", "from_currency", "to_currency"), amount=_NUM, from_currency=_STR,
              to_currency=_STR),
        _spec("search_places", "Find places near the phone's location by name or kind (e.g. cafe).", "generic",
              ("query",), query=_STR),
        _spec("send_email", "Send an email.", "write", ("address", "subject", "body"), address=_STR,
              subject=_STR, body=_STR),
        _spec("search_web", "Search the web.", "generic", ("query",), query=_STR),
    )


def tool_kinds() -> dict[str, str]:
    return {t.name: t.kind for t in phone_tool_specs()}


@lru_cache(maxsize=1)
def _specs_by_name() -> dict[str, ToolSpec]:
    return {t.name: t for t in phone_tool_specs()}


@lru_cache(maxsize=1)
def load_places() -> tuple[dict[str, Any], ...]:
    """The shipped place dataset: {name, kind, address, phone_number, rating, distance_km}."""
    return tuple(json.loads(PLACES_PATH.read_text(encoding="utf-8")))


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def _args(arguments: dict[str, Any], spec: ToolSpec) -> dict[str, Any]:
    """The call's arguments checked against the schema: unknown, missing and mistyped ones refused."""
    props = spec.parameters["properties"]
    extra = sorted(set(arguments) - set(props))
    if extra:
        raise ToolFailure("TypeError", f"unexpected argument(s) for {spec.name}: {', '.join(extra)}")
    missing = [k for k in spec.parameters["required"] if arguments.get(k) is None]
    if missing:
        raise ToolFailure("TypeError", f"missing argument(s) for {spec.name}: {', '.join(missing)}")
    out = {}
    for key, value in arguments.items():
        kind = props[key]["type"]
        if value is None:
            continue
        if kind == "boolean" and not isinstance(value, bool):
            if str(value).lower() not in ("true", "false"):
                raise ToolFailure("TypeError", f"{key} must be true or false, got {value!r}")
            value = str(value).lower() == "true"
        elif kind == "number":
            try:
                value = float(value) if not isinstance(value, bool) else None
            except (TypeError, ValueError, OverflowError):
                value = None
            if value is None or not math.isfinite(value) or abs(value) > MAX_NUMBER:
                raise ToolFailure("TypeError", f"{key} must be a finite number of at most {MAX_NUMBER:g}, "
                                               f"got {arguments[key]!r}")
        elif kind == "string" and not isinstance(value, str):
            value = str(value)
        out[key] = value
    return out


def _parse_time(text: str, key: str) -> datetime:
    try:
        return datetime.strptime(text, ISO)
    except ValueError:
        raise ToolFailure("ValueError", f"{key} must be an ISO 8601 timestamp like 2026-03-14T17:00:00, "
                                        f"got {text!r}") from None


def _set_setting(world: PhoneWorld, setting: str, on: bool) -> str:
    label = setting.replace("_", " ")
    if world.settings[setting] == on:
        raise ToolFailure("ValueError", f"{label} is already {'on' if on else 'off'}")
    if on and setting != "low_battery_mode" and world.settings["low_battery_mode"]:
        raise ToolFailure("PermissionError", f"cannot turn on {label} while low battery mode is on")
    world.settings[setting] = on
    if setting == "low_battery_mode" and on:
        for other in ("cellular", "wifi", "location_service"):
            world.settings[other] = False
    return _dump({"status": "ok", setting: on})


def _need(world: PhoneWorld, setting: str, kind: str, what: str) -> None:
    if not world.settings[setting]:
        raise ToolFailure(kind, f"{setting.replace('_', ' ')} is off; {what}")


def _matches(text: str | None, query: str) -> bool:
    return query.lower() in (text or "").lower()


def _search_contacts(world: PhoneWorld, a: dict[str, Any]) -> str:
    if not a:
        raise ToolFailure("ValueError", "give at least one of name, phone_number, relationship")
    rows = [c for c in world.contacts
            if (a.get("name") is None or _matches(c["name"], a["name"]))
            and (a.get("phone_number") is None or c["phone_number"] == a["phone_number"])
            and (a.get("relationship") is None or _matches(c.get("relationship"), a["relationship"]))]
    return _dump(rows)


def _contact(world: PhoneWorld, person_id: str) -> dict[str, Any]:
    for c in world.contacts:
        if c["person_id"] == person_id:
            return c
    raise ToolFailure("KeyError", f"no contact with person_id {person_id!r}")


def _add_contact(world: PhoneWorld, a: dict[str, Any]) -> str:
    row = {"person_id": world.new_id("person"), "name": a["name"], "phone_number": a["phone_number"],
           "relationship": a.get("relationship"), "is_self": False}
    world.contacts.append(row)
    return _dump(row)


def _modify_contact(world: PhoneWorld, a: dict[str, Any]) -> str:
    row = _contact(world, a["person_id"])
    changes = {k: a[k] for k in ("name", "phone_number", "relationship") if k in a}
    if not changes:
        raise ToolFailure("ValueError", "nothing to change: give name, phone_number or relationship")
    row.update(changes)
    return _dump(row)


def _remove_contact(world: PhoneWorld, a: dict[str, Any]) -> str:
    row = _contact(world, a["person_id"])
    world.contacts.remove(row)
    return _dump({"status": "removed", "person_id": row["person_id"]})


def _send_message(world: PhoneWorld, a: dict[str, Any]) -> str:
    _need(world, "cellular", "ConnectionError", "the message cannot be sent")
    row = {"message_id": world.new_id("message"), "recipient_phone_number": a["phone_number"],
           "content": a["content"], "creation_timestamp": world.now}
    world.messages.append(row)
    return _dump(row)


def _search_messages(world: PhoneWorld, a: dict[str, Any]) -> str:
    rows = [m for m in world.messages
            if (a.get("phone_number") is None or m["recipient_phone_number"] == a["phone_number"])
            and (a.get("content") is None or _matches(m["content"], a["content"]))]
    return _dump(rows)


def _add_reminder(world: PhoneWorld, a: dict[str, Any]) -> str:
    _parse_time(a["reminder_timestamp"], "reminder_timestamp")
    row = {"reminder_id": world.new_id("reminder"), "content": a["content"],
           "reminder_timestamp": a["reminder_timestamp"]}
    world.reminders.append(row)
    return _dump(row)


def _search_reminder(world: PhoneWorld, a: dict[str, Any]) -> str:
    return _dump([r for r in world.reminders if a.get("content") is None or _matches(r["content"], a["content"])])


def _remove_reminder(world: PhoneWorld, a: dict[str, Any]) -> str:
    for r in world.reminders:
        if r["reminder_id"] == a["reminder_id"]:
            world.reminders.remove(r)
            return _dump({"status": "removed", "reminder_id": r["reminder_id"]})
    raise ToolFailure("KeyError", f"no reminder with reminder_id {a['reminder_id']!r}")


def _shift(world: PhoneWorld, a: dict[str, Any]) -> str:
    start = _parse_time(a["timestamp"], "timestamp")
    minutes = a.get("days", 0.0) * 1440 + a.get("hours", 0.0) * 60 + a.get("minutes", 0.0)
    if abs(minutes) > 3650 * 1440:
        raise ToolFailure("ValueError", "shift by at most ten years")
    try:
        return _dump({"timestamp": (start + timedelta(minutes=minutes)).strftime(ISO)})
    except OverflowError:
        raise ToolFailure("ValueError", "the shifted time is out of range") from None


def convert_units(amount: float, from_unit: str, to_unit: str) -> float:
    """`amount` in `to_unit`, rounded to 2 decimals (what `unit_conversion` returns)."""
    for unit in (from_unit, to_unit):
        if unit not in UNITS:
            raise ToolFailure("ValueError", f"unknown unit {unit!r}; use one of: {', '.join(UNITS)}")
    (dim_a, fa, oa), (dim_b, fb, ob) = UNITS[from_unit], UNITS[to_unit]
    if dim_a != dim_b:
        raise ToolFailure("ValueError", f"cannot convert {dim_a} ({from_unit}) to {dim_b} ({to_unit})")
    return round(((amount * fa + oa) - ob) / fb, 2)


def convert_money(amount: float, from_currency: str, to_currency: str) -> float:
    """`amount` in `to_currency` at the fixed rates, rounded to 2 decimals (what `convert_currency` returns)."""
    for code in (from_currency, to_currency):
        if code not in USD_RATES:
            raise ToolFailure("ValueError", f"unknown currency {code!r}; use one of: {', '.join(USD_RATES)}")
    return round(amount / USD_RATES[from_currency] * USD_RATES[to_currency], 2)


def _unit_conversion(world: PhoneWorld, a: dict[str, Any]) -> str:
    return _dump({"amount": convert_units(a["amount"], a["from_unit"], a["to_unit"]), "unit": a["to_unit"]})


def _convert_currency(world: PhoneWorld, a: dict[str, Any]) -> str:
    _need(world, "wifi", "ConnectionError", "exchange rates cannot be fetched")
    value = convert_money(a["amount"], a["from_currency"], a["to_currency"])
    return _dump({"amount": value, "currency": a["to_currency"]})


def find_places(query: str) -> list[dict[str, Any]]:
    """Places whose name or kind contains a word of `query`, nearest first, at most 3."""
    words = [w for w in query.lower().split() if len(w) > 2] or [query.lower()]
    hits = [p for p in load_places() if any(w in p["name"].lower() or w in p["kind"] for w in words)]
    return sorted(hits, key=lambda p: (p["distance_km"], p["name"]))[:3]


def _search_places(world: PhoneWorld, a: dict[str, Any]) -> str:
    _need(world, "wifi", "ConnectionError", "places cannot be searched")
    _need(world, "location_service", "PermissionError", "the phone's location is unknown")
    return _dump(find_places(a["query"]))


def _send_email(world: PhoneWorld, a: dict[str, Any]) -> str:
    _need(world, "wifi", "ConnectionError", "the email cannot be sent")
    return _dump({"status": "sent", "address": a["address"]})


def _search_web(world: PhoneWorld, a: dict[str, Any]) -> str:
    _need(world, "wifi", "ConnectionError", "the web cannot be searched")
    return _dump([])


def _handlers() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for setting in ("cellular_service", "wifi", "location_service", "low_battery_mode"):
        key = "cellular" if setting == "cellular_service" else setting
        out[f"get_{setting}_status"] = lambda w, a, key=key: _dump({key: w.settings[key]})
        out[f"set_{setting}_status"] = lambda w, a, key=key: _set_setting(w, key, a["on"])
    out.update({
        "search_contacts": _search_contacts, "add_contact": _add_contact, "modify_contact": _modify_contact,
        "remove_contact": _remove_contact, "send_message_with_phone_number": _send_message,
        "search_messages": _search_messages, "add_reminder": _add_reminder, "search_reminder": _search_reminder,
        "remove_reminder": _remove_reminder, "get_current_timestamp": lambda w, a: _dump({"timestamp": w.now}),
        "shift_timestamp": _shift, "unit_conversion": _unit_conversion, "convert_currency": _convert_currency,
        "search_places": _search_places, "send_email": _send_email, "search_web": _search_web,
    })
    return out


_HANDLERS = _handlers()


def execute(world: PhoneWorld, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    """Run one tool call on `world` (changing it in place); a refusal is an error observation."""
    specs = _specs_by_name()
    if name not in specs:
        return f"Error: unknown tool '{name}'", True
    if not isinstance(arguments, dict):
        return f"Error: TypeError: arguments must be an object, got {type(arguments).__name__}", True
    try:
        return _HANDLERS[name](world, _args(arguments, specs[name])), False
    except ToolFailure as err:
        return f"Error: {err.kind}: {err}", True
    except Exception as err:  # a bug of ours must not end an episode or a reward request: it is an observation
        return f"Error: {type(err).__name__}: {err}", True
