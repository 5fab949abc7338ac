"""The built-in retail environment: τ²'s tools and DB, episode mechanics, τ²-style reward."""

import json

import pytest

from trace_lib.config import EnvConfig
from trace_lib.envs import make_env, make_tasks
from trace_lib.envs.retail.families import FAMILIES, FULL_SET, make_family_tasks
from trace_lib.envs.retail.env import (
    RetailEnv,
    build_env,
    load_base_db,
    retail_tool_specs,
    without_empty_fields,
)
from trace_lib.records import Message, Task, ToolCall

WRITE_FAMILIES = ["cancel_pending", "change_address", "return_item"]


def say(text: str) -> Message:
    return Message(role="assistant", content=text)


def call(name: str, **arguments) -> Message:
    return Message(role="assistant", tool_calls=[ToolCall(name=name, arguments=arguments)])


def play_gold(env: RetailEnv, task: Task, confirm: bool = True) -> tuple[float, dict]:
    """A perfect scripted agent: gold calls, a confirmation request before each write, the answer."""
    env.reset(task)
    for gold in task.gold_actions:
        if confirm and env.tool_kinds()[gold.name] == "write":
            assert "Yes" in env.step(say("I will make this change. Shall I proceed (yes/no)?")).observations[0].content
        obs = env.step(Message(role="assistant", tool_calls=[gold])).observations[0]
        assert not obs.error, obs.content
    result = env.step(say("Here is the result: " + "; ".join(task.required_outputs) + "."))
    assert result.done and result.termination == "user_stop"
    return env.reward()


@pytest.fixture(scope="module")
def env() -> RetailEnv:
    return RetailEnv()


@pytest.fixture(scope="module")
def tasks() -> dict[str, list[Task]]:
    db = load_base_db()
    return {f.name: make_family_tasks(db, f.name, "train", 3, seed=0) for f in FAMILIES}


def test_tools_are_tau2s_own(env):
    from tau2.domains.retail.tools import RetailTools

    kit = RetailTools(load_base_db())
    tau2_tools = kit.get_tools()
    for spec in env.tools:
        assert spec.parameters == tau2_tools[spec.name].openai_schema["function"]["parameters"]
        assert spec.kind == {"read": "read", "write": "write"}.get(kit.tool_type(spec.name).value, "generic")
    assert {"cancel_pending_order", "get_order_details", "transfer_to_human_agents"} <= {t.name for t in env.tools}
    assert len(retail_tool_specs("all")) == len(tau2_tools) > len(env.tools)
    assert env.tool_kinds()["cancel_pending_order"] == "write"
    assert env.tool_schemas()[0]["type"] == "function"
    with pytest.raises(ValueError, match="env.tools"):
        retail_tool_specs("some")


def test_registry_and_config_errors():
    cfg = EnvConfig(tasks_per_family=1)
    assert isinstance(make_env(cfg), RetailEnv)
    assert len(make_tasks(cfg, "train")) == len(FULL_SET)
    with pytest.raises(ValueError, match="env.user"):
        build_env(EnvConfig(user="llm"))


def test_reset_opens_with_policy_and_user_and_starts_over(env, tasks):
    task = tasks["order_status"][0]
    first = env.reset(task)
    for _ in range(3):
        opening = env.reset(task)
    assert opening == first and len(env.state.messages) == 2 and env.state.steps == 0
    assert opening[0].role == "system" and "yes/no" in opening[0].content
    assert opening[1].role == "user" and task.meta["entity"] in opening[1].content


def test_the_user_speaks_only_after_reset(tasks):
    fresh = RetailEnv()
    with pytest.raises(RuntimeError, match=r"RetailEnv has no user for this episode: call reset\(\) first"):
        fresh._user_reply("Hello")
    fresh.reset(tasks["order_status"][0])
    assert fresh._user_reply("Could you confirm?").content


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_gold_replay_scores_one(env, tasks, family):
    for task in tasks[family]:
        reward, info = play_gold(env, task)
        assert reward == 1.0, (task.id, info)
        assert info["db_match"] and info["outputs_missing"] == []


def test_episode_does_not_leak_into_next(env, tasks):
    task = tasks["cancel_pending"][0]
    play_gold(env, task)
    env.reset(task)
    order = json.loads(env.step(call("get_order_details", order_id=task.meta["entity"])).observations[0].content)
    assert order["status"] == "pending"
    assert load_base_db().orders[task.meta["entity"]].status == "pending"


