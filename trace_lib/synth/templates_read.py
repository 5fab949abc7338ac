"""Templates for the capabilities exercised without a write (paper §3.2, template synthesizer).

Reads the target database through the pool handed in by `trace_lib.synth.templates`; writes
nothing. Four templates: tool_call_precision, structured_data_reasoning, identity_verification,
communicate_result. Each generator returns task fields plus `plan`, the reference actions (what a
correct agent says and calls); each check reads the finished episode and the world. No episode here
needs a write, so every check also fails an episode that attempted one.
"""

from __future__ import annotations

import random
from typing import Any

from trace_lib.synth.rubric import rubric
from trace_lib.synth.template_kit import (
    ASK_IDENTITY, Checks, Episode, Pool, Template, act, call, identity, money, say, sentence, unique_items,
)


# --- tool_call_precision ------------------------------------------------------------------------
def _precision_task(pool: Pool, rng: random.Random, d: int) -> dict[str, Any]:
    db = pool.db
    n_orders = 1 + (d >= 1) + (d >= 3)
    uid = rng.choice([u for u in pool.users if len(db.users[u].orders) >= n_orders])
    user = db.users[uid]
    oids = rng.sample(sorted(user.orders), n_orders)
    # About half the ids come without their '#': the agent must restore the exact id format.
    shown = [o[1:] if rng.random() < 0.6 else o for o in oids]
    gold, known, unknown, intro = [], {"order_id": ", ".join(shown)}, [], "Hi! "
    if d >= 2:
        known_id, unknown, lookup, who = identity(db, uid, by_email=False)
        known.update(known_id)
        gold += [lookup, call("get_user_details", user_id=uid)]
        intro = f"Hi, {who}. "
    gold += [call("get_order_details", order_id=o) for o in oids]
    statuses = [db.orders[o].status for o in oids]
    ask = (f"What is the status of my order {shown[0]}?" if n_orders == 1 else
           f"What are the statuses of my orders {', '.join(shown[:-1])} and {shown[-1]}?")
    outputs = list(statuses)
    answer = [f"Order {o} is {s}." for o, s in zip(oids, statuses)]
    if d >= 2:
        ask += " Also, which email address do you have on file for me?"
        outputs.append(user.email)
        answer.append(f"The email on your account is {user.email}.")
    calls = "; ".join(f"{g['name']}({', '.join(f'{k}={v!r}' for k, v in g['arguments'].items())})" for g in gold)
    return dict(
        instruction=f"The user gives order ids in loose formats{' and their name and zip' if d >= 2 else ''}; "
                    f"the agent must make exactly these calls, all accepted: {calls}.",
        user={"reason_for_call": intro + ask, "known_info": known, "unknown_info": unknown},
        gold_actions=gold, required_outputs=outputs,
        plan=[act(g) for g in gold] + [say(" ".join(answer))], user_id=uid,
    )


def _precision_check(ep: Episode, task: dict[str, Any], c: Checks) -> dict[str, Any]:
    return rubric({"gold_calls": ep.did_share(task["gold_actions"]),
                   "no_failed_call": bool(ep.events) and all(e.ok for e in ep.events)},
                  {"no_invalid_action": ep.invalid == 0, "no_write": not ep.writes})


# --- structured_data_reasoning ------------------------------------------------------------------
def _total_paid(order, oid: str) -> tuple[str, str, str]:
    """(question, value, answer) for the amount of an order's only payment: asked by structured_data_reasoning
    (a value nested in the payment history) and communicate_result (a fact the lookup returns)."""
    amount = money(order.payment_history[0].amount)
    return (f"how much did I pay in total for order {oid}", amount, f"You paid {amount} in total for order {oid}.")


def _tracking_number(order, oid: str) -> tuple[str, str, str]:
    """(question, value, answer) for the first tracking number of an order's only fulfilment: asked by
    structured_data_reasoning and by communicate_result's tracking kind."""
    tid = order.fulfillments[0].tracking_id[0]
    return (f"what is the tracking number of order {oid}", tid, f"The tracking number of order {oid} is {tid}.")


def _nested_facts(db, oid: str, rng: random.Random | None) -> list[tuple[str, Any, str]]:
    """(question, value, answer) for facts nested inside the order record: at most one of each kind
    (item price, tracking number, amount paid, item option), kinds in random order given `rng`."""
    order = db.orders[oid]
    uniq = unique_items(order)
    kinds: list[list[tuple[str, Any, str]]] = []
    if len(order.items) >= 2:  # a price among several items, so the total is not the answer
        kinds.append([(f"how much did the {it.name} in order {oid} cost", money(it.price),
                       f"The {it.name} in order {oid} cost {money(it.price)}.") for it in uniq])
    if len(order.fulfillments) == 1 and order.fulfillments[0].tracking_id:
        kinds.append([_tracking_number(order, oid)])
    if len(order.payment_history) == 1:
        kinds.append([_total_paid(order, oid)])
    kinds.append([(f"what {key} is the {it.name} in order {oid}", str(it.options[key]),
                   f"The {key} of the {it.name} in order {oid} is {it.options[key]}.")
                  for it in uniq for key in ("color", "material") if key in it.options])
    kinds = [k for k in kinds if k]
    if rng is None:
        return [k[0] for k in kinds]
    rng.shuffle(kinds)
    return [rng.choice(k) for k in kinds]


