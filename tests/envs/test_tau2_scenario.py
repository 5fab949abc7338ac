"""τ² scenarios as the scripted user's facts: parsed from every τ² task, and the scripted user on them
(reveals what it knows on request, never what it does not)."""

from __future__ import annotations

import re

import pytest

from trace_lib.envs.tau2.env import tau2_tasks
from trace_lib.envs.tau2.scenario import confirmation_answer, parse_known_info, scenario_from_tau2
from trace_lib.envs.user import ScriptedUser

ALL = [(d, t) for d in ("retail", "airline") for t in tau2_tasks(d, "base")]
QUESTIONS = {
    "first_name": "Could you please tell me your full name?",
    "last_name": "Could you please tell me your full name?",
    "zip": "What is your zip code?",
    "email": "What is your email address?",
    "other_email": "What is your email address?",
    "user_id": "Can you give me your user id?",
    "order_id": "What is the order id?",
    "reservation_id": "What is the reservation id?",
    "flight_number": "What is the flight number?",
}
PROBES = [
    "What is your email address?", "Please provide your email.", "What is the reservation id?",
    "Could you share your user id and zip code?", "Which order? What is the order number?",
    "What cabin is the flight in?", "What is the date of birth of the passenger?",
]


# --- parsing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,context,expected", [
    ("You are Yusuf Rossi in zip code 19122.", "You received your order #W2378156 and wish to exchange",
     {"first_name": "Yusuf", "last_name": "Rossi", "zip": "19122", "order_id": "#W2378156"}),
    ("You are an interesting guy called Noah Patel, living in the Big Apple in 10108.", "",
     {"first_name": "Noah", "last_name": "Patel", "zip": "10108"}),
    ("You are Lucas (lucas_santos_6600), you live in Denver CO 80239.", "",
     {"first_name": "Lucas", "last_name": "Santos", "user_id": "lucas_santos_6600", "zip": "80239"}),
    ("You are aarav_santos_2259 and aarav.santos8321@example.com and aarav.santos8320@example.com.", "",
     {"first_name": "Aarav", "last_name": "Santos", "user_id": "aarav_santos_2259",
      "email": "aarav.santos8321@example.com", "other_email": "aarav.santos8320@example.com"}),
    ("Your user id is 'daiki_muller_1116'.", "You want to cancel XEHM4B and 59XX6W, flight HAT005.",
     {"first_name": "Daiki", "last_name": "Muller", "user_id": "daiki_muller_1116",
      "reservation_id": "XEHM4B and 59XX6W", "flight_number": "HAT005"}),
])
def test_parse_known_info(text, context, expected):
    assert parse_known_info(text, context) == expected


@pytest.mark.parametrize("domain,task", ALL, ids=[f"{d}-{t.id}" for d, t in ALL])
def test_scenarios_only_hold_what_the_task_says(domain, task):
    scenario = scenario_from_tau2(task)
    instr = task.user_scenario.instructions
    source = " ".join(filter(None, [instr.known_info, instr.reason_for_call, instr.task_instructions]))
    for key, value in scenario.known_info.items():
        for part in value.split(" and "):
            assert part.lower() in source.lower(), (key, part)
    for sentence in scenario.unknown_info:
        assert sentence in (instr.unknown_info or "")
    assert scenario.reason_for_call == instr.reason_for_call.strip()


def test_scenario_details():
    by_id = {(d, t.id): t for d, t in ALL}
    retail74 = scenario_from_tau2(by_id["retail", "74"])
    assert retail74.unknown_info == ["You don't have an email."]
    assert retail74.task_instructions.endswith("say you want to use your credit card.")
    declines = sorted(int(t.id) for d, t in ALL if d == "retail" and not scenario_from_tau2(t).confirm)
    assert declines == [5, 6, 7, 8, 9, 18, 21, 24, 71, 72, 84, 91, 92, 98]
    assert all(scenario_from_tau2(t).confirm for d, t in ALL if d == "airline")
    assert not confirmation_answer("You want to cancel, but if the agent asks you to confirm, you regret it.")
    assert confirmation_answer("Only go ahead when the agent asks you to confirm if it costs less than $1000.")
    with pytest.raises(ValueError, match="no reason_for_call"):
        scenario_from_tau2({"id": "x", "user_scenario": {"instructions": {"domain": "retail"}}})


# --- the scripted user on τ² scenarios ----------------------------------------------------------
@pytest.mark.parametrize("domain,task", ALL, ids=[f"{d}-{t.id}" for d, t in ALL])
def test_scripted_user_reveals_known_info_on_request(domain, task):
    scenario = scenario_from_tau2(task)
    user = ScriptedUser(scenario)
    assert user.opening() == scenario.reason_for_call
    for key, value in scenario.known_info.items():
        turn = ScriptedUser(scenario).reply(QUESTIONS[key])
        assert value.split(" and ")[0] in turn.content, (key, turn.content)
        assert not turn.stop


@pytest.mark.parametrize("domain,task", ALL, ids=[f"{d}-{t.id}" for d, t in ALL])
def test_scripted_user_never_leaks_unknown_info(domain, task):
    scenario = scenario_from_tau2(task)
    user = ScriptedUser(scenario, max_turns=50)
    replies = " ".join(user.reply(q).content for q in PROBES)
    if "email" not in scenario.known_info:
        assert "@" not in replies
    if "reservation_id" not in scenario.known_info:
        assert not re.search(r"\b(?=[A-Z0-9]*\d)(?=[A-Z0-9]*[A-Z])[A-Z0-9]{6}\b", replies.replace("HAT", "")), replies
    if domain == "airline" and task.id == "25":  # 'You can't remember Ivan Smith's DOB'
        assert not re.search(r"\d{4}-\d{2}-\d{2}", replies)
    # Every id-like token the user states is one it knows (or its reason for calling, restated).
    known_values = {p for v in scenario.known_info.values() for p in v.split(" and ")}
    for token in re.findall(r"#W\d{7}|\b\d{5}\b|\b[a-z]+_[a-z]+_\d{4}\b", replies):
        assert token in known_values or token in scenario.reason_for_call, token
