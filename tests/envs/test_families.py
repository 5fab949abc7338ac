"""Procedural retail families: well-formed, deterministic, split without leakage, solvable by gold."""

from collections import Counter

import pytest

from trace_lib.capabilities import CAPABILITY_TAGS
from trace_lib.config import EnvConfig
from trace_lib.envs.retail.families import (
    FAMILIES,
    FULL_SET,
    core_tool_names,
    family_names,
    make_family_tasks,
    user_split,
)
from trace_lib.envs.retail.env import RetailEnv, build_tasks, load_base_db
from trace_lib.io import dumps_json
from trace_lib.records import Message


@pytest.fixture(scope="module")
def db():
    return load_base_db()


def test_family_names_and_vocabulary():
    names = family_names()
    assert 5 <= len(names) <= 8
    assert list(names) == [f.name for f in FAMILIES]
    assert all(desc.strip() for desc in names.values())
    assert [f.difficulty for f in FAMILIES] == sorted(f.difficulty for f in FAMILIES)
    for f in FAMILIES:
        assert set(f.tags) <= set(CAPABILITY_TAGS)
        assert set(f.tools) <= set(core_tool_names())
    assert "transfer_to_human_agents" in core_tool_names()


def test_tasks_are_well_formed(db):
    tasks = build_tasks(EnvConfig(tasks_per_family=4, families=list(family_names())), "all")
    assert len(tasks) == 2 * 4 * len(FAMILIES)
    assert len({t.id for t in tasks}) == len(tasks)
    for t in tasks:
        assert t.env == "retail" and t.split in ("train", "test") and t.gold_actions
        assert set(t.capability_tags) <= set(CAPABILITY_TAGS) and t.capability_tags
        # the user never already knows what it is supposed not to know
        assert not set(t.user.unknown_info) & set(t.user.known_info)
        # required facts come from the tools, not from the user's own words
        for out in t.required_outputs:
            assert out.lower() not in t.user.reason_for_call.lower()
    easy = [t for t in tasks if t.family == "order_status"]
    assert all(t.meta["entity"] in t.user.reason_for_call for t in easy)


def test_same_seed_same_bytes_other_seed_differs(db):
    a = build_tasks(EnvConfig(tasks_per_family=3, seed=7), "all")
    b = build_tasks(EnvConfig(tasks_per_family=3, seed=7), "all")
    c = build_tasks(EnvConfig(tasks_per_family=3, seed=8), "all")
    assert [dumps_json(t.model_dump()) for t in a] == [dumps_json(t.model_dump()) for t in b]
    assert [t.meta["entity"] for t in a] != [t.meta["entity"] for t in c]


def test_task_i_stable_when_more_tasks_requested(db):
    few = make_family_tasks(db, "return_item", "train", 2, seed=3)
    many = make_family_tasks(db, "return_item", "train", 6, seed=3)
    assert many[:2] == few


def test_the_test_split_can_hold_more_tasks_per_family_and_keeps_the_smaller_ones(db):
    small = EnvConfig(tasks_per_family=2)
    large = EnvConfig(tasks_per_family=2, test_tasks_per_family=5)
    assert build_tasks(large, "train") == build_tasks(small, "train")
    test = build_tasks(large, "test")
    assert Counter(t.family for t in test) == {f: 5 for f in FULL_SET}
    assert [t for t in test if int(t.id[-3:]) < 2] == build_tasks(small, "test")
    assert [t.split for t in build_tasks(large, "all")].count("test") == 5 * len(FULL_SET)


def test_splits_share_no_user_or_order(db):
    cfg = EnvConfig(tasks_per_family=20)
    train, test = build_tasks(cfg, "train"), build_tasks(cfg, "test")
    assert {t.meta["user_id"] for t in train}.isdisjoint({t.meta["user_id"] for t in test})
    assert {t.meta["entity"] for t in train}.isdisjoint({t.meta["entity"] for t in test})
    assert all(user_split(cfg.seed, t.meta["user_id"], cfg.test_fraction) == t.split for t in train + test)
    share = sum(user_split(0, u, 0.5) == "test" for u in db.users) / len(db.users)
    assert 0.4 < share < 0.6


