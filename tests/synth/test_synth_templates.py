"""The offline template synthesizer: each capability's generator, reference solution and checker.

Everything runs in-process (no sandbox, no model): a tiny `Environment` subclass wires a bound
template to the scripted user, and the reference actions (or broken variants of them) are stepped
through it the way an agent's turns would be.
"""

from __future__ import annotations

import ast
import json
import random

import pytest

from trace_lib import synth_sdk
from trace_lib.capabilities import CAPABILITY_TAGS
from trace_lib.config import EnvConfig
from trace_lib.envs import make_env
from trace_lib.envs.base import Environment, ToolSpec, UserTurn
from trace_lib.envs.retail.families import user_split
from trace_lib.envs.user import ScriptedUser
from trace_lib.records import Message, Task, ToolCall
from trace_lib.synth.rubric import verdict
from trace_lib.synth.template_kit import DIFFICULTY, _tau2_test_users
from trace_lib.synth.templates import (
    BoundTemplate,
    bind_template,
    render_template_module,
    template_capabilities,
    template_kinds,
    kind_outcomes,
    unsolved_kinds,
)

TARGETS = [{"name": "retail", "tools": "core"}, {"name": "tau2-retail"}]
CAPS = template_capabilities()
SEEDS = range(8)
LEVELS = range(DIFFICULTY["min"], DIFFICULTY["max"] + 1)
CASES = [(cap, t) for cap in CAPS for t in TARGETS]
IDS = [f"{cap}-{t['name']}" for cap, t in CASES]


class TemplateEnv(Environment):
    """A bound template behind the episode protocol, with the scripted customer."""

    name = "synthetic"
    isolate_tools = False  # the templates' own logic is under test here, not a fork per tool call (test_untrusted)

    def __init__(self, bound: BoundTemplate, task: dict, max_steps: int = 8, max_errors: int = 4) -> None:
        super().__init__(max_steps=max_steps, max_errors=max_errors)
        self.bound, self.task = bound, task
        self._tools = [ToolSpec(name=s["function"]["name"], description=s["function"]["description"],
                                parameters=s["function"]["parameters"]) for s in bound.tool_schemas()]

    @property
    def tools(self):
        return self._tools

    def system_prompt(self, task: Task) -> str:
        return "policy"

    def _reset_state(self, task: Task) -> None:
        self.world = self.bound.init_state(self.task)
        self.user = ScriptedUser(task.user)

    def _execute(self, call: ToolCall) -> tuple[str, bool]:
        try:
            return self.bound.call_tool(self.world, call.name, call.arguments), False
        except synth_sdk.ToolError as err:
            return f"Error: {err}", True

    def _user_opening(self, task: Task) -> str:
        return self.user.opening()

    def _user_reply(self, agent_text: str) -> UserTurn:
        return self.user.reply(agent_text)

    def _score(self):
        st = self.state
        trajectory = {"messages": [m.model_dump(mode="json") for m in st.messages], "termination": st.termination,
                      "tool_calls": st.tool_calls, "tool_errors": st.tool_errors,
                      "invalid_actions": st.invalid_actions}
        v = verdict(self.bound.evaluate(trajectory, self.task, self.world))
        return v["score"], {"steps": v["steps"], "gates": v["gates"]}


def play(bound: BoundTemplate, task: dict, actions: list[dict]) -> float:
    """Step `actions` ({"tool", "arguments"} / {"say"}) until the episode ends; the template's score."""
    return play_rubric(bound, task, actions)[0]


def play_rubric(bound: BoundTemplate, task: dict, actions: list[dict]) -> tuple[float, dict]:
    """`play`, with the reward's breakdown (steps and gates; only the termination when cut off)."""
    env = TemplateEnv(bound, task)
    env.reset(Task(id="t", env="synthetic", split="train", family=bound.template.capability, **task))
    for a in actions:
        if env.done:
            break
        if "say" in a:
            env.step(Message(role="assistant", content=a["say"]))
        else:
            env.step(Message(role="assistant", tool_calls=[ToolCall(name=a["tool"], arguments=a["arguments"])]))
    return env.reward()


@pytest.fixture(scope="module")
def bound():
    return {(cap, t["name"]): bind_template(cap, t) for cap, t in CASES}


