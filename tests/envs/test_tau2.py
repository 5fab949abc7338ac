"""τ²-bench airline/retail through the adapter: task sets, τ²'s prompt and tools, τ²'s termination
rules, and τ²'s own evaluator (gold replay scores 1, do-nothing scores 1 only without writes)."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
from tau2.data_model import message as t2m

from trace_lib.config import EnvConfig
from trace_lib.envs import make_env, make_tasks
from trace_lib.envs.base import UserTurn
from trace_lib.envs.tau2.env import (
    Tau2Env, agent_system_prompt, build_env, fresh_tau2_env, gc_paused, pristine_db, pristine_db_intact,
    replay_gold, score_messages, tau2_messages, tau2_task_of, tool_specs,
)
from trace_lib.envs.llm_user import LLMUser, tau2_constant
from trace_lib.records import Message, Task, ToolCall

# Tasks whose own gold actions raise inside τ² (wrong ids, lookups meant to fail, policy refusals).
# They still replay to 1: the evaluator's gold run fails the same way.
GOLD_ACTION_ERRORS = {
    "retail": ["2", "3", "4", "12", "13", "21", "35", "37", "38", "39", "46", "47", "54", "55", "64", "67", "68",
               "105"],
    "airline": [],
}
NO_WRITE_TASKS = {
    "retail": ["10", "24", "25", "50", "57", "62", "65", "67", "68"],
    "airline": ["0", "1", "3", "4", "5", "6", "10", "13", "26", "28", "31", "34", "36", "41", "43", "45", "46",
                "47", "48", "49"],
}
# A do-nothing agent scores 1 on the no-write tasks that need no communicated info, plus the tasks
# whose only writes are gold actions that fail in τ² (retail 12 and 105), so the DB never changes.
DO_NOTHING_PASSES = {
    "retail": ["10", "12", "25", "50", "57", "65", "105"],
    "airline": ["0", "1", "4", "5", "6", "10", "13", "26", "28", "31", "34", "36", "41", "43", "45", "46", "47",
                "48", "49"],
}


def cfg(domain: str, **kw) -> EnvConfig:
    return EnvConfig(name=f"tau2-{domain}", **{"max_steps": 200, "max_errors": 10, **kw})


@pytest.fixture(scope="module")
def tasks() -> dict[str, dict[str, Task]]:
    return {d: {t.meta["tau2_id"]: t for t in make_tasks(cfg(d), "base")} for d in ("retail", "airline")}


def say(text: str) -> Message:
    return Message(role="assistant", content=text)


def call(name: str, i: int = 0, **arguments) -> Message:
    return Message(role="assistant", tool_calls=[ToolCall(name=name, arguments=arguments, id=f"c{i}")])


# --- task sets ----------------------------------------------------------------------------------
@pytest.mark.parametrize("domain,sizes", [("retail", (114, 74, 40)), ("airline", (50, 30, 20))])
def test_task_sets_follow_split_tasks_json(domain, sizes):
    got = [make_tasks(cfg(domain), s) for s in ("base", "train", "test")]
    assert tuple(len(ts) for ts in got) == sizes
    base, train, test = ({t.id for t in ts} for ts in got)
    assert train | test == base and not train & test
    first = got[1][0]
    assert first.id.startswith(f"tau2-{domain}/") and first.env == f"tau2-{domain}"
    assert first.split == "train" and first.family == domain
    with pytest.raises(ValueError, match="τ² task sets are"):
        make_tasks(cfg(domain), "dev")


def test_task_record_carries_tau2_task(tasks):
    task = tasks["retail"]["0"]
    t2 = tau2_task_of(task)
    assert t2.id == "0" and [a.name for a in t2.evaluation_criteria.actions] == [a.name for a in task.gold_actions]
    assert task.gold_actions[-1].name == "exchange_delivered_order_items"
    assert task.instruction.startswith("You received your order #W2378156")
    assert Task.model_validate_json(task.model_dump_json()) == task
    with_info = next(t for t in tasks["retail"].values() if t.required_outputs)
    assert with_info.required_outputs == tau2_task_of(with_info).evaluation_criteria.communicate_info


def test_no_write_task_counts(tasks):
    for domain, expected in NO_WRITE_TASKS.items():
        kinds = {s.name: s.kind for s in tool_specs(domain)}
        no_writes = [i for i, t in tasks[domain].items() if all(kinds[a.name] != "write" for a in t.gold_actions)]
        assert no_writes == expected
    assert (len(NO_WRITE_TASKS["retail"]), len(NO_WRITE_TASKS["airline"])) == (9, 20)


# --- what the agent sees ------------------------------------------------------------------------
def test_tools_and_system_prompt_are_tau2s():
    specs = {s.name: s for s in tool_specs("retail")}
    assert specs["cancel_pending_order"].kind == "write" and specs["get_order_details"].kind == "read"
    assert specs["transfer_to_human_agents"].kind == "generic" and specs["calculate"].kind == "generic"
    assert specs["get_order_details"].parameters["required"] == ["order_id"]
    assert {s.name for s in tool_specs("airline")} >= {"book_reservation", "cancel_reservation", "get_user_details"}
    prompt = agent_system_prompt("airline")
    assert prompt.startswith("<instructions>\n" + tau2_constant("agent/llm_agent.py", "AGENT_INSTRUCTION"))
    assert "<policy>\n# Airline Agent Policy" in prompt and prompt.endswith("</policy>")


def test_reset_opens_like_tau2(tasks):
    env = make_env(cfg("retail"))
    opening = env.reset(tasks["retail"]["0"])
    assert [m.role for m in opening] == ["system", "assistant", "user"]
    assert opening[1].content == "Hi! How can I help you today?"
    assert opening[2].content.startswith("You received your order #W2378156")
    assert env.tau2_steps == 1 and not env.done


# --- scoring ------------------------------------------------------------------------------------
@pytest.mark.parametrize("domain,task_id", [("retail", "0"), ("retail", "21"), ("retail", "50"),
                                            ("airline", "13"), ("airline", "3")])
def test_gold_replay_scores_one(tasks, domain, task_id):
    env = make_env(cfg(domain))
    reward, info = replay_gold(env, tasks[domain][task_id])
    assert reward == 1.0, info
    assert info["reward_basis"] == ["DB", "COMMUNICATE"] and info["db_match"] is True
    assert info["user_mode"] == "scripted"
    assert env.state.termination == ("transfer" if task_id in ("50", "13") else "user_stop")
    assert pristine_db_intact(domain)  # the forked copy wrote the shared database, this process its own copy


@pytest.mark.slow
@pytest.mark.parametrize("domain", ["retail", "airline"])
def test_gold_replay_scores_one_on_every_task(tasks, domain):
    env = make_env(cfg(domain))
    env.isolate_tools = False  # a fork per tool call of this big process; isolated: test_gold_replay_scores_one
    failed, gold_errors = {}, []
    for task_id, task in tasks[domain].items():
        reward, info = replay_gold(env, task)
        if reward != 1.0:
            failed[task_id] = info
        if env.state.tool_errors:
            gold_errors.append(task_id)
    assert failed == {}
    assert gold_errors == GOLD_ACTION_ERRORS[domain]
    assert pristine_db_intact(domain)  # every READ tool the gold actions call left the shared database alone


def test_environments_share_the_database_until_they_write():
    shared = pristine_db("retail")
    reader, writer = fresh_tau2_env("retail"), fresh_tau2_env("retail")
    lookup = reader.get_response(t2m.ToolCall(id="r", name="get_order_details", arguments={"order_id": "#W2378156"},
                                              requestor="assistant"))
    assert not lookup.error and reader.tools.db is shared.db and reader.get_db_hash() == shared.hash
    cancel = writer.get_response(t2m.ToolCall(id="w", name="cancel_pending_order", requestor="assistant",
                                              arguments={"order_id": "#W5918442", "reason": "no longer needed"}))
    assert not cancel.error, cancel.content
    assert writer.tools.db is not shared.db and writer.get_db_hash() != shared.hash
    assert json.loads(cancel.content)["status"] == "cancelled"
    assert shared.db.orders["#W5918442"].status == "pending" and pristine_db_intact("retail")
    # a generic tool (not marked READ) copies too; a failed write still leaves the shared one whole
    generic, failing = fresh_tau2_env("retail"), fresh_tau2_env("retail")
    generic.get_response(t2m.ToolCall(id="g", name="calculate", arguments={"expression": "1 + 2"}, requestor="assistant"))
    bad = failing.get_response(t2m.ToolCall(id="f", name="cancel_pending_order", requestor="assistant",
                                            arguments={"order_id": "#W0000000", "reason": "no longer needed"}))
    assert bad.error and generic.tools.db is not shared.db and failing.get_db_hash() == shared.hash
    updated = fresh_tau2_env("retail")
    updated.tools.update_db({"orders": {"#W5918442": {"status": "cancelled"}}})
    assert updated.tools.db is not shared.db and updated.get_db_hash() != shared.hash and pristine_db_intact("retail")
    with gc_paused():  # no cycles: an environment and its copy go with the last reference
        gone = [weakref.ref(writer), weakref.ref(writer.tools)]
        del writer
        assert [ref() for ref in gone] == [None, None]


def test_gc_paused_restores_the_collector_as_it_was():
    assert gc.isenabled()
    with pytest.raises(KeyError), gc_paused():
        assert not gc.isenabled()
        raise KeyError("x")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause is left alone
    finally:
        gc.enable()


@pytest.mark.parametrize("domain,task_id,expected", [
    ("retail", "10", 1.0), ("retail", "0", 0.0), ("retail", "24", 0.0), ("retail", "12", 1.0), ("airline", "3", 0.0),
])
def test_do_nothing_agent(tasks, domain, task_id, expected):
    env = make_env(cfg(domain))
    env.reset(tasks[domain][task_id])
    result = env.step(say("Hello."))  # no request: the scripted user says goodbye
    assert result.done and result.termination == "user_stop"
    assert env.reward()[0] == expected


@pytest.mark.slow
@pytest.mark.parametrize("domain", ["retail", "airline"])
def test_do_nothing_scores_one_only_without_writes(tasks, domain):
    env = make_env(cfg(domain))
    passed = []
    for task_id, task in tasks[domain].items():
        env.reset(task)
        env.step(say("Hello."))
        if env.reward()[0] == 1.0:
            passed.append(task_id)
    assert passed == DO_NOTHING_PASSES[domain]
    extra = set(passed) - set(NO_WRITE_TASKS[domain])
    assert extra == ({"12", "105"} if domain == "retail" else set())
    assert extra <= set(GOLD_ACTION_ERRORS[domain])
    assert pristine_db_intact(domain)


def test_communicate_is_checked(tasks):
    task = tasks["retail"]["70"]
    assert task.required_outputs == ["22.55"] and len(task.gold_actions) == 1
    env = make_env(cfg("retail"))
    for text, expected in [("Done.", 0.0), ("You pay $22.55 today.", 1.0)]:
        env.reset(task)
        env.step(Message(role="assistant", tool_calls=[task.gold_actions[0].model_copy(update={"id": "g"})]))
        env.step(say(text))
        reward, info = env.reward()
        assert reward == expected and info["db_match"] is True
        assert info["communicate"] == [{"info": "22.55", "met": bool(expected)}]


# --- termination as τ² --------------------------------------------------------------------------
def test_max_steps_scores_zero(tasks):
    task = tasks["retail"]["0"]
    env = make_env(cfg("retail", max_steps=5))
    env.reset(task)
    results = [env.step(Message(role="assistant", tool_calls=[g.model_copy(update={"id": f"g{i}"})]))
               for i, g in enumerate(task.gold_actions[:2])]
    assert [r.done for r in results] == [False, True] and env.tau2_steps == 5
    assert results[-1].termination == "max_steps"
    reward, info = env.reward()
    assert reward == 0.0 and info["tau2_termination"] == "max_steps" and info["user_mode"] == "scripted"


def test_step_limit_checked_before_the_user_answers_and_overrides_a_stop(tasks):
    env = make_env(cfg("retail", max_steps=2))
    env.reset(tasks["retail"]["10"])
    result = env.step(say("Hello."))  # step 2 is the agent's message: the user never answers
    assert result.done and result.termination == "max_steps" and result.observations == []
    env = make_env(cfg("retail", max_steps=3))
    env.reset(tasks["retail"]["10"])
    result = env.step(say("Hello."))  # the user stops on step 3, which is also the limit: τ² says max_steps
    assert result.termination == "max_steps" and result.observations[0].content.endswith("###STOP###")
    assert env.reward()[0] == 0.0


def test_max_errors_and_unknown_tools_use_tau2_errors(tasks):
    env = make_env(cfg("retail", max_errors=2))
    env.reset(tasks["retail"]["10"])
    first = env.step(call("no_such_tool"))
    assert first.observations[0].error and first.observations[0].content == "Error: Tool 'no_such_tool' not found."
    second = env.step(call("get_order_details", 1, order_id="#W0000000"))
    assert second.observations[0].content == "Error: Order not found" and second.termination == "max_errors"
    assert env.reward() == (0.0, {"termination": "max_errors", "tau2_termination": "too_many_errors",
                                  "user_mode": "scripted", "tau2_steps": 5})


def test_failed_calls_and_invalid_turns_still_replay(tasks):
    task = tasks["retail"]["10"]
    env = make_env(cfg("retail"))
    env.reset(task)
    env.step(call("get_order_details", 0, order_id="#W0000000"))
    env.step(Message(role="assistant", content="{not json", invalid="no closing brace"))
    for i, g in enumerate(task.gold_actions):
        env.step(Message(role="assistant", tool_calls=[g.model_copy(update={"id": None})]))  # ids filled in
    reward, info = env.reward()
    assert env.state.termination == "transfer" and reward == 1.0, info
    assert env.state.invalid_actions == 1 and env.state.tool_errors == 1


def test_transcript_is_deterministic(tasks):
    def run() -> str:
        env = make_env(cfg("retail"))
        reward, info = replay_gold(env, tasks["retail"]["5"])
        return json.dumps([[m.model_dump() for m in env.state.messages], reward, info], sort_keys=True)
    assert run() == run()


def test_tau2_messages_pairs_results_and_rejects_orphans():
    msgs = [Message(role="system", content="s"), Message(role="assistant", content="hi"),
            Message(role="user", content="u"),
            Message(role="assistant", tool_calls=[ToolCall(name="a"), ToolCall(name="b")]),
            Message(role="tool", name="a", content="1"), Message(role="tool", name="b", content="2")]
    out = tau2_messages(msgs)
    assert [m.role for m in out] == ["assistant", "user", "assistant", "tool", "tool"]
    assert [c.id for c in out[2].tool_calls] == ["call_3_0", "call_3_1"] and [m.id for m in out[3:]] == ["call_3_0", "call_3_1"]
    with pytest.raises(ValueError, match="without a pending tool call"):
        tau2_messages([Message(role="tool", content="x")])


def test_score_messages_records_failures(tasks):
    task = tasks["retail"]["10"]
    forged = [Message(role="assistant", tool_calls=[ToolCall(name="get_order_details", arguments={"order_id": "#W0000000"}, id="x")]),
              Message(role="tool", name="get_order_details", tool_call_id="x", content="not what τ² returns")]
    reward, info = score_messages(task, forged, "user_stop")
    assert reward == 0.0 and info["error"].startswith("ValueError: Tool call")
    no_meta = task.model_copy(update={"meta": {}})
    assert "meta['tau2_task']" in score_messages(no_meta, [], "user_stop")[1]["error"]


# --- users --------------------------------------------------------------------------------------
class BrokenUser:
    def opening(self) -> str:
        return "I need help."

    def reply(self, text: str) -> UserTurn:
        raise ConnectionError("API down")


class HangUpUser(BrokenUser):
    def opening(self) -> str:
        return "Never mind. ###STOP###"


def test_failing_user_ends_as_user_error(tasks):
    env = Tau2Env("retail", user="llm", user_factory=lambda task: BrokenUser())
    env.reset(tasks["retail"]["10"])
    result = env.step(say("How can I help?"))
    assert result.done and result.termination == "user_error"
    reward, info = env.reward()
    assert reward == 0.0 and info["user_error"] == "ConnectionError: API down" and info["user_mode"] == "llm"


def test_opening_stop_ends_at_first_step_without_acting(tasks):
    env = Tau2Env("retail", user="llm", user_factory=lambda task: HangUpUser())
    env.reset(tasks["retail"]["10"])
    assert not env.done
    result = env.step(call("cancel_pending_order", 0, order_id="#W0000000", reason="no longer needed"))
    assert result.done and result.termination == "user_stop" and env.state.tool_calls == 0


def test_build_env_and_errors(tmp_path, tasks):
    env = build_env(cfg("airline"))
    assert isinstance(env, Tau2Env) and env.name == "tau2-airline" and env.max_steps == 200
    llm_env = build_env(cfg("retail", user="llm", user_cache_dir=str(tmp_path)))
    assert llm_env.user_mode == "llm" and isinstance(llm_env._user_factory(tasks["retail"]["0"]), LLMUser)
    with pytest.raises(ValueError, match="not a τ² retail task"):
        make_env(cfg("retail")).reset(tasks["airline"]["0"])
    with pytest.raises(ValueError, match="not a τ² environment"):
        build_env(EnvConfig(name="retail"))
    with pytest.raises(ValueError, match="needs a user_factory"):
        Tau2Env("retail", user="llm")


# --- through the rollout stage ------------------------------------------------------------------
class GoldPolicy:
    """A Generator for trace_lib.agent.rollout that plays each τ² task's gold actions, then says its outputs."""

    policy_id = "gold"

    def __init__(self, tasks: list[Task]) -> None:
        self.by_opening = {t.user.reason_for_call: t for t in tasks}

    def generate(self, conversations, tools, **kw):
        from types import SimpleNamespace

        out = []
        for conv in conversations:
            task = self.by_opening[conv[2].content]
            turn = sum(m.role == "assistant" for m in conv) - 1  # τ²'s greeting is not the policy's
            if turn < len(task.gold_actions):
                msg = Message(role="assistant", tool_calls=[task.gold_actions[turn].model_copy(update={"id": None})])
            else:
                msg = say("Done. " + "; ".join(task.required_outputs))
            out.append(SimpleNamespace(message=msg, prompt_tokens=10, completion_tokens=5))
        return out


def test_rollout_stage_runs_tau2_tasks():
    from trace_lib.config import RolloutConfig
    from trace_lib.agent.rollout import collect_rollouts

    env_cfg = cfg("retail")
    chosen = make_tasks(env_cfg, "test")[:3]
    assert [t.split for t in chosen] == ["test"] * 3
    trajs, _ = collect_rollouts(GoldPolicy(chosen), lambda: make_env(env_cfg), chosen,
                                RolloutConfig(samples_per_task=1, batch_size=2), seed=0, progress=False)
    assert [t.task_id for t in trajs] == sorted(t.id for t in chosen)
    assert all(t.success and t.reward_info["user_mode"] == "scripted" for t in trajs)
    assert trajs[0].messages[3].tool_calls[0].id == "call_0_0"
