"""Procedural, seeded scenarios of the phone environment, in ToolSandbox's categories.

Reads the `env` params section; writes nothing, returns `Task` records. Each family below writes one
kind of request over a seeded world (contacts, past messages, reminders, settings, clock), with the
ground truth the rest of the pipeline needs: milestones and minefields (`milestones.py`), the
reference solution (`meta.reference`: the calls and messages of a perfect run; `gold_actions` are its
calls), ToolSandbox's scenario categories (`meta.categories`) and capability tags.

Categories (a scenario has several): single_tool_call / multiple_tool_call, single_user_turn /
multiple_user_turn, state_dependency (a setting must be changed first; the agent learns it from the
tool's error), canonicalization (relative dates, phone-number formats, unit and currency names),
insufficient_information (the right behaviour is to not act: no milestones, minefields on the harmful
calls) and distraction_tools (a near-miss tool in the list, calling it is a minefield).

Determinism and split: scenario i of a family and split draws everything from
`random.Random(f"{seed}:{family}:{split}:{i}")`, so the splits never share a seed and scenario i does
not change when `tasks_per_family` grows.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from trace_lib.config import EnvConfig
from trace_lib.envs.phone.milestones import Constraint, Milestone
from trace_lib.envs.phone.world import ISO, PhoneWorld, convert_money, convert_units, find_places, load_places
from trace_lib.records import Task, ToolCall, UserScenario

SPLITS = ("train", "test")
CATEGORIES = ("single_tool_call", "multiple_tool_call", "single_user_turn", "multiple_user_turn",
              "state_dependency", "canonicalization", "insufficient_information", "distraction_tools")

FIRST = ("Alice", "Bruno", "Chen", "Dana", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Keiko", "Liam",
         "Maya", "Nikos", "Olga", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf")
LAST = ("Adams", "Baker", "Costa", "Diaz", "Evans", "Fischer", "Garcia", "Huang", "Ito", "Jensen", "Kim",
        "Lopez", "Moreau", "Novak", "Okafor", "Patel", "Rossi", "Silva", "Tanaka", "Weber")
RELATIONSHIPS = ("friend", "coworker", "sister", "brother", "mother", "father", "neighbor", "boss")
MESSAGES = ("Running late, see you at seven", "Can you pick up milk on the way home",
            "Happy birthday, have a great day", "The meeting moved to three o'clock",
            "I left the keys under the mat", "Dinner is ready whenever you are",
            "Call me when you land", "Thanks for your help today")
CHORES = ("call the dentist", "pay the electricity bill", "water the plants", "pick up the dry cleaning",
          "book a haircut", "take out the recycling", "buy a birthday card", "renew the library books")
SETTING_LABELS = {"cellular": "cellular service", "wifi": "wifi", "location_service": "location services",
                  "low_battery_mode": "low battery mode"}
SETTING_TOOLS = {"cellular": "cellular_service", "wifi": "wifi", "location_service": "location_service",
                 "low_battery_mode": "low_battery_mode"}


# --- building blocks ------------------------------------------------------------------------------
def canonical_number(rng: random.Random) -> str:
    return f"+1{rng.choice(['408', '415', '650', '510'])}555{rng.randrange(100, 10000):04d}"


def spoken_number(number: str, rng: random.Random) -> str:
    """A canonical +1 number the way people write it (never the canonical form itself)."""
    area, mid, last = number[2:5], number[5:8], number[8:]
    return rng.choice([f"({area}) {mid}-{last}", f"{area}-{mid}-{last}", f"{area}.{mid}.{last}",
                       f"{area} {mid} {last}", f"1-{area}-{mid}-{last}"])


def make_world(rng: random.Random, contacts: int = 5) -> tuple[PhoneWorld, list[dict[str, Any]]]:
    """A seeded phone: the owner, `contacts` others (distinct names and numbers), two past messages,
    one reminder, every setting on but low battery mode; and the non-owner contacts."""
    start = datetime(2026, 1, 5, 8, 0) + timedelta(days=rng.randrange(0, 300), minutes=15 * rng.randrange(0, 48))
    world = PhoneWorld(now=start.strftime(ISO))
    # first names distinct: requests name people by first name, and the user cannot say which of two is meant
    names = [f"{first} {rng.choice(LAST)}" for first in rng.sample(FIRST, contacts + 1)]
    numbers: set[str] = set()
    while len(numbers) < contacts + 1:
        numbers.add(canonical_number(rng))
    for k, (name, number) in enumerate(zip(names, sorted(numbers), strict=True)):
        world.contacts.append({"person_id": world.new_id("person"), "name": name, "phone_number": number,
                               "relationship": None if k == 0 else rng.choice(RELATIONSHIPS), "is_self": k == 0})
    others = world.contacts[1:]
    for c in rng.sample(others, 2):
        world.messages.append({"message_id": world.new_id("message"), "recipient_phone_number": c["phone_number"],
                               "content": rng.choice(MESSAGES),
                               "creation_timestamp": (start - timedelta(hours=rng.randrange(2, 48))).strftime(ISO)})
    world.reminders.append({"reminder_id": world.new_id("reminder"), "content": rng.choice(CHORES),
                            "reminder_timestamp": (start + timedelta(days=rng.randrange(2, 9))).strftime(ISO)})
    return world, others


def call(tool: str, **arguments: Any) -> dict[str, Any]:
    return {"call": {"name": tool, "arguments": arguments}}


def say(text: str) -> dict[str, Any]:
    return {"say": text}


def c_call(tool: str, **args: Any) -> Constraint:
    return Constraint(kind="call", tool=tool, args=args)


def m(*constraints: Constraint, after: tuple[int, ...] = ()) -> Milestone:
    return Milestone(constraints=list(constraints), after=list(after))


def chain(*milestones: Milestone) -> list[Milestone]:
    """Milestones in order, each after the one before (ToolSandbox's default DAG)."""
    return [x if i == 0 or x.after else x.model_copy(update={"after": [i - 1]}) for i, x in enumerate(milestones)]


@dataclass(frozen=True)
class Scenario:
    opening: str
    instruction: str
    world: PhoneWorld
    milestones: list[Milestone]
    reference: list[dict[str, Any]]
    categories: tuple[str, ...]
    tags: tuple[str, ...]
    minefields: tuple[Constraint, ...] = ()
    known_info: dict[str, str] | None = None
    unknown_info: tuple[str, ...] = ()
    task_instructions: str = ""
    facts: tuple[str, ...] = ()


def _enable_steps(world: PhoneWorld, *settings: str) -> tuple[list[dict[str, Any]], list[Milestone]]:
    """Reference calls and milestones that turn `settings` on, in order, from the world's state (low
    battery mode off first)."""
    steps: list[dict[str, Any]] = []
    marks: list[Milestone] = []
    if world.settings["low_battery_mode"]:
        steps.append(call("set_low_battery_mode_status", on=False))
        marks.append(m(Constraint(kind="setting", values={"low_battery_mode": False})))
    for setting in settings:
        if not world.settings[setting]:
            steps.append(call(f"set_{SETTING_TOOLS[setting]}_status", on=True))
            marks.append(m(Constraint(kind="setting", values={setting: True})))
    return steps, marks


def _switch_off(world: PhoneWorld, setting: str, battery: bool) -> None:
    """Turn `setting` off, and low battery mode on (which turns cellular, wifi and location off) if asked."""
    if battery:
        world.settings.update(low_battery_mode=True, cellular=False, wifi=False, location_service=False)
    else:
        world.settings[setting] = False


# --- families -------------------------------------------------------------------------------------
def _check_setting(rng: random.Random, level: int) -> Scenario:
    world, _ = make_world(rng)
    setting = rng.choice(list(SETTING_LABELS))
    value = rng.random() < 0.5
    world.settings[setting] = value
    if setting == "low_battery_mode" and value:
        world.settings.update(cellular=False, wifi=False, location_service=False)
    word = "on" if value else "off"
    label = SETTING_LABELS[setting]
    tool = f"get_{SETTING_TOOLS[setting]}_status"
    return Scenario(
        opening=rng.choice([f"Is my {label} on right now?", f"Can you check whether {label} is on?"]),
        instruction=f"The user asks whether {label} is on; the agent reads it and says it is {word}.",
        world=world, milestones=chain(m(c_call(tool)), m(Constraint(kind="said", facts=[f"is {word}"]))),
        reference=[call(tool), say(f"Your {label} is {word}.")],
        categories=("single_tool_call", "single_user_turn"), tags=("communicate_result",), facts=(f"is {word}",))


def _toggle_setting(rng: random.Random, level: int) -> Scenario:
    world, _ = make_world(rng)
    setting = rng.choice(["cellular", "wifi", "location_service"])
    on = rng.random() < 0.5
    world.settings[setting] = not on
    label, word = SETTING_LABELS[setting], "on" if on else "off"
    return Scenario(
        opening=rng.choice([f"Please turn {word} my {label}.", f"Could you switch {label} {word}?"]),
        instruction=f"The user wants {label} {word}; the agent sets it.",
        world=world, milestones=[m(Constraint(kind="setting", values={setting: on}))],
        reference=[call(f"set_{SETTING_TOOLS[setting]}_status", on=on), say(f"Done, {label} is now {word}.")],
        categories=("single_tool_call", "single_user_turn"), tags=("tool_call_precision",))


def _setting_dependency(rng: random.Random, level: int) -> Scenario:
    world, _ = make_world(rng)
    setting = rng.choice(["cellular", "wifi", "location_service"])
    _switch_off(world, setting, battery=True)
    label = SETTING_LABELS[setting]
    steps, marks = _enable_steps(world, setting)
    return Scenario(
        opening=rng.choice([f"Turn on my {label}, please.", f"I need {label} on."]),
        instruction=f"The user wants {label} on; low battery mode blocks it, so the agent turns that off first.",
        world=world, milestones=chain(*marks), reference=[*steps, say(f"{label.capitalize()} is on now.")],
        categories=("multiple_tool_call", "single_user_turn", "state_dependency"),
        tags=("state_dependency_resolution",))


def _message_scenario(rng: random.Random, blocked: int, multi_turn: bool, distract: bool) -> Scenario:
    world, others = make_world(rng)
    person = rng.choice(others)
    text = rng.choice(MESSAGES)
    if blocked:
        _switch_off(world, "cellular", battery=blocked > 1)
    steps, marks = _enable_steps(world, "cellular")
    name = person["name"]
    first = name.split()[0]
    sent = Constraint(kind="added", table="messages",
                      row={"recipient_phone_number": person["phone_number"], "content": text})
    milestones = [m(c_call("search_contacts"))]
    for k, mark in enumerate(marks):
        milestones.append(mark.model_copy(update={"after": [len(milestones) - 1] if k else []}))
    milestones.append(m(sent, after=(0, len(milestones) - 1) if marks else (0,)))
    reference: list[dict[str, Any]] = []
    known: dict[str, str] | None = None
    if multi_turn:
        opening = rng.choice(["I'd like to send a text message.", "Can you send a message for me?"])
        known = {"recipient": name, "message": text}
        reference.append(say("Sure. Who is the message for? And what would you like it to say?"))
    else:
        opening = rng.choice([f"Send a message to {first} saying \"{text}\".", f"Text {first}: \"{text}\""])
    reference += [call("search_contacts", name=first), *steps,
                  call("send_message_with_phone_number", phone_number=person["phone_number"], content=text),
                  say(f"I sent your message to {name}.")]
    categories = ["multiple_tool_call", "multiple_user_turn" if multi_turn else "single_user_turn"]
    tags = ["multi_step_completion", "tool_call_precision"]
    if blocked:
        categories.append("state_dependency")
        tags.insert(0, "state_dependency_resolution")
    if multi_turn:
        tags.insert(0, "missing_information_handling")
    minefields: tuple[Constraint, ...] = ()
    if distract:
        categories.append("distraction_tools")
        minefields = (Constraint(kind="call", tool="send_email"),)
    where = " (cellular is off" + (", low battery mode on)" if blocked > 1 else ")") if blocked else ""
    return Scenario(
        opening=opening, world=world, milestones=milestones, reference=reference,
        instruction=f"The user wants a text to {name}{where}; the agent finds the number and sends \"{text}\".",
        categories=tuple(categories), tags=tuple(tags), minefields=minefields, known_info=known)


def _send_message(rng: random.Random, level: int) -> Scenario:
    return _message_scenario(rng, blocked=0, multi_turn=False, distract=rng.random() < 0.5)


def _send_message_blocked(rng: random.Random, level: int) -> Scenario:
    return _message_scenario(rng, blocked=rng.choice([1, 2]), multi_turn=False, distract=False)


def _send_message_multiturn(rng: random.Random, level: int) -> Scenario:
    return _message_scenario(rng, blocked=0, multi_turn=True, distract=False)


def _add_contact(rng: random.Random, level: int) -> Scenario:
    world, _ = make_world(rng)
    taken = {c["name"] for c in world.contacts}
    name = rng.choice([f"{f} {last}" for f in FIRST for last in LAST if f"{f} {last}" not in taken])
    number = canonical_number(rng)
    spoken = spoken_number(number, rng)
    return Scenario(
        opening=rng.choice([f"Add {name} to my contacts, the number is {spoken}.",
                            f"Please save a new contact: {name}, {spoken}."]),
        instruction=f"The user gives {name}'s number as {spoken}; the agent saves it as {number}.",
        world=world,
        milestones=[m(Constraint(kind="added", table="contacts", row={"name": name, "phone_number": number}))],
        reference=[call("add_contact", name=name, phone_number=number), say(f"I added {name} to your contacts.")],
        categories=("single_tool_call", "single_user_turn", "canonicalization"),
        tags=("argument_canonicalization",))


def _update_contact(rng: random.Random, level: int) -> Scenario:
    world, others = make_world(rng)
    person = rng.choice(others)
    first = person["name"].split()[0]
    number = canonical_number(rng)
    spoken = spoken_number(number, rng)
    pid = person["person_id"]
    return Scenario(
        opening=rng.choice([f"{first} has a new number, {spoken}. Please modify the contact.",
                            f"Please modify {first}'s contact: the new number is {spoken}."]),
        instruction=f"The user gives {person['name']}'s new number as {spoken}; the agent finds the contact and "
                    f"changes its number to {number}.",
        world=world,
        milestones=chain(m(c_call("search_contacts")),
                         m(Constraint(kind="updated", table="contacts", row={"person_id": pid,
                                                                             "phone_number": number}))),
        reference=[call("search_contacts", name=first), call("modify_contact", person_id=pid, phone_number=number),
                   say(f"I updated {person['name']}'s number.")],
        categories=("multiple_tool_call", "single_user_turn", "canonicalization"),
        tags=("argument_canonicalization", "multi_step_completion"), task_instructions="modify the contact")


def _relative_reminder(rng: random.Random, level: int, multi_turn: bool = False) -> Scenario:
    world, _ = make_world(rng)
    now = datetime.strptime(world.now, ISO)
    chore = rng.choice(CHORES)
    kind = rng.choice(["tomorrow", "hours", "weekday"])
    if kind == "tomorrow":
        hour = rng.choice([9, 12, 17, 19])
        when = (now + timedelta(days=1)).replace(hour=hour, minute=0, second=0)
        spoken = f"tomorrow at {hour % 12 or 12} {'am' if hour < 12 else 'pm'}"
    elif kind == "hours":
        hours = rng.choice([1, 2, 3, 4])
        when = now + timedelta(hours=hours)
        spoken = f"in {hours} hour{'s' if hours > 1 else ''}"
    else:
        days = rng.randrange(2, 7)
        when = (now + timedelta(days=days)).replace(hour=10, minute=0, second=0)
        spoken = f"on {when.strftime('%A')} at 10 am"
    stamp = when.strftime(ISO)
    opening = rng.choice([f"Remind me to {chore} {spoken}.", f"Set a reminder {spoken} to {chore}."])
    ask: list[dict[str, Any]] = []
    if multi_turn:
        opening = rng.choice(["Can you set a reminder for me?", "I need a reminder."])
        ask = [say("Sure. What would you like to be reminded about? And when?")]
    return Scenario(
        opening=opening,
        instruction=f"The user wants a reminder to {chore} {spoken}" + (" (said only when asked)" if multi_turn else "")
                    + f"; the agent reads the clock and sets it for {stamp}.",
        world=world,
        milestones=chain(m(c_call("get_current_timestamp")),
                         m(Constraint(kind="added", table="reminders",
                                      row={"content": chore, "reminder_timestamp": stamp}))),
        reference=[*ask, call("get_current_timestamp"), call("add_reminder", content=chore, reminder_timestamp=stamp),
                   say(f"I set a reminder to {chore} for {stamp}.")],
        categories=("multiple_tool_call", "multiple_user_turn" if multi_turn else "single_user_turn",
                    "canonicalization"),
        tags=(("missing_information_handling",) if multi_turn else ()) + ("argument_canonicalization",
                                                                           "multi_step_completion"),
        known_info={"reminder": chore, "time": spoken} if multi_turn else None)


def _reminder_multiturn(rng: random.Random, level: int) -> Scenario:
    return _relative_reminder(rng, level, multi_turn=True)


UNIT_ASKS = (("mile", "kilometer", "miles", "kilometers"), ("kilometer", "mile", "km", "miles"),
             ("pound", "kilogram", "pounds", "kilos"), ("kilogram", "pound", "kg", "pounds"),
             ("fahrenheit", "celsius", "degrees Fahrenheit", "Celsius"), ("gallon", "liter", "gallons", "liters"),
             ("foot", "meter", "feet", "meters"), ("inch", "meter", "inches", "meters"))
CURRENCIES = {"USD": "dollars", "EUR": "euros", "GBP": "pounds sterling", "JPY": "yen", "CAD": "Canadian dollars",
              "MXN": "Mexican pesos", "INR": "rupees"}


def _convert_units(rng: random.Random, level: int) -> Scenario:
    world, _ = make_world(rng)
    src, dst, said_src, said_dst = rng.choice(UNIT_ASKS)
    amount = float(rng.choice([3, 5, 12, 26.2, 40, 72, 100, 150]))
    result = convert_units(amount, src, dst)
    answer = f"{result:.2f}"
    return Scenario(
        opening=rng.choice([f"How many {said_dst} is {amount:g} {said_src}?",
                            f"Convert {amount:g} {said_src} to {said_dst}."]),
        instruction=f"The user asks for {amount:g} {said_src} in {said_dst}; the agent converts ({src} to {dst}) "
                    f"and says {answer}.",
        world=world,
        milestones=chain(m(c_call("unit_conversion", amount=amount, from_unit=src, to_unit=dst)),
                         m(Constraint(kind="said", facts=[answer]))),
        reference=[call("unit_conversion", amount=amount, from_unit=src, to_unit=dst),
                   say(f"{amount:g} {said_src} is {answer} {said_dst}.")],
        categories=("single_tool_call", "single_user_turn", "canonicalization"),
        tags=("argument_canonicalization", "communicate_result"), facts=(answer,))


def _convert_currency(rng: random.Random, level: int) -> Scenario:
    world, _ = make_world(rng)
    src, dst = rng.sample(list(CURRENCIES), 2)
    amount = float(rng.choice([20, 50, 75, 120, 300, 1000]))
    blocked = rng.random() < 0.5
    if blocked:
        world.settings["wifi"] = False
    steps, marks = _enable_steps(world, "wifi")
    answer = f"{convert_money(amount, src, dst):.2f}"
    categories = ["single_tool_call" if not blocked else "multiple_tool_call", "single_user_turn",
                  "canonicalization"]
    tags = ["argument_canonicalization", "communicate_result"]
    if blocked:
        categories.append("state_dependency")
        tags.insert(0, "state_dependency_resolution")
    return Scenario(
        opening=rng.choice([f"How much is {amount:g} {CURRENCIES[src]} in {CURRENCIES[dst]}?",
                            f"Convert {amount:g} {CURRENCIES[src]} to {CURRENCIES[dst]} for me."]),
        instruction=f"The user asks for {amount:g} {src} in {dst}" + (" (wifi is off)" if blocked else "")
                    + f"; the agent converts and says {answer}.",
        world=world,
        milestones=chain(*marks, m(c_call("convert_currency", amount=amount, from_currency=src, to_currency=dst)),
                         m(Constraint(kind="said", facts=[answer]))),
        reference=[*steps, call("convert_currency", amount=amount, from_currency=src, to_currency=dst),
                   say(f"{amount:g} {CURRENCIES[src]} is {answer} {CURRENCIES[dst]}.")],
        categories=tuple(categories), tags=tuple(tags), facts=(answer,))


PLACE_KINDS = ("cafe", "pharmacy", "gas station", "bakery", "gym", "park", "bank", "library", "grocery store")


def _nearby_place(rng: random.Random, level: int) -> Scenario:
    world, _ = make_world(rng)
    kind = rng.choice(PLACE_KINDS)
    nearest = find_places(kind)[0]
    blocked = rng.choice(["location_service", "location_service", "battery"])
    if blocked == "battery":
        _switch_off(world, "location_service", battery=True)
    else:
        world.settings["location_service"] = False
    steps, marks = _enable_steps(world, "location_service", "wifi")
    return Scenario(
        opening=rng.choice([f"What's the closest {kind} to me?", f"Find the nearest {kind}, what is it called?"]),
        instruction=f"The user asks for the nearest {kind} (location services off"
                    + (", low battery mode on" if blocked == "battery" else "")
                    + f"); the agent enables what the search needs, searches, and says {nearest['name']}.",
        world=world,
        milestones=chain(*marks, m(c_call("search_places")),
                         m(Constraint(kind="said", facts=[nearest["name"]]))),
        reference=[*steps, call("search_places", query=kind),
                   say(f"The nearest {kind} is {nearest['name']}, {nearest['distance_km']} km away.")],
        categories=("multiple_tool_call", "single_user_turn", "state_dependency"),
        tags=("state_dependency_resolution", "communicate_result"), facts=(nearest["name"],))


def _contact_lookup(rng: random.Random, level: int) -> Scenario:
    world, others = make_world(rng)
    person = rng.choice(others)
    first = person["name"].split()[0]
    number = person["phone_number"]
    return Scenario(
        opening=rng.choice([f"What's {first}'s phone number?", f"Can you look up {first}'s number for me?"]),
        instruction=f"The user asks for {person['name']}'s number; the agent reads the contacts (not the web) and "
                    f"says {number}.",
        world=world,
        milestones=chain(m(c_call("search_contacts")), m(Constraint(kind="said", facts=[number]))),
        reference=[call("search_contacts", name=first), say(f"{person['name']}'s number is {number}.")],
        minefields=(Constraint(kind="call", tool="search_web"),),
        categories=("single_tool_call", "single_user_turn", "distraction_tools"),
        tags=("tool_call_precision", "communicate_result"), facts=(number,))


def _unknown_contact(rng: random.Random, level: int) -> Scenario:
    world, _ = make_world(rng)
    taken = {c["name"].split()[0] for c in world.contacts}
    first = rng.choice([f for f in FIRST if f not in taken])
    text = rng.choice(MESSAGES)
    return Scenario(
        opening=f"Send a message to {first} saying \"{text}\".",
        instruction=f"The user wants a text to {first}, who is not in the contacts, and does not know the number; "
                    "the agent must not send anything and says it cannot.",
        world=world, milestones=[],
        reference=[call("search_contacts", name=first),
                   say(f"I couldn't find {first} in your contacts, so I can't send the message without a number.")],
        minefields=(Constraint(kind="added", table="messages"), Constraint(kind="added", table="contacts")),
        unknown_info=("phone number",),
        categories=("insufficient_information", "single_user_turn"), tags=("missing_information_handling",))


UNSUPPORTED = ("Order me a large pizza for delivery.", "Book a table for two at an Italian restaurant tonight.",
               "Call a taxi to take me to the airport.", "Buy two tickets for the concert on Saturday.",
               "Transfer fifty dollars to my brother's bank account.", "Post a photo of my cat on social media.")


def _unsupported(rng: random.Random, level: int) -> Scenario:
    world, _ = make_world(rng)
    ask = rng.choice(UNSUPPORTED)
    return Scenario(
        opening=ask, instruction=f"The user asks for something no tool can do ({ask!r}); the agent says so and "
                                 "changes nothing.",
        world=world, milestones=[], reference=[say("Sorry, I can't do that with the tools I have.")],
        minefields=(Constraint(kind="added", table="messages"), Constraint(kind="added", table="reminders"),
                    Constraint(kind="added", table="contacts"), Constraint(kind="call", tool="send_email")),
        categories=("insufficient_information", "single_user_turn"), tags=("missing_information_handling",))


@dataclass(frozen=True)
class Family:
    name: str
    make: Callable[[random.Random, int], Scenario]
    difficulty: int


FAMILIES: tuple[Family, ...] = (
    Family("check_setting", _check_setting, 0),
    Family("toggle_setting", _toggle_setting, 0),
    Family("contact_lookup", _contact_lookup, 1),
    Family("unsupported_request", _unsupported, 1),
    Family("unit_conversion", _convert_units, 1),
    Family("add_contact", _add_contact, 1),
    Family("send_message", _send_message, 2),
    Family("unknown_contact", _unknown_contact, 2),
    Family("currency_conversion", _convert_currency, 2),
    Family("setting_dependency", _setting_dependency, 2),
    Family("update_contact", _update_contact, 2),
    Family("relative_reminder", _relative_reminder, 3),
    Family("send_message_multiturn", _send_message_multiturn, 3),
    Family("reminder_multiturn", _reminder_multiturn, 3),
    Family("send_message_blocked", _send_message_blocked, 3),
    Family("nearby_place", _nearby_place, 3),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)


def scenario_task(family: Family, seed: int, split: str, index: int) -> Task:
    """Scenario `index` of `family` in `split` as a Task (everything drawn from its own seeded RNG)."""
    rng = random.Random(f"{seed}:{family.name}:{split}:{index}")
    sc = family.make(rng, family.difficulty)
    reference = sc.reference
    user = UserScenario(reason_for_call=sc.opening, known_info=dict(sc.known_info or {}),
                        unknown_info=list(sc.unknown_info), task_instructions=sc.task_instructions)
    gold = [ToolCall(name=s["call"]["name"], arguments=s["call"]["arguments"]) for s in reference if "call" in s]
    return Task(
        id=f"phone-{split}-{family.name}-{index:03d}", env="phone", split=split, family=family.name,
        instruction=sc.instruction, user=user, gold_actions=gold, required_outputs=list(sc.facts),
        capability_tags=list(sc.tags), difficulty=family.difficulty, seed=index,
        meta={"categories": list(sc.categories), "world": sc.world.to_dict(),
              "milestones": [x.model_dump(mode="json", exclude_defaults=True) for x in sc.milestones],
              "minefields": [x.model_dump(mode="json", exclude_defaults=True) for x in sc.minefields],
              "reference": reference},
    )


def build_phone_tasks(cfg: EnvConfig, split: str) -> list[Task]:
    """`cfg.per_family(split)` scenarios per family ('train', 'test' or 'all'), families in FAMILIES order."""
    if split not in (*SPLITS, "all"):
        raise ValueError(f"phone: unknown split {split!r}; choose one of {[*SPLITS, 'all']}")
    unknown = sorted(set(cfg.families) - set(FAMILY_NAMES))
    if unknown:
        raise ValueError(f"env.families: unknown phone families {unknown}; choose from {list(FAMILY_NAMES)}")
    chosen = [f for f in FAMILIES if not cfg.families or f.name in cfg.families]
    splits = SPLITS if split == "all" else (split,)
    return [scenario_task(f, cfg.seed, s, i) for s in splits for f in chosen for i in range(cfg.per_family(s))]


def places_kinds() -> list[str]:
    return sorted({p["kind"] for p in load_places()})