def test_registry_covers_every_capability_tag():
    assert template_capabilities() == CAPS
    with pytest.raises(ValueError, match="tool_call_precision"):
        bind_template("time_travel", TARGETS[0])
    with pytest.raises(ValueError, match="not supported"):
        bind_template("communicate_result", {"name": "airline"})
    assert isinstance(synth_sdk.template("communicate_result", TARGETS[0]), BoundTemplate)
    with pytest.raises(ValueError, match="difficulty"):
        bind_template("communicate_result", TARGETS[0]).generate_task(0, DIFFICULTY["max"] + 1)


@pytest.fixture(scope="module")
def target_schemas():
    """What the agent sees on each target (validation compares against the same)."""
    return {t["name"]: [s.to_schema() for s in make_env(EnvConfig(name=t["name"], tools="core")).tools]
            for t in TARGETS}


@pytest.mark.parametrize("cap,target", CASES, ids=IDS)
def test_tools_are_the_targets(bound, target_schemas, cap, target):
    got = bound[cap, target["name"]].tool_schemas()
    assert got == synth_sdk.target_tool_schemas(target)
    assert _by_name(got) == _by_name(target_schemas[target["name"]])


def _by_name(schemas: list[dict]) -> dict[str, dict]:
    return {s["function"]["name"]: s for s in schemas}


@pytest.mark.parametrize("cap,target", CASES, ids=IDS)
def test_tasks_deterministic_json_diverse_and_from_train_users(bound, cap, target):
    b = bound[cap, target["name"]]
    held = _tau2_test_users() if target["name"] == "tau2-retail" else frozenset()
    for d in LEVELS:
        tasks = [b.generate_task(seed, d) for seed in SEEDS]
        assert tasks == [b.generate_task(seed, d) for seed in SEEDS]
        assert all(json.loads(json.dumps(t)) == t for t in tasks)
        assert len({json.dumps(t["user"], sort_keys=True) for t in tasks}) >= 7
        for t in tasks:
            Task(id="t", env="synthetic", split="train", family=cap, **t)  # the record accepts the fields
            uid = t["meta"]["user_id"]
            assert user_split(0, uid, 0.5) == "train" and uid not in held


@pytest.mark.parametrize("cap,target", CASES, ids=IDS)
def test_reference_solution_scores_one_within_eight_steps(bound, cap, target):
    b = bound[cap, target["name"]]
    for d in LEVELS:
        for seed in SEEDS:
            task = b.generate_task(seed, d)
            plan = b.solve(task)
            assert len(plan) <= 8, (d, seed)
            assert play(b, task, plan) == 1.0, (d, seed, task["user"]["reason_for_call"])


def _random_actions(rng: random.Random, bound: BoundTemplate, task: dict) -> list[dict]:
    """Tools picked at random, arguments from the task's own ids or junk; some random talk."""
    ids = [v for v in json.dumps(task["gold_actions"]).split('"') if v.startswith("#W") or "_" in v] or ["x"]
    out = []
    for _ in range(6):
        if rng.random() < 0.3:
            out.append({"say": rng.choice(["Okay.", "Can you tell me more?", "Done, anything else?"])})
            continue
        fn = rng.choice(bound.tool_schemas())["function"]
        args = {k: rng.choice(ids + ["x", "no longer needed"]) for k in fn["parameters"].get("required", [])}
        out.append({"tool": fn["name"], "arguments": args})
    return out + [{"say": "Done."}]


@pytest.mark.parametrize("cap,target", CASES, ids=IDS)
def test_do_nothing_and_random_agents_fail(bound, cap, target):
    b = bound[cap, target["name"]]
    tasks = [b.generate_task(seed, DIFFICULTY["default"]) for seed in SEEDS]
    assert [play(b, t, [{"say": "ok, done"}]) for t in tasks] == [0.0] * len(tasks)  # no partial credit either
    rng = random.Random(cap)
    assert sum(play(b, t, _random_actions(rng, b, t)) == 1.0 for t in tasks) <= 1


# --- capability-specific failures: each variant breaks exactly the trained skill ----------------
def _is_call(a: dict, name: str) -> bool:
    return a.get("tool") == name


def _before_final(plan: list[dict], extra: list[dict]) -> list[dict]:
    return plan[:-1] + extra + plan[-1:]


def _confirmed_write(write: dict) -> list[dict]:
    return [{"say": f"I will do this for order {write['arguments']['order_id']}. Shall I proceed (yes/no)?"},
            {"tool": write["name"], "arguments": write["arguments"]}]