@pytest.mark.parametrize("family", WRITE_FAMILIES + ["refuse_cancel", "order_status"])
def test_do_nothing_agent_scores_zero(env, tasks, family):
    for task in tasks[family]:
        env.reset(task)
        result = env.step(say("ok, done"))
        assert result.done
        reward, info = env.reward()
        assert reward == 0.0


def test_write_without_confirmation_scores_zero(env, tasks):
    reward, info = play_gold(env, tasks["cancel_pending"][0], confirm=False)
    assert reward == 0.0 and info["db_match"] and info["unconfirmed_writes"] == 1
    relaxed = RetailEnv(require_confirmation=False)
    assert play_gold(relaxed, tasks["cancel_pending"][0], confirm=False)[0] == 1.0


def test_wrong_write_breaks_db_match(env, tasks):
    task = tasks["cancel_pending"][0]
    gold = task.gold_actions[-1].arguments
    wrong = "ordered by mistake" if gold["reason"] == "no longer needed" else "no longer needed"
    env.reset(task)
    env.step(say("Shall I cancel it (yes/no)?"))
    assert not env.step(call("cancel_pending_order", order_id=gold["order_id"], reason=wrong)).observations[0].error
    env.step(say("Your order is cancelled."))
    reward, info = env.reward()
    assert reward == 0.0 and info["db_match"] is False


@pytest.mark.parametrize("action,expected", [
    (call("no_such_tool", x=1), "unknown tool 'no_such_tool'"),
    (call("get_order_details"), "order_id: Field required"),
    (call("get_order_details", order_id="#W0000000", extra=1), "unexpected argument(s) for get_order_details: extra"),
    (call("get_order_details", order_id=12), "invalid arguments for get_order_details"),
    (call("get_order_details", order_id="#W0000000"), "Error: Order not found"),
    (call("find_user_id_by_email", email="nobody@example.com"), "Error: User not found"),
    (Message(role="assistant", content="<tool_call>{bad", invalid="not JSON"), "invalid action: not JSON"),
])
def test_bad_actions_become_error_observations(env, tasks, action, expected):
    env.reset(tasks["order_status"][0])
    result = env.step(action)
    obs = result.observations[0]
    assert obs.error and expected in obs.content
    assert not result.done


def test_failed_precondition_is_an_observation(env, tasks):
    task = tasks["refuse_cancel"][0]
    env.reset(task)
    obs = env.step(call("cancel_pending_order", order_id=task.meta["entity"], reason="no longer needed")).observations[0]
    assert obs.error and obs.content == "Error: Non-pending order cannot be cancelled"


def test_tool_results_are_tau2_json_without_empty_fields(env, tasks):
    task = tasks["order_total"][0]
    env.reset(task)
    obs = env.step(call("get_order_details", order_id=task.meta["entity"])).observations[0]
    order = load_base_db().orders[task.meta["entity"]].model_dump()
    assert json.loads(obs.content) == without_empty_fields(order)
    assert order["cancel_reason"] is None and "cancel_reason" not in json.loads(obs.content)
    assert "null" not in obs.content and len(obs.content) < len(json.dumps(order))


def test_without_empty_fields_at_every_depth():
    value = {"a": None, "b": [], "c": {}, "d": [{"e": None, "f": 0, "g": ""}], "h": {"i": {"j": None}}, "k": False}
    assert without_empty_fields(value) == {"d": [{"f": 0, "g": ""}], "k": False}


def test_synthesized_worlds_show_results_as_their_target_does():
    from trace_lib.synth.world import TargetWorld

    oid = "#W4817420"
    built_in = TargetWorld({"name": "retail", "tools": "core"}).call("get_order_details", {"order_id": oid})
    tau2 = TargetWorld({"name": "tau2-retail"}).call("get_order_details", {"order_id": oid})
    assert "null" not in built_in and '"cancel_reason": null' in tau2


def test_max_steps_scores_zero(tasks):
    env = RetailEnv(max_steps=2)
    task = tasks["order_status"][0]
    env.reset(task)
    env.step(call("get_order_details", order_id=task.meta["entity"]))
    result = env.step(call("get_order_details", order_id=task.meta["entity"]))
    assert result.done and result.termination == "max_steps"
    assert env.reward() == (0.0, {"termination": "max_steps"})


def test_max_errors_and_transfer_end_episode(tasks):
    env = RetailEnv(max_errors=2)
    env.reset(tasks["order_status"][0])
    env.step(call("nope"))
    assert env.step(call("nope")).termination == "max_errors"
    env.reset(tasks["order_status"][0])
    result = env.step(call("transfer_to_human_agents", summary="user wants help"))
    assert result.done and result.termination == "transfer"
    assert env.reward()[0] == 0.0  # the status was never said
