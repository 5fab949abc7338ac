"""The phone environment: scenarios, tools and their dependencies, milestone and minefield scoring."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from trace_lib.config import EnvConfig, load_params
from trace_lib.envs import make_env, make_tasks
from trace_lib.envs.phone.env import PhoneEnv, play_steps
from trace_lib.envs.phone.milestones import Constraint, Milestone, Snapshot, rouge_l, score_episode
from trace_lib.envs.phone.scenarios import CATEGORIES, FAMILY_NAMES
from trace_lib.envs.phone.world import PhoneWorld, execute, phone_tool_specs
from trace_lib.records import Message, ToolCall

CFG = EnvConfig(name="phone")
GIVE_UP = [{"say": "Sorry, I cannot help with that."}]


@pytest.fixture(scope="module")
def tasks():
    return make_tasks(CFG, "all")


def _world(**settings) -> PhoneWorld:
    world = PhoneWorld(now="2026-03-14T09:30:00")
    world.settings.update(settings)
    world.contacts.append({"person_id": "person_001", "name": "Ana Diaz", "phone_number": "+14155550100",
                           "relationship": "friend", "is_self": False})
    return world


def _only(tasks, family):
    return [t for t in tasks if t.family == family]


# --- scenarios --------------------------------------------------------------------------------------
def test_scenario_set_spans_the_categories_in_both_splits(tasks):
    assert len(tasks) >= 120
    for split in ("train", "test"):
        in_split = [t for t in tasks if t.split == split]
        seen = Counter(c for t in in_split for c in t.meta["categories"])
        assert set(seen) == set(CATEGORIES), f"{split} lacks {set(CATEGORIES) - set(seen)}"
        assert {t.family for t in in_split} == set(FAMILY_NAMES)
    assert len({t.id for t in tasks}) == len(tasks)
    assert all(t.capability_tags and t.env == "phone" for t in tasks)


def test_every_reference_solution_is_perfect(tasks):
    env = make_env(CFG)
    for task in tasks:
        reward, info = play_steps(env, task, task.meta["reference"])
        assert info["perfect"] and reward == 1.0, (task.id, info)
        assert info["termination"] == "user_stop", task.id


def test_doing_nothing_is_perfect_only_where_not_acting_is_right(tasks):
    env = make_env(CFG)
    for task in tasks:
        reward, info = play_steps(env, task, GIVE_UP)
        insufficient = "insufficient_information" in task.meta["categories"]
        assert info["perfect"] == insufficient, (task.id, info)
        if not insufficient:
            assert reward < 1.0


def test_same_seed_same_scenarios_and_splits_differ():
    def dump(cfg, split):
        return [json.dumps(t.model_dump(mode="json"), sort_keys=True) for t in make_tasks(cfg, split)]

    assert dump(CFG, "test") == dump(CFG, "test")
    assert dump(CFG, "test") != dump(CFG.model_copy(update={"seed": 1}), "test")
    train = {t.meta["world"]["now"] + t.user.reason_for_call for t in make_tasks(CFG, "train")}
    test = {t.meta["world"]["now"] + t.user.reason_for_call for t in make_tasks(CFG, "test")}
    assert len(train & test) <= 2  # independent seeds; a coincidence of clock and wording is possible


def test_scenario_i_does_not_change_with_more_scenarios_per_family():
    small = make_tasks(CFG.model_copy(update={"tasks_per_family": 2}), "train")
    large = make_tasks(CFG.model_copy(update={"tasks_per_family": 4}), "train")
    by_id = {t.id: t for t in large}
    assert all(by_id[t.id] == t for t in small)
    split = CFG.model_copy(update={"tasks_per_family": 2, "test_tasks_per_family": 4})
    assert make_tasks(split, "train") == small and len(make_tasks(split, "test")) == 4 * len(FAMILY_NAMES)


def test_unknown_family_and_split_are_named():
    with pytest.raises(ValueError, match="nope"):
        make_tasks(CFG.model_copy(update={"families": ["nope"]}), "train")
    with pytest.raises(ValueError, match="validation"):
        make_tasks(CFG, "validation")


def test_params_select_the_phone_environment(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("env:\n  name: phone\n  tasks_per_family: 1\n")
    params = load_params(path)
    assert isinstance(make_env(params.env), PhoneEnv)
    assert len(make_tasks(params.env, "test")) == len(FAMILY_NAMES)


# --- tools and their dependencies ------------------------------------------------------------------
def test_sending_needs_cellular_and_low_battery_mode_blocks_turning_it_on():
    world = _world(cellular=False, low_battery_mode=True)
    text, err = execute(world, "send_message_with_phone_number", {"phone_number": "+14155550100", "content": "hi"})
    assert err and text.startswith("Error: ConnectionError") and "cellular" in text
    text, err = execute(world, "set_cellular_service_status", {"on": True})
    assert err and "PermissionError" in text and "low battery mode" in text
    assert execute(world, "set_low_battery_mode_status", {"on": False}) == (
        '{"status": "ok", "low_battery_mode": false}', False)
    assert not execute(world, "set_cellular_service_status", {"on": True})[1]
    assert not execute(world, "send_message_with_phone_number", {"phone_number": "+14155550100", "content": "hi"})[1]
    assert world.messages[-1]["content"] == "hi"


def test_low_battery_mode_turns_off_the_radios_and_setters_refuse_no_ops():
    world = _world()
    execute(world, "set_low_battery_mode_status", {"on": True})
    assert world.settings == {"cellular": False, "wifi": False, "location_service": False, "low_battery_mode": True}
    text, err = execute(world, "set_low_battery_mode_status", {"on": True})
    assert err and "already on" in text


def test_place_search_needs_wifi_and_location_and_rates_need_wifi():
    world = _world(location_service=False)
    text, err = execute(world, "search_places", {"query": "cafe"})
    assert err and "PermissionError" in text and "location" in text
    world.settings.update(location_service=True, wifi=False)
    assert "ConnectionError" in execute(world, "search_places", {"query": "cafe"})[0]
    assert "ConnectionError" in execute(world, "convert_currency", {"amount": 5, "from_currency": "USD",
                                                                    "to_currency": "EUR"})[0]
    world.settings["wifi"] = True
    places = json.loads(execute(world, "search_places", {"query": "cafe"})[0])
    assert places[0]["name"] == "Blue Bottle Coffee" and len(places) <= 3


def test_canonical_vocabularies_refuse_other_spellings():
    world = _world()
    text, err = execute(world, "unit_conversion", {"amount": 26.2, "from_unit": "miles", "to_unit": "kilometer"})
    assert err and "unknown unit 'miles'" in text
    text, err = execute(world, "unit_conversion", {"amount": 26.2, "from_unit": "mile", "to_unit": "kilometer"})
    assert json.loads(text) == {"amount": 42.16, "unit": "kilometer"} and not err
    assert "unknown currency 'dollars'" in execute(world, "convert_currency", {
        "amount": 5, "from_currency": "dollars", "to_currency": "EUR"})[0]
    assert "ISO 8601" in execute(world, "add_reminder", {"content": "x", "reminder_timestamp": "tomorrow 5pm"})[0]


@pytest.mark.parametrize("name,args,expected", [
    ("set_wifi_status", {"on": "maybe"}, "must be true or false"),
    ("shift_timestamp", {"timestamp": "2026-03-14T09:30:00", "days": 1e300}, "finite number"),
    ("shift_timestamp", {"timestamp": "2026-03-14T09:30:00", "days": "nan"}, "finite number"),
    ("shift_timestamp", {"timestamp": "2026-03-14T09:30:00", "days": True}, "finite number"),
    ("shift_timestamp", {"timestamp": "2026-03-14T09:30:00", "days": 4000}, "at most ten years"),
    ("shift_timestamp", {"timestamp": "9999-12-31T09:30:00", "days": 2}, "out of range"),
    ("unit_conversion", {"amount": 10 ** 400, "from_unit": "mile", "to_unit": "meter"}, "finite number"),
    ("convert_currency", {"amount": "inf", "from_currency": "USD", "to_currency": "EUR"}, "finite number"),
    ("add_contact", {"name": "Bo"}, "missing argument(s) for add_contact: phone_number"),
    ("search_contacts", {"nick": "Bo"}, "unexpected argument(s) for search_contacts: nick"),
    ("remove_contact", {"person_id": "person_999"}, "no contact with person_id"),
    ("shift_timestamp", {"timestamp": "2026-03-14T09:30:00", "days": "x"}, "must be a finite number"),
    ("make_coffee", {}, "unknown tool 'make_coffee'"),
])
def test_bad_calls_are_error_observations(name, args, expected):
    text, err = execute(_world(), name, args)
    assert err and text.startswith("Error") and expected in text


def test_arguments_that_are_not_an_object_are_an_error():
    text, err = execute(_world(), "search_contacts", ["Ana"])
    assert err and "must be an object" in text


def test_tool_schemas_are_json_functions_with_read_write_marks():
    specs = phone_tool_specs()
    assert len({s.name for s in specs}) == len(specs)
    kinds = {s.name: s.kind for s in specs}
    assert kinds["send_message_with_phone_number"] == "write" and kinds["search_contacts"] == "read"
    assert all(s.to_schema()["function"]["parameters"]["type"] == "object" for s in specs)


# --- scoring ----------------------------------------------------------------------------------------
def test_rouge_l():
    assert rouge_l("Running late, see you at seven", "running late see you at seven") == 1.0
    assert 0 < rouge_l("running late", "running late see you at seven") < 1
    assert rouge_l("", "x") == 0.0


def _play(task, steps):
    env = make_env(CFG)
    return play_steps(env, task, steps)


def test_partial_similarity_and_the_order_of_milestones(tasks):
    task = _only(tasks, "send_message")[0]
    ref = task.meta["reference"]
    send = next(s for s in ref if "call" in s and s["call"]["name"] == "send_message_with_phone_number")
    short = {"call": {"name": send["call"]["name"],
                      "arguments": {**send["call"]["arguments"],
                                    "content": " ".join(send["call"]["arguments"]["content"].split()[:3])}}}
    reward, info = _play(task, [ref[0], short, ref[-1]])
    assert 0.5 < reward < 1.0 and not info["perfect"]
    # sending before the lookup: the message milestone cannot come before the search milestone it follows
    reward, info = _play(task, [send, ref[0], ref[-1]])
    assert reward == 0.5 and info["milestones"] == [1.0, 0.0]


MEDDLE = {"call": {"name": "add_reminder", "arguments": {"content": "x", "reminder_timestamp": "2026-03-14T10:00:00"}}}


@pytest.mark.parametrize("family", ["check_setting", "toggle_setting", "unsupported_request", "unknown_contact"])
def test_an_unrequested_change_anywhere_zeroes_the_score(tasks, family):
    task = _only(tasks, family)[0]
    ref = task.meta["reference"]
    for steps in ([MEDDLE, *ref], [*ref[:-1], MEDDLE, ref[-1]]):  # before the milestones, after the last one
        reward, info = _play(task, steps)
        assert reward == 0.0 and info["changed"] == "reminders", (family, info)


def test_requests_name_people_the_user_can_tell_apart(tasks):
    for task in tasks:
        firsts = [c["name"].split()[0] for c in task.meta["world"]["contacts"]]
        assert len(firsts) == len(set(firsts)), task.id


def test_a_setting_answer_must_state_the_value(tasks):
    task = next(t for t in _only(tasks, "check_setting") if "is off" in t.required_outputs)
    ref = task.meta["reference"]
    reward, _ = _play(task, [ref[0], {"say": "Based on the status, your setting is on."}])
    assert reward == 0.5


def test_minefields_zero_the_score(tasks):
    task = next(t for t in _only(tasks, "send_message") if "distraction_tools" in t.meta["categories"])
    ref = task.meta["reference"]
    email = {"call": {"name": "send_email", "arguments": {"address": "a@b.c", "subject": "s", "body": "b"}}}
    reward, info = _play(task, [email, *ref])
    assert reward == 0.0 and info["minefield"] == 0
    task = _only(tasks, "unknown_contact")[0]
    send = {"call": {"name": "send_message_with_phone_number",
                     "arguments": {"phone_number": "+14155550100", "content": "hi"}}}
    reward, info = _play(task, [send, *GIVE_UP])
    assert reward == 0.0 and info["minefield"] == 0


def test_state_dependency_scenario_needs_the_settings_fixed(tasks):
    task = _only(tasks, "send_message_blocked")[0]
    ref = task.meta["reference"]
    skipped = [s for s in ref if "call" not in s or not s["call"]["name"].startswith("set_")]
    reward, info = _play(task, skipped)
    assert reward < 1.0
    env = make_env(CFG)
    play_steps(env, task, skipped)
    assert any(m.error and "ConnectionError" in m.content for m in env.state.messages if m.role == "tool")


def test_milestone_dag_allows_siblings_in_any_order():
    start = _world().snapshot()
    after_a = {**start, "settings": {**start["settings"], "wifi": False}}
    milestones = [Milestone(constraints=[Constraint(kind="said", facts=["one"])]),
                  Milestone(constraints=[Constraint(kind="said", facts=["two"])]),
                  Milestone(constraints=[Constraint(kind="setting", values={"wifi": False})], after=[0, 1])]
    snaps = [Snapshot(tables=start, said="two"), Snapshot(tables=start, said="one"), Snapshot(tables=after_a)]
    assert score_episode(milestones, [], snaps, start)["similarity"] == 1.0
    assert score_episode(milestones, [], snaps[1:], start)["similarity"] == pytest.approx(2 / 3, abs=1e-6)
    with pytest.raises(ValueError, match="earlier milestones"):
        score_episode([Milestone(constraints=[], after=[0])], [], snaps, start)


def test_the_scripted_user_reveals_phone_fields_when_asked(tasks):
    task = _only(tasks, "send_message_multiturn")[0]
    env = make_env(CFG)
    env.reset(task)
    reply = env.step(Message(role="assistant", content="Who is the message for? And what should it say?"))
    text = reply.observations[0].content
    assert task.user.known_info["recipient"] in text and task.user.known_info["message"] in text


def test_a_malformed_turn_is_answered_not_raised(tasks):
    env = make_env(CFG)
    env.reset(tasks[0])
    out = env.step(Message(role="assistant", invalid="not JSON"))
    assert out.observations[0].error and not out.done
    out = env.step(Message(role="assistant", tool_calls=[ToolCall(name="set_wifi_status", arguments={"on": [1]})]))
    assert out.observations[0].error


class _ScriptedClient:
    """Stands in for the cached Claude client: replies in order, records the system prompt."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.systems = []

    def complete(self, system, messages, **kw):
        from types import SimpleNamespace

        self.systems.append(system)
        return SimpleNamespace(text=self.replies.pop(0))