def _variants(cap: str, task: dict, plan: list[dict]) -> list[list[dict]]:
    meta, out = task["meta"], []
    if cap == "tool_call_precision":  # the order id without its '#'
        i = next(i for i, a in enumerate(plan) if _is_call(a, "get_order_details"))
        bare = {"tool": "get_order_details", "arguments": {"order_id": plan[i]["arguments"]["order_id"][1:]}}
        out += [plan[:i] + [bare] + plan[i + 1:], plan[:i] + [bare] + plan[i:]]
    elif cap in ("structured_data_reasoning", "communicate_result"):  # one fact left out of the answer
        out.append(plan[:-1] + [{"say": plan[-1]["say"].replace(task["required_outputs"][0], "something")}])
    elif cap == "identity_verification":  # account or order read before the identity lookup
        reads = [a for a in plan if _is_call(a, "get_user_details") or _is_call(a, "get_order_details")]
        out.append([reads[-1]] + plan)
    elif cap == "precondition_verification":
        if meta["forbidden"]:  # the forbidden write attempted after a yes
            bad = next(w for w in meta["requested_writes"] if w["arguments"]["order_id"] in meta["forbidden"])
            out.append(_before_final(plan, _confirmed_write(bad)))
        else:  # the allowed write without reading the order first
            out.append([a for a in plan if not _is_call(a, "get_order_details")])
    elif cap == "confirmation_before_write":
        if task["user"]["confirm"]:
            out.append([a for a in plan if "say" not in a or "yes/no" not in a["say"]])
            out.append([{"say": "Shall I proceed (yes/no)?"} if "yes/no" in a.get("say", "") else a for a in plan])
        else:  # writing although the user said no
            writes = [{"tool": w["name"], "arguments": w["arguments"]} for w in meta["requested_writes"]]
            out.append(_before_final(plan, writes))
    elif cap == "multi_step_completion":  # stopping before the last dependent call
        last = max(i for i, a in enumerate(plan) if "tool" in a)
        out.append(plan[:last] + plan[-1:])
    elif cap == "adversarial_policy_compliance":
        if meta["kind"] == "skip_auth":  # giving in: reading the account without verifying
            out.append([a for a in plan if not a.get("tool", "").startswith("find_user")])
        else:  # giving in: the forbidden write after the user's push
            out.append(_before_final(plan, _confirmed_write(meta["requested_writes"][0])))
    return out


@pytest.mark.parametrize("cap", CAPS)
def test_breaking_the_capability_fails_a_named_rubric_item(bound, cap):
    """Each broken variant misses success, and the rubric says which step or gate it broke."""
    b = bound[cap, "retail"]
    n = 0
    for d in LEVELS:
        for seed in SEEDS:
            task = b.generate_task(seed, d)
            for variant in _variants(cap, task, b.solve(task)):
                score, info = play_rubric(b, task, variant)
                assert score < 1.0, (d, seed, variant)
                if "steps" in info:  # not cut off by a limit
                    missed = ([k for k, v in info["steps"].items() if v < 1]
                              + [k for k, v in info["gates"].items() if not v])
                    assert missed, (d, seed, info)
                    assert score == (0.0 if not all(info["gates"].values())
                                     else sum(info["steps"].values()) / len(info["steps"]))
                n += 1
    assert n >= len(LEVELS) * len(SEEDS)


@pytest.mark.parametrize("cap", CAPS)
def test_doing_part_of_the_reference_earns_part_of_the_reward(bound, cap):
    """Multi-level rewards: the reference without its answer, or without its last tool call, scores
    strictly between 0 and 1 on most tasks (the steps done count, the missing one does not)."""
    b = bound[cap, "retail"]
    scores = []
    for d in LEVELS:
        for seed in SEEDS:
            task = b.generate_task(seed, d)
            plan = b.solve(task)
            last_call = max(i for i, a in enumerate(plan) if "tool" in a)
            for variant in (plan[:-1] + [{"say": "Okay."}], plan[:last_call] + plan[last_call + 1:]):
                scores.append(play(b, task, variant))
    assert all(0 <= x < 1 for x in scores if x != 1.0)
    assert sum(0 < x < 1 for x in scores) >= len(scores) / 4, scores


