"""Fixture: a valid synthesized environment on the phone target (capability state_dependency_resolution),
written against the phone part of the SDK as an LLM synthesizer would.

The user asks for a text to a number; cellular is off (at difficulty 2 and more, low battery mode is on
too, and must be turned off first). The agent must find the blocking setting from the tool's error,
fix it and send the text; an email instead of a text is a minefield.
"""

import random

from trace_lib import synth_sdk

CAPABILITY = "state_dependency_resolution"
TARGET = {"name": "phone", "tools": "all"}
DIFFICULTY = {"default": 1, "min": 0, "max": 3}  # 2+: low battery mode blocks cellular as well

TEXTS = ("Running ten minutes late", "Dinner is at seven", "Call me when you land", "The keys are under the mat")
NAMES = ("Ana Silva", "Ben Okafor", "Chloe Martin", "Dev Patel", "Eva Novak")


def tool_schemas():
    return synth_sdk.target_tool_schemas(TARGET)


def generate_task(seed, difficulty=1):
    rng = random.Random(f"blocked-text:{seed}:{difficulty}")
    number = f"+1415555{rng.randrange(1000, 10000)}"
    text = rng.choice(TEXTS)
    owner = rng.choice(NAMES)
    low_battery = difficulty >= 2
    world = {"now": "2026-07-17T12:30:00",
             "settings": {"cellular": False, "wifi": not low_battery, "location_service": not low_battery,
                          "low_battery_mode": low_battery},
             "contacts": [{"person_id": "person_001", "name": owner, "phone_number": "+14085550100",
                           "relationship": None, "is_self": True}],
             "messages": [], "reminders": []}
    milestones = [{"constraints": [{"kind": "setting", "values": {"cellular": True}}]},
                  {"constraints": [{"kind": "added", "table": "messages",
                                    "row": {"recipient_phone_number": number, "content": text}}], "after": [0]}]
    return {
        "instruction": f"Text {number} saying {text!r}; cellular is off" + (" and low battery mode on." if low_battery
                                                                             else "."),
        "user": {"reason_for_call": f"Send a text to {number} saying \"{text}\".", "known_info": {}},
        "required_outputs": [],
        "gold_actions": [],
        "meta": {"world": world, "milestones": milestones,
                 "minefields": [{"kind": "call", "tool": "send_email"}], "number": number, "text": text,
                 "low_battery": low_battery},
    }


def init_state(task):
    return synth_sdk.phone_world(task["meta"]["world"])


def call_tool(state, name, arguments):
    return synth_sdk.phone_call(state, name, arguments)


def evaluate(trajectory, task, state):
    return synth_sdk.phone_rubric(trajectory, task["meta"])


def solve(task):
    meta = task["meta"]
    steps = [{"tool": "set_low_battery_mode_status", "arguments": {"on": False}}] if meta["low_battery"] else []
    return steps + [{"tool": "set_cellular_service_status", "arguments": {"on": True}},
                    {"tool": "send_message_with_phone_number",
                     "arguments": {"phone_number": meta["number"], "content": meta["text"]}},
                    {"say": "Done: I turned cellular on and sent your text."}]