def test_an_llm_user_plays_the_scenario_and_ends_with_the_stop_token(tasks):
    from trace_lib.envs.phone.env import user_instructions
    from trace_lib.envs.llm_user import STOP, LLMUser

    task = _only(tasks, "send_message_multiturn")[0]
    client = _ScriptedClient(["I want to send a text.", f"It's for {task.user.known_info['recipient']}.", STOP])
    env = PhoneEnv(user_factory=lambda t: LLMUser(client, user_instructions(t), stage="phone_user"))
    opening = env.reset(task)
    assert opening[1].content == "I want to send a text."
    assert task.user.known_info["message"] in client.systems[0] and "do not know" not in client.systems[0]
    assert not env.step(Message(role="assistant", content="Who is it for?")).done
    out = env.step(Message(role="assistant", content="Okay."))
    assert out.done and out.termination == "user_stop"
    reward, info = env.reward()
    assert info["user"] == "llm" and reward < 1.0


# --- the phone's capabilities: detectors and training environments ------------------------------------
def _trajectory(task, steps):
    from trace_lib.records import Trajectory

    env = make_env(CFG)
    reward, info = play_steps(env, task, steps)
    st = env.state
    return Trajectory(id=f"{task.id}#0", task_id=task.id, env="phone", family=task.family, split=task.split,
                      policy_id="scripted", seed=0, messages=st.messages, reward=reward, success=reward >= 1,
                      termination=st.termination or "", tool_calls=st.tool_calls, invalid_actions=st.invalid_actions,
                      tool_errors=st.tool_errors, turns=st.steps, prompt_tokens=0, completion_tokens=0,
                      reward_info=info)