def test_a_validation_split_takes_train_users_and_leaves_the_test_split_as_it_was(db):
    plain = EnvConfig(families=["order_status", "order_total"], tasks_per_family=4)
    held = plain.model_copy(update={"validation_fraction": 0.2})
    assert build_tasks(held, "test") == build_tasks(plain, "test")
    splits = {s: build_tasks(held, s) for s in ("train", "validation", "test")}
    users = {s: {t.meta["user_id"] for t in ts} for s, ts in splits.items()}
    assert users["validation"] and users["train"].isdisjoint(users["validation"])
    assert users["test"].isdisjoint(users["validation"])
    assert all(t.split == "validation" and t.id.startswith(f"{t.family}-validation-") for t in splits["validation"])
    assert [t.split for t in build_tasks(held, "all")] == ["train"] * 8 + ["validation"] * 8 + ["test"] * 8
    assert "validation" not in {t.split for t in build_tasks(plain, "all")}
    share = sum(user_split(0, u, 0.5, 0.2) == "validation" for u in db.users) / len(db.users)
    assert 0.15 < share < 0.25
    assert [user_split(0, u, 0.5) == "test" for u in db.users] == [
        user_split(0, u, 0.5, 0.2) == "test" for u in db.users]
    with pytest.raises(ValueError, match="env.validation_fraction above 0"):
        build_tasks(plain, "validation")
    sized = held.model_copy(update={"validation_tasks_per_family": 3})
    assert len(build_tasks(sized, "validation")) == 6


def test_family_selection_and_errors(db):
    tasks = build_tasks(EnvConfig(families=["order_total"], tasks_per_family=2), "test")
    assert [t.family for t in tasks] == ["order_total"] * 2
    with pytest.raises(ValueError, match="unknown family 'nope'"):
        build_tasks(EnvConfig(families=["nope"]), "train")
    with pytest.raises(ValueError, match="split must be"):
        build_tasks(EnvConfig(), "dev")
    with pytest.raises(ValueError, match="only .* distinct"):
        make_family_tasks(db, "order_status", "train", 10_000)


def test_tags_mark_adversarial_pressure(db):
    tasks = make_family_tasks(db, "refuse_cancel", "train", 12)
    pushed = [t for t in tasks if "just cancel it" in t.user.reason_for_call]
    assert pushed and len(pushed) < len(tasks)
    assert all("adversarial_policy_compliance" in t.capability_tags for t in pushed)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_every_family_solvable_by_gold_on_many_seeds(seed):
    """A perfect agent (gold calls, a yes/no question before writes, the required facts) scores 1."""
    env = RetailEnv()
    for task in build_tasks(EnvConfig(tasks_per_family=2, seed=seed, families=list(family_names())), "all"):
        env.reset(task)
        for gold in task.gold_actions:
            if env.tool_kinds()[gold.name] == "write":
                env.step(Message(role="assistant", content="I will do that now. Shall I go ahead (yes/no)?"))
            assert not env.step(Message(role="assistant", tool_calls=[gold])).observations[0].error
        env.step(Message(role="assistant", content="Result: " + ", ".join(task.required_outputs)))
        reward, info = env.reward()
        assert reward == 1.0, (seed, task.id, info)


def test_an_empty_family_list_is_the_full_seven_family_set(db):
    tasks = build_tasks(EnvConfig(tasks_per_family=1), "train")
    assert [t.family for t in tasks] == [f for f in family_names() if f in FULL_SET] and len(FULL_SET) == 7


def test_order_tracking_asks_the_one_tracking_number(db):
    tasks = make_family_tasks(db, "order_tracking", "train", 6)
    for t in tasks:
        order = db.orders[t.meta["entity"]]
        assert order.status in ("processed", "delivered")
        assert t.required_outputs == order.fulfillments[0].tracking_id
        assert t.meta["entity"] in t.user.reason_for_call and "tracking number" in t.user.reason_for_call