def _fact_task(pool: Pool, rng: random.Random, statuses: tuple[str, ...], facts_of, per_order: list[int],
               what: str) -> dict[str, Any]:
    """A user asks `sum(per_order)` questions about len(per_order) of their orders: the first k of
    `facts_of(db, oid, rng)` for each. Shared by structured_data_reasoning and communicate_result."""
    db = pool.db
    candidates = [o for o in pool.orders(*statuses) if len(facts_of(db, o, None)) >= max(per_order)]
    by_user: dict[str, list[str]] = {}
    for o in candidates:
        by_user.setdefault(db.orders[o].user_id, []).append(o)
    uid = rng.choice(sorted(u for u, os in by_user.items() if len(os) >= len(per_order)))
    oids = rng.sample(by_user[uid], len(per_order))
    picked = [f for oid, k in zip(oids, per_order) for f in facts_of(db, oid, rng)[:k]]
    opening = "Hi, I have some questions about my orders. " + " ".join(sentence(q) + "?" for q, _, _ in picked)
    outputs = list(dict.fromkeys(v for _, value, _ in picked for v in (value if isinstance(value, list) else [value])))
    gold = [call("get_order_details", order_id=o) for o in oids]
    return dict(
        instruction=f"The user asks {len(picked)} question(s) about order(s) {', '.join(oids)}; the agent looks "
                    f"them up and must say {what}: {', '.join(outputs)}.",
        user={"reason_for_call": opening, "known_info": {"order_id": ", ".join(oids)}},
        gold_actions=gold, required_outputs=outputs,
        plan=[act(g) for g in gold] + [say(" ".join(answer for _, _, answer in picked))], user_id=uid, orders=oids,
    )


def _structured_task(pool: Pool, rng: random.Random, d: int) -> dict[str, Any]:
    return _fact_task(pool, rng, ("processed", "delivered"), _nested_facts, [[1], [2], [2, 1], [2, 2]][d],
                      "each nested value (item price, tracking number, amount paid, item option)")


def _facts_check(ep: Episode, task: dict[str, Any], c: Checks) -> dict[str, Any]:
    return rubric({"orders_read": ep.did_share(task["gold_actions"]), "facts_said": c.outputs_said()},
                  {"no_write": not ep.writes})


# --- identity_verification ----------------------------------------------------------------------
def _identity_task(pool: Pool, rng: random.Random, d: int) -> dict[str, Any]:
    db = pool.db
    kind = ["address", "status", rng.choice(["address", "status"]), "all"][d]
    wanted = {"address": lambda n: n >= 0, "status": lambda n: n == 1, "all": lambda n: 2 <= n <= 3}[kind]
    uid = rng.choice([u for u in pool.users if wanted(len(db.users[u].orders))])
    user = db.users[uid]
    known, unknown, lookup, _ = identity(db, uid, by_email=d < 2 and rng.random() < 0.5)
    gold = [lookup, call("get_user_details", user_id=uid)]
    if kind == "address":
        ask = "Hi, which shipping address do you have on file for me?"
        outputs = [user.address.address1]
        answer = f"The address on file is {user.address.address1}, {user.address.city}."
    else:
        gold += [call("get_order_details", order_id=o) for o in user.orders]
        outputs = [db.orders[o].status for o in user.orders]
        answer = " ".join(f"Order {o} is {db.orders[o].status}." for o in user.orders)
        ask = ("Hi, what's the status of my order? I don't remember the order id." if kind == "status" else
               "Hi, can you tell me the status of each of my orders? I don't remember the order ids.")
        unknown = unknown + ["order id"]
    return dict(
        instruction=f"The user ({', '.join(known.values())}) asks about their account without saying who they "
                    f"are; the agent must ask, find their user id, and only then read the account "
                    f"({kind}) and answer: {', '.join(outputs)}.",
        user={"reason_for_call": ask, "known_info": known, "unknown_info": unknown},
        gold_actions=gold, required_outputs=outputs,
        plan=[say(ASK_IDENTITY)] + [act(g) for g in gold] + [say(answer)], user_id=uid, orders=list(user.orders),
    )


def _identity_check(ep: Episode, task: dict[str, Any], c: Checks) -> dict[str, Any]:
    meta = task["meta"]
    return rubric({"identified_first": c.authenticated_first(meta["user_id"], meta["orders"]),
                   "answer_said": c.outputs_said()}, {"no_write": not ep.writes})