def _labels(task, steps):
    from trace_lib.analyst.detectors import detect
    from trace_lib.envs.phone.world import tool_kinds

    ids = ["state_dependency_resolution", "missing_information_handling", "argument_canonicalization"]
    return {lb.capability_id: lb.label for lb in detect(_trajectory(task, steps), tool_kinds(), task, ids=ids)}


def test_detectors_see_the_phone_capabilities(tasks):
    blocked = _only(tasks, "send_message_blocked")[0]
    ref = blocked.meta["reference"]
    sets = [s for s in ref if "call" in s and s["call"]["name"].startswith("set_")]
    no_fix = [s for s in ref if s not in sets]
    retried = [no_fix[0], no_fix[1], *sets, *no_fix[1:]]  # search, blocked send, fix, send again, say
    assert _labels(blocked, retried)["state_dependency_resolution"] == "PRESENT"
    assert _labels(blocked, ref)["state_dependency_resolution"] == "NA"  # fixed before anything failed
    assert _labels(blocked, no_fix)["state_dependency_resolution"] == "LACKING"
    assert _labels(blocked, GIVE_UP)["state_dependency_resolution"] == "NA"

    contact = _only(tasks, "add_contact")[0]
    good = contact.meta["reference"]
    raw = [{"call": {"name": "add_contact", "arguments": {**good[0]["call"]["arguments"],
                                                         "phone_number": "(415) 555-0000"}}}, good[-1]]
    assert _labels(contact, good)["argument_canonicalization"] == "PRESENT"
    assert _labels(contact, raw)["argument_canonicalization"] == "LACKING"
    assert _labels(blocked, ref)["argument_canonicalization"] == "NA"

    multi = _only(tasks, "send_message_multiturn")[0]
    mref = multi.meta["reference"]
    assert _labels(multi, mref)["missing_information_handling"] == "PRESENT"
    assert _labels(multi, mref[1:])["missing_information_handling"] == "LACKING"
    unknown = _only(tasks, "unknown_contact")[0]
    assert _labels(unknown, GIVE_UP)["missing_information_handling"] == "PRESENT"
    send = {"call": {"name": "send_message_with_phone_number", "arguments": {"phone_number": "+14155550100",
                                                                            "content": "hi"}}}
    assert _labels(unknown, [send, *GIVE_UP])["missing_information_handling"] == "LACKING"
    conv = _only(tasks, "unit_conversion")[0]
    as_text = [{"call": {"name": "unit_conversion", "arguments": {
        k: str(v) for k, v in conv.meta["reference"][0]["call"]["arguments"].items()}}}, conv.meta["reference"][-1]]
    assert _labels(conv, as_text)["argument_canonicalization"] == "PRESENT"  # "26.2" is 26.2 to the tool