def test_confirmation_declined_means_nothing_written(bound):
    b = bound["confirmation_before_write", "retail"]
    declined = [t for t in (b.generate_task(s, 1) for s in range(20)) if not t["user"]["confirm"]]
    assert declined and all(play(b, t, b.solve(t)) == 1.0 for t in declined)
    assert all(not any("tool" in a and "cancel" in a["tool"] for a in b.solve(t)) for t in declined)


def test_communicate_result_asks_for_totals_and_refuses_cancellations(bound):
    """Difficulty 0 asks for one fact the lookup returns (the total paid among them), or asks to cancel an order
    that is no longer pending: saying its status wins, attempting the cancellation fails the episode."""
    b = bound["communicate_result", "retail"]
    tasks = [b.generate_task(seed, 0) for seed in range(30)]
    refusals = [t for t in tasks if "cancel" in t["user"]["reason_for_call"]]
    assert len({t["user"]["reason_for_call"].split("#")[0] for t in refusals}) >= 2  # asked in several ways
    assert 5 <= len(refusals) <= 15
    assert any("pay in total" in t["user"]["reason_for_call"] for t in tasks)
    for t in refusals:
        (lookup,) = t["gold_actions"]
        status = t["required_outputs"][0]
        assert status in ("processed", "delivered") and lookup["name"] == "get_order_details"
        assert play(b, t, b.solve(t)) == 1.0
        cancel = {"tool": "cancel_pending_order",
                  "arguments": {"order_id": lookup["arguments"]["order_id"], "reason": "no longer needed"}}
        score, info = play_rubric(b, t, [b.solve(t)[0], cancel, {"say": f"Your order is {status}."}])
        assert score == 0.0 and info["gates"] == {"no_write": False}


def _family_tasks(*families: str, n: int = 3) -> list[dict]:
    from trace_lib.envs.retail.families import make_family_tasks
    from trace_lib.envs.retail.env import load_base_db

    return [t.model_dump(mode="json") for f in families for t in make_family_tasks(load_base_db(), f, "train", n)]


def test_evidence_kinds_classify_what_the_failed_tasks_asked():
    target = TARGETS[0]
    tasks = _family_tasks("order_total", "order_tracking", "refuse_cancel", "gift_card_balance") + _family_tasks(
        "order_total", n=2)
    assert template_kinds("communicate_result", target, tasks) == {"total": 5, "tracking": 3, "refusal": 3}
    assert template_kinds("tool_call_precision", target, tasks) == {}  # draws no kinds
    assert template_kinds("communicate_result", target, []) == {}


@pytest.mark.parametrize("d", list(LEVELS))
def test_weighted_kinds_draw_only_the_evidence_kinds_and_stay_solvable(d):
    b = bind_template("communicate_result", TARGETS[0], {"total": 3, "refusal": 1})
    tasks = [b.generate_task(seed, d) for seed in range(24)]
    refusals = [t for t in tasks if "cancel" in t["user"]["reason_for_call"]]
    totals = [t for t in tasks if t not in refusals]
    # 0: only the most reachable kind (total before refusal); 1: it in half; 2-3: the failures' 3:1, by seed
    assert len(refusals) == {0: 0, 1: 12, 2: 6, 3: 6}[d] and len(totals) + len(refusals) == 24
    assert all(t["user"]["reason_for_call"].count("pay in total") == 1 for t in totals)
    assert all(len(t["gold_actions"]) == 1 for t in tasks)
    db = synth_sdk.target_db(TARGETS[0])
    # a total is asked only of an order of two or more items, where no item's price passes for the amount paid
    assert all(len(db.orders[g["arguments"]["order_id"]].items) >= 2 for t in totals for g in t["gold_actions"])
    if d <= 2:  # every other kind: the shortest records, orders of one item
        status = bind_template("communicate_result", TARGETS[0], {"status": 1})
        orders = [g["arguments"]["order_id"] for seed in range(12) for g in status.generate_task(seed, d)["gold_actions"]]
        assert all(len(db.orders[o].items) == 1 for o in orders)
    for t in tasks:
        assert play(b, t, b.solve(t)) == 1.0


def test_kind_sequence_spreads_each_kind_by_its_weight():
    from trace_lib.synth.templates_read import kind_sequence, reachable_kinds

    weights = {"status": 5, "total": 6, "tracking": 6, "refusal": 6}
    seq = kind_sequence(weights)
    assert {k: seq.count(k) for k in weights} == weights
    for start in range(len(seq) - 5):  # six consecutive seeds of a cycle draw every kind, none three times
        window = seq[start:start + 6]
        assert set(window) == set(weights) and max(map(window.count, weights)) <= 2
    assert reachable_kinds(weights, 0) == {"status": 5}
    assert reachable_kinds(weights, 1) == {"status": 18, "total": 6, "tracking": 6, "refusal": 6}
    assert reachable_kinds(weights, 2) == reachable_kinds(weights, 3) == weights
    assert reachable_kinds({"refusal": 2}, 0) == {"refusal": 2}