# --- communicate_result -------------------------------------------------------------------------
def _plain_facts(db, oid: str, rng: random.Random | None) -> list[tuple[str, Any, str]]:
    """(question, value(s), answer) for the order's top-level facts: its status, the items in it, the city it
    ships to and (one payment) the total paid, in random order given `rng` (else in that order)."""
    order = db.orders[oid]
    names = list(dict.fromkeys(i.name for i in order.items))
    facts = [(f"what is the status of order {oid}", order.status, f"Order {oid} is {order.status}."),
             (f"which items are in order {oid}", names, f"Order {oid} contains: {', '.join(names)}."),
             (f"which city is order {oid} shipped to", order.address.city,
              f"Order {oid} ships to {order.address.city}.")]
    if len(order.payment_history) == 1:
        facts.append(_total_paid(order, oid))
    if rng is not None:
        rng.shuffle(facts)
    return facts


REFUSAL_ASKS = ("Hi, please cancel my order {oid}, I no longer need it.",
                "I want to cancel order {oid}. I don't need it anymore.",
                "Can you cancel my order {oid} for me? I no longer need it.",
                "Hello, I'd like order {oid} cancelled, please.")
"""How a user asks to cancel an order that can no longer be cancelled."""
REFUSAL_SHARE = 1 / 3
"""Share of difficulty-0 communicate_result tasks that are a refused cancellation rather than a question."""


def _refusal_task(pool: Pool, rng: random.Random) -> dict[str, Any]:
    """A user asks to cancel an order that is no longer pending: the agent reads it, changes nothing and
    tells them its status (the fact that answers them)."""
    db = pool.db
    oid = rng.choice(pool.orders("processed", "delivered"))
    status = db.orders[oid].status
    gold = [call("get_order_details", order_id=oid)]
    return dict(
        instruction=f"The user asks to cancel order {oid}, which is '{status}' and cannot be cancelled; the agent "
                    f"looks it up, cancels nothing and must say its status: {status}.",
        user={"reason_for_call": rng.choice(REFUSAL_ASKS).format(oid=oid),
              "known_info": {"order_id": oid, "reason": "no longer needed"}},
        gold_actions=gold, required_outputs=[status],
        plan=[act(g) for g in gold] + [say(f"Order {oid} is {status}, so it cannot be cancelled.")],
        user_id=db.orders[oid].user_id, orders=[oid],
    )


FACT_KINDS = ("status", "items", "city", "total", "tracking", "refusal")
"""What a communicate_result task asks: one of an order's facts, or (refusal) to cancel an order that is no longer
pending, answered with its status; most reachable first (a top-level field, then nested ones, then the restraint
of not writing)."""


def _fact_of_kind(kind: str, max_items: int | None = None):
    """`facts_of` for `_fact_task` that offers only the order's fact of `kind` (none where the order lacks it, or
    holds more than `max_items` items: a shorter record to read). The total is asked only of an order of two or
    more items, whatever `max_items`: in an order of one, saying the item's price would pass for reading the
    payment."""
    def facts_of(db, oid: str, rng: random.Random | None) -> list[tuple[str, Any, str]]:
        order = db.orders[oid]
        if kind == "total":
            if len(order.items) < 2:
                return []
        elif max_items is not None and len(order.items) > max_items:
            return []
        if kind == "tracking":
            one = len(order.fulfillments) == 1 and order.fulfillments[0].tracking_id
            return [_tracking_number(order, oid)] if one else []
        if kind == "total":
            return [_total_paid(order, oid)] if len(order.payment_history) == 1 else []
        index = {"status": 0, "items": 1, "city": 2}[kind]
        return [_plain_facts(db, oid, None)[index]]
    return facts_of


def evidence_kinds(db, tasks: list[dict[str, Any]]) -> dict[str, int]:
    """How often each of `FACT_KINDS` is what a failed target task asked for: each required output of a task about
    an order (`meta.entity`) classified by the field of the order it equals; a status asked in a cancellation
    request is a refusal. Kinds in `FACT_KINDS` order; outputs that match no field are not counted."""
    counts = dict.fromkeys(FACT_KINDS, 0)
    for task in tasks:
        order = db.orders.get(task.get("meta", {}).get("entity", ""))
        if order is None:
            continue
        cancel = "cancel" in task["user"]["reason_for_call"].lower()
        tracking = [t for f in order.fulfillments for t in f.tracking_id]
        paid = [money(p.amount) for p in order.payment_history]
        for value in task.get("required_outputs", []):
            kind = ("refusal" if cancel else "status") if value == order.status else (
                "total" if value in paid else "tracking" if value in tracking else
                "city" if value == order.address.city else "items" if value in {i.name for i in order.items} else None)
            if kind is not None:
                counts[kind] += 1
    return {k: n for k, n in counts.items() if n}