def test_retail_only_detectors_say_na_on_the_phone(tasks):
    from trace_lib.analyst.detectors import detect
    from trace_lib.envs.phone.world import tool_kinds

    for family in ("toggle_setting", "send_message_blocked", "add_contact"):
        task = _only(tasks, family)[0]
        labels = {lb.capability_id: lb.label for lb in detect(_trajectory(task, task.meta["reference"]), tool_kinds(),
                                                              task, ids=["confirmation_before_write",
                                                                         "precondition_verification"])}
        assert set(labels.values()) == {"NA"}, (family, labels)


@pytest.mark.parametrize("capability", ["tool_call_precision", "communicate_result", "multi_step_completion",
                                        "state_dependency_resolution", "missing_information_handling",
                                        "argument_canonicalization"])
def test_phone_training_environments_are_valid(tmp_path, capability):
    from trace_lib.config import SynthesizeConfig
    from trace_lib.synth.templates import render_template_module
    from trace_lib.synth.validate import validate_env

    path = tmp_path / "env.py"
    path.write_text(render_template_module(capability, {"name": "phone", "tools": "core"}, 1))
    report = validate_env(path, CFG, SynthesizeConfig().validation, 1)
    assert report.valid, report.failed
    from trace_lib import synth_sdk

    bound = synth_sdk.template(capability, {"name": "phone"})
    task = bound.generate_task(3, 1)
    assert capability in task["capability_tags"] and task["meta"]["milestones"]
    assert task == bound.generate_task(3, 1)
    assert all(not t.id.startswith("phone-synth") for t in make_tasks(CFG, "all"))
    tools = [s["function"]["name"] for s in bound.tool_schemas()]
    assert tools == [s.name for s in phone_tool_specs()]