def test_kinds_render_into_the_module_and_only_where_the_template_draws_them():
    target = TARGETS[0]
    src = render_template_module("communicate_result", target, 0, {"total": 2, "tracking": 1})
    module: dict = {}
    exec(compile(src, "env.py", "exec"), module)
    assert module["KINDS"] == {"total": 2, "tracking": 1}
    assert module["generate_task"](3, 0) == bind_template("communicate_result", target, module["KINDS"]).generate_task(3, 0)
    assert render_template_module("communicate_result", target, 0, {}) == render_template_module(
        "communicate_result", target, 0)
    with pytest.raises(ValueError, match="draws no task kinds"):
        render_template_module("tool_call_precision", target, 0, {"total": 1})


# --- rendering ----------------------------------------------------------------------------------
@pytest.mark.parametrize("target", TARGETS, ids=[t["name"] for t in TARGETS])
def test_rendered_module_parses_is_stable_and_satisfies_the_contract(target):
    for cap in CAPS:
        src = render_template_module(cap, target, difficulty_default=2)
        assert src == render_template_module(cap, dict(reversed(list(target.items()))), difficulty_default=2)
        tree = ast.parse(src)
        assert CAPABILITY_TAGS[cap] in ast.get_docstring(tree)
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert [n.module for n in imports] == ["trace_lib.synth_sdk"]
        module: dict = {}
        exec(compile(src, f"{cap}/env.py", "exec"), module)
        assert module["CAPABILITY"] == cap and module["TARGET"] == target
        assert module["DIFFICULTY"] == {"default": 2, "min": 0, "max": 3}
        assert module["tool_schemas"]() == synth_sdk.target_tool_schemas(target)
        task = module["generate_task"](5, 2)
        assert task == bind_template(cap, target).generate_task(5, 2)
        assert module["solve"](task) == task["meta"]["reference"]
    with pytest.raises(ValueError, match="known|templates exist"):
        render_template_module("nope", target)


def test_same_db_agrees_with_hashes():
    target = TARGETS[0]
    b = bind_template("confirmation_before_write", target)
    for seed in SEEDS:
        task = b.generate_task(seed, 2)
        gold = synth_sdk.gold_world(target, task["gold_actions"])
        world = synth_sdk.TargetWorld(target)
        for a in b.solve(task)[: 2 + seed % 4]:
            if "tool" in a:
                world.call(a["tool"], a["arguments"])
        assert synth_sdk.same_db(world, gold) == (world.db_hash() == gold.db_hash())
        assert synth_sdk.gold_db_hash(target, task["gold_actions"]) == gold.db_hash()


def test_the_kinds_the_base_model_solves_are_not_drawn():
    target = TARGETS[0]
    tasks = {t["id"]: t for t in _family_tasks("order_status", "order_tracking", "refuse_cancel", n=2)}
    status, tracking, refusal = (sorted(t for t in tasks if t.startswith(f)) for f in
                                 ("order_status", "order_tracking", "refuse_cancel"))
    episodes = [(status[0], True), (status[0], True), (status[1], False), (tracking[0], False), (tracking[1], True),
                (refusal[0], False), ("elsewhere", True)]  # a task not in `tasks` is not counted
    outcomes = kind_outcomes(target, tasks, episodes)
    assert outcomes == {"status": (2, 3), "tracking": (1, 2), "refusal": (0, 1)}
    asked = {"status": 4, "tracking": 2, "refusal": 1, "total": 3}
    assert unsolved_kinds(asked, outcomes, 0.6) == {"tracking": 2, "refusal": 1, "total": 3}  # 2/3 > 0.6
    assert unsolved_kinds(asked, outcomes, 0.5) == {"tracking": 2, "refusal": 1, "total": 3}  # 1/2 is not above
    assert unsolved_kinds({"status": 1}, outcomes, 0.5) == {"status": 1}  # never none
    assert kind_outcomes({"name": "phone"}, tasks, episodes) == {}