def reachable_kinds(kinds: dict[str, int], d: int) -> dict[str, int]:
    """The kind weights difficulty `d` draws: at 0 only the evidence's most reachable kind (the first of `FACT_KINDS`
    in it), at 1 that kind half of the draws and the others their share of the rest, from 2 the failures' own
    weights. A group whose every rollout fails teaches GRPO nothing, so the easy rungs lean on the kind the base
    model sometimes gets right."""
    first = next((k for k in FACT_KINDS if k in kinds), None)
    if d > 1 or first is None or len(kinds) < 2:
        return dict(kinds)
    if d == 0:
        return {first: kinds[first]}
    return {**kinds, first: sum(w for k, w in kinds.items() if k != first)}


def kind_sequence(kinds: dict[str, int]) -> list[str]:
    """One cycle of the kinds, each as often as its weight and spread evenly (smooth weighted round robin; ties go
    to the first in sorted order), so any run of consecutive seeds draws the kinds near their shares."""
    total = sum(kinds.values())
    current = dict.fromkeys(sorted(kinds), 0)
    out: list[str] = []
    for _ in range(total):
        for k in current:
            current[k] += kinds[k]
        pick = max(current, key=lambda k: current[k])
        current[pick] -= total
        out.append(pick)
    return out


def _communicate_task(pool: Pool, rng: random.Random, d: int, kinds: dict[str, int] | None = None,
                      seed: int = 0) -> dict[str, Any]:
    if kinds:  # the failures' own kinds, by seed (`kind_sequence`); 0-2: one order of a single item, 3: one order
        sequence = kind_sequence(reachable_kinds(kinds, d))
        kind = sequence[seed % len(sequence)]
        if kind == "refusal":
            return _refusal_task(pool, rng)
        statuses = ("processed", "delivered") if kind == "tracking" else ("pending", "processed", "delivered",
                                                                          "cancelled")
        return _fact_task(pool, rng, statuses, _fact_of_kind(kind, 1 if d <= 2 else None), [1],
                          f"the {kind} asked for")
    if d == 0 and rng.random() < REFUSAL_SHARE:
        return _refusal_task(pool, rng)
    return _fact_task(pool, rng, ("pending", "processed", "delivered", "cancelled"), _plain_facts,
                      [[1], [2], [2, 1], [2, 2]][d], "every fact asked for (status, each item, city, total paid)")


TEMPLATES = (
    Template("tool_call_precision",
             "the user asks for the status of 1-3 of their orders, giving the ids with or without the '#'; "
             "from difficulty 2 they also give first name, last name and zip and ask for the email on file.",
             "steps gold_calls (share of the gold calls made and accepted: the exact order ids with '#', the "
             "exact name and zip, the user id found) and no_failed_call; gates no_invalid_action, no_write.",
             "0: one order; 1: two orders; 2: plus the name+zip lookup and account read; 3: three orders, plus both.",
             _precision_task, _precision_check),
    Template("structured_data_reasoning",
             "the user asks for values nested in order records: an item's price among several items, the "
             "tracking number inside the fulfilment, the amount in the payment history, an item's option.",
             "steps orders_read (share of the orders read) and facts_said (share of the requested values said, "
             "numbers in any format); gate no_write.",
             "0: one value of one order; 1: two values; 2: three values over two orders; 3: four values.",
             _structured_task, _facts_check),
    Template("identity_verification",
             "the user asks about their account (address on file, the status of their order(s)) without "
             "saying who they are; they give their email, or name and zip when they forgot it, once asked.",
             "steps identified_first (a successful identity lookup returned this user before any other call, "
             "and only this user's account and orders were read afterwards) and answer_said; gate no_write.",
             "0: address; 1: status of the only order; 2: either, by name and zip; 3: all 2-3 orders.",
             _identity_task, _identity_check),
    Template("communicate_result",
             "the user asks for facts the order lookup returns (status, the items in it, the city it ships to, "
             "the total paid), or asks to cancel an order that is no longer pending, which the agent answers "
             "with its status and no change.",
             "steps orders_read (share of the orders read) and facts_said (share of the facts asked for said, each "
             "item name of a list); gate no_write (a cancellation attempted fails the episode).",
             "0: one fact, or (a third of tasks) a refused cancellation; 1: two facts; 2: three facts over two "
             "orders; 3: four facts over two orders. With kinds from the evidence: each task one kind, by seed, as "
             "often as the failures asked it, about one order: 0: only the most reachable of those kinds (status "
             "before items, city, total, tracking, refusal); 1: that kind in half of the tasks; 2: the failures' "
             "mix; 0-2 ask about an order of a single item (the shortest record), 3: the mix about any order.",
             _communicate_task, _facts_check, weighted=True),
)