def test_a_phone_rubric_scores_like_the_environment(tasks):
    from trace_lib import synth_sdk

    bound = synth_sdk.template("state_dependency_resolution", {"name": "phone"})
    task = bound.generate_task(0, 3)
    steps = task["meta"]["reference"]
    env = make_env(CFG)
    from trace_lib.records import Task

    as_task = Task(id="t", env="phone", split="synth", family=task["meta"]["family"], instruction=task["instruction"],
                   user=task["user"], meta=task["meta"])
    reward, info = play_steps(env, as_task, steps[1:])  # skips the first settings change
    messages = [m.model_dump(mode="json") for m in env.state.messages]
    verdict = bound.evaluate({"messages": messages, "termination": env.state.termination}, task, None)
    assert list(verdict["steps"].values()) == info["milestones"] and verdict["gates"] == {"no_minefield": True}
    assert sum(info["milestones"]) / len(info["milestones"]) == pytest.approx(reward)


def test_a_phone_rubric_is_zero_where_the_environment_is_for_an_unrequested_change(tasks):
    """A change to a table no milestone names zeroes the phone's score; the rubric's gate agrees."""
    from trace_lib import synth_sdk
    from trace_lib.synth.rubric import rubric_score

    task = _only(tasks, "send_message")[0]
    ref = task.meta["reference"]
    env = make_env(CFG)
    reward, info = play_steps(env, task, [*ref[:-1], MEDDLE, ref[-1]])
    assert reward == 0.0 and info["changed"] == "reminders"
    messages = [m.model_dump(mode="json") for m in env.state.messages]
    verdict = synth_sdk.phone_rubric({"messages": messages}, task.meta)
    assert all(v == 1.0 for v in verdict["steps"].values()) and verdict["gates"] == {"no_minefield": False}
    assert rubric_score(verdict["steps"], verdict["gates"]) == reward


def test_category_table_counts_perfect_episodes_per_category(tasks):
    from trace_lib.envs.phone.summary import category_table

    chosen = [_only(tasks, "unsupported_request")[0], _only(tasks, "send_message")[0]]
    trajs = [_trajectory(chosen[0], GIVE_UP), _trajectory(chosen[1], GIVE_UP)]
    table = category_table(chosen, trajs).set_index("category")
    assert table.loc["all", "episodes"] == 2 and table.loc["all", "perfect"] == 1
    assert table.loc["insufficient_information", "perfect"] == 1 and table.loc["multiple_tool_call", "perfect"] == 0
    assert table.loc["all", "mean similarity"] == 0.5
