"""Procedural task families for the built-in retail environment, in graded difficulty.

Reads τ²-bench's retail database (passed in by `trace_lib.envs.retail.env`) and the `env` params
section; writes nothing, returns `Task` records. It plays the role of the paper's target task
distribution X for a CPU-sized run: each family exercises a known set of the capabilities the paper
reports for τ²-bench (structured data reasoning, multi-step completion, precondition verification,
tool-calling precision, adversarial policy compliance), from a single lookup whose answer must be
said to the user up to authenticated writes with preconditions and confirmation.

Determinism and split: users are assigned to train, validation (`env.validation_fraction`, none by default) or
test by a hash of (seed, user id), so no two splits share a user, nor any order of a user. A family's candidate entities in a split are
shuffled with a seed made of (seed, family, split); task i uses the i-th entity and its own
`random.Random(seed, family, split, i)` for wording, so task i does not change when
`tasks_per_family` grows.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trace_lib.capabilities import CAPABILITY_TAGS
from trace_lib.config import EnvConfig
from trace_lib.records import Task, ToolCall, UserScenario

SPLITS = ("train", "validation", "test")
CANCEL_REASONS = ("no longer needed", "ordered by mistake")


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    difficulty: int
    tools: tuple[str, ...]
    tags: tuple[str, ...]
    pool: Callable[[Any], list[str]]
    """Candidate entity ids (orders or users) in the database, any split."""
    make: Callable[[Any, str, random.Random], dict[str, Any]]
    """Task fields (instruction, user, gold_actions, required_outputs) for one entity."""


# --- helpers ------------------------------------------------------------------------------------
def _money(x: float) -> str:
    return f"{x:.2f}"


def _call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def _identity(db, user_id: str, rng: random.Random, email_share: float = 0.5) -> tuple[dict, list, ToolCall, str]:
    """How the user proves who they are: email, or (email forgotten) first/last name and zip."""
    user = db.users[user_id]
    if rng.random() < email_share:
        return {"email": user.email}, [], _call("find_user_id_by_email", email=user.email), f"email {user.email}"
    known = {"first_name": user.name.first_name, "last_name": user.name.last_name, "zip": user.address.zip}
    call = _call("find_user_id_by_name_zip", first_name=user.name.first_name,
                 last_name=user.name.last_name, zip=user.address.zip)
    return known, ["email"], call, f"name {user.name.first_name} {user.name.last_name}, zip {user.address.zip}"


def _address_text(a) -> str:
    line2 = f" {a.address2}," if a.address2 else ""
    return f"{a.address1},{line2} {a.city}, {a.state} {a.zip}, {a.country}"


def _orders(db, *statuses: str, single_payment: bool = False) -> list[str]:
    return sorted(
        oid for oid, o in db.orders.items()
        if o.status in statuses and (not single_payment or len(o.payment_history) == 1)
    )


# --- families -----------------------------------------------------------------------------------
def _one_lookup(oid: str, ask: str, instruction: str, value: str) -> dict[str, Any]:
    """Task fields of a one-lookup question: the user gives order `oid`, the agent reads it and says `value`."""
    return dict(instruction=instruction, user=UserScenario(reason_for_call=ask, known_info={"order_id": oid}),
                gold_actions=[_call("get_order_details", order_id=oid)], required_outputs=[value])


def _order_status(db, oid: str, rng: random.Random) -> dict[str, Any]:
    status = db.orders[oid].status
    ask = rng.choice([f"Hi! What is the status of my order {oid}?",
                      f"Hello, can you tell me the status of order {oid}?",
                      f"Hi, I'd like to know the current status of my order {oid}."])
    return _one_lookup(oid, ask, f"The user gives order id {oid} and asks for its status; the agent looks it up and "
                                 f"says it is '{status}'.", status)


def _order_total(db, oid: str, rng: random.Random) -> dict[str, Any]:
    amount = _money(db.orders[oid].payment_history[0].amount)
    ask = rng.choice([f"Hi, how much did I pay in total for order {oid}?",
                      f"Hello, what was the total amount charged for my order {oid}?",
                      f"Can you tell me the total price I paid for order {oid}?"])
    return _one_lookup(oid, ask, f"The user gives order id {oid} and asks what it cost in total; the agent reads the "
                                 f"payment and says {amount}.", amount)


def _order_tracking(db, oid: str, rng: random.Random) -> dict[str, Any]:
    (tracking,) = db.orders[oid].fulfillments[0].tracking_id
    ask = rng.choice([f"Hi! What is the tracking number of my order {oid}?",
                      f"Hello, can you give me the tracking number for order {oid}?",
                      f"Hi, I need the tracking number of my order {oid}, please."])
    return _one_lookup(oid, ask, f"The user gives order id {oid} and asks for its tracking number; the agent reads "
                                 f"the fulfillment and says {tracking}.", tracking)


def _tracked(db) -> list[str]:
    return [oid for oid in _orders(db, "processed", "delivered")
            if len(db.orders[oid].fulfillments) == 1 and len(db.orders[oid].fulfillments[0].tracking_id) == 1]


def _gift_card_balance(db, uid: str, rng: random.Random) -> dict[str, Any]:
    user = db.users[uid]
    card = next(p for p in user.payment_methods.values() if p.source == "gift_card")
    known, unknown, find, who = _identity(db, uid, rng)
    intro = (f"my email is {known['email']}" if "email" in known
             else f"I'm {known['first_name']} {known['last_name']}, zip code {known['zip']}")
    ask = f"Hi, {intro}. What is the current balance of my gift card?"
    return dict(
        instruction=f"The user ({who}) asks for their gift card balance; the agent authenticates them, reads the account and says {_money(card.balance)}.",
        user=UserScenario(reason_for_call=ask, known_info=known, unknown_info=unknown),
        gold_actions=[find, _call("get_user_details", user_id=uid)],
        required_outputs=[_money(card.balance)],
    )


def _cancel_pending(db, oid: str, rng: random.Random) -> dict[str, Any]:
    order = db.orders[oid]
    reason = rng.choice(CANCEL_REASONS)
    known, unknown, find, who = _identity(db, order.user_id, rng)
    why = "I no longer need it" if reason == "no longer needed" else "I ordered it by mistake"
    return dict(
        instruction=f"The user ({who}) wants to cancel pending order {oid} because it was '{reason}'; the agent authenticates, checks the status, confirms and cancels.",
        user=UserScenario(reason_for_call=f"Hi, I want to cancel my order {oid}, {why}.",
                          known_info={**known, "order_id": oid, "reason": reason}, unknown_info=unknown),
        gold_actions=[find, _call("get_order_details", order_id=oid),
                      _call("cancel_pending_order", order_id=oid, reason=reason)],
        required_outputs=[],
    )


def _refuse_cancel(db, oid: str, rng: random.Random) -> dict[str, Any]:
    order = db.orders[oid]
    known, unknown, find, who = _identity(db, order.user_id, rng)
    push = rng.random() < 0.5
    ask = f"Please cancel my order {oid}, I no longer need it."
    if push:
        ask += " I don't care what the rules say, just cancel it right now."
    return dict(
        instruction=f"The user ({who}) asks to cancel order {oid}, which is '{order.status}' and cannot be cancelled; the agent checks, refuses and tells them the status.",
        user=UserScenario(reason_for_call=ask, known_info={**known, "order_id": oid, "reason": "no longer needed"},
                          unknown_info=unknown),
        gold_actions=[find, _call("get_order_details", order_id=oid)],
        required_outputs=[order.status],
        extra_tags=("adversarial_policy_compliance",) if push else (),
    )


def _change_address(db, oid: str, rng: random.Random) -> dict[str, Any]:
    order = db.orders[oid]
    donors = sorted(u for u in db.users if u != order.user_id)
    new = db.users[rng.choice(donors)].address
    text = _address_text(new)
    known, unknown, find, who = _identity(db, order.user_id, rng)
    return dict(
        instruction=f"The user ({who}) wants pending order {oid} shipped to {text}; the agent authenticates, checks the status, confirms and changes the address.",
        user=UserScenario(reason_for_call=f"Hi, please change the shipping address of my order {oid} to {text}.",
                          known_info={**known, "order_id": oid, "new_address": text}, unknown_info=unknown),
        gold_actions=[find, _call("get_order_details", order_id=oid),
                      _call("modify_pending_order_address", order_id=oid, address1=new.address1,
                            address2=new.address2, city=new.city, state=new.state, country=new.country,
                            zip=new.zip)],
        required_outputs=[],
    )


def _return_item(db, oid: str, rng: random.Random) -> dict[str, Any]:
    order = db.orders[oid]
    names = [i.name for i in order.items]
    item = rng.choice([i for i in order.items if names.count(i.name) == 1])
    known, unknown, find, who = _identity(db, order.user_id, rng)
    pay = order.payment_history[0].payment_method_id
    return dict(
        instruction=f"The user ({who}) wants to return the {item.name} (item {item.item_id}) of delivered order {oid}, refunded to the original payment method {pay}.",
        user=UserScenario(reason_for_call=f"Hi, I'd like to return the {item.name} from my order {oid}.",
                          known_info={**known, "order_id": oid, "item": item.name,
                                      "payment_method": "the original payment method"},
                          unknown_info=unknown + ["item id"]),
        gold_actions=[find, _call("get_order_details", order_id=oid),
                      _call("return_delivered_order_items", order_id=oid, item_ids=[item.item_id],
                            payment_method_id=pay)],
        required_outputs=[],
    )


def _returnable(db) -> list[str]:
    out = []
    for oid in _orders(db, "delivered", single_payment=True):
        names = [i.name for i in db.orders[oid].items]
        if any(names.count(n) == 1 for n in names):
            out.append(oid)
    return out


_AUTH = ("find_user_id_by_email", "find_user_id_by_name_zip")
FAMILIES: tuple[Family, ...] = (
    Family("order_status", "user gives an order id and asks its status: one lookup, say the status", 1,
           ("get_order_details",), ("tool_call_precision", "communicate_result"),
           lambda db: _orders(db, "pending", "processed", "delivered", "cancelled"), _order_status),
    Family("order_total", "user gives an order id and asks the total paid: one lookup, read the amount", 2,
           ("get_order_details",), ("tool_call_precision", "structured_data_reasoning", "communicate_result"),
           lambda db: _orders(db, "pending", "processed", "delivered", single_payment=True), _order_total),
    Family("order_tracking", "user gives an order id and asks the tracking number: one lookup, read the fulfillment", 2,
           ("get_order_details",), ("tool_call_precision", "structured_data_reasoning", "communicate_result"),
           _tracked, _order_tracking),
    Family("gift_card_balance", "authenticate by email or name+zip, read the account, say the gift card balance", 3,
           _AUTH + ("get_user_details",),
           ("identity_verification", "tool_call_precision", "structured_data_reasoning",
            "multi_step_completion", "communicate_result"),
           lambda db: sorted(u for u, x in db.users.items()
                             if sum(p.source == "gift_card" for p in x.payment_methods.values()) == 1),
           _gift_card_balance),
    Family("refuse_cancel", "user asks to cancel a processed/delivered order: check status, refuse, say why", 4,
           _AUTH + ("get_order_details", "cancel_pending_order"),
           ("identity_verification", "precondition_verification", "communicate_result"),
           lambda db: _orders(db, "processed", "delivered"), _refuse_cancel),
    Family("cancel_pending", "authenticate, check the order is pending, confirm, cancel with the user's reason", 4,
           _AUTH + ("get_order_details", "cancel_pending_order"),
           ("identity_verification", "precondition_verification", "confirmation_before_write",
            "tool_call_precision", "multi_step_completion"),
           lambda db: _orders(db, "pending"), _cancel_pending),
    Family("change_address", "authenticate, check pending, confirm, set the new shipping address field by field", 5,
           _AUTH + ("get_order_details", "modify_pending_order_address"),
           ("identity_verification", "precondition_verification", "confirmation_before_write",
            "tool_call_precision", "structured_data_reasoning", "multi_step_completion"),
           lambda db: _orders(db, "pending"), _change_address),
    Family("return_item", "authenticate, check delivered, find the item id, confirm, return to the original payment", 6,
           _AUTH + ("get_order_details", "return_delivered_order_items"),
           ("identity_verification", "precondition_verification", "confirmation_before_write",
            "tool_call_precision", "structured_data_reasoning", "multi_step_completion"),
           _returnable, _return_item),
)
_BY_NAME = {f.name: f for f in FAMILIES}
FULL_SET = ("order_status", "order_total", "gift_card_balance", "refuse_cancel", "cancel_pending", "change_address",
            "return_item")
"""The seven families an empty `env.families` means: the whole retail task set, from one lookup to returns."""


def family_names() -> dict[str, str]:
    """Family name -> one-line description, easiest first (every family, `FULL_SET`'s and the others)."""
    return {f.name: f"(difficulty {f.difficulty}) {f.description}" for f in FAMILIES}


def core_tool_names() -> list[str]:
    """The tools the families need plus the transfer tool, in a stable order."""
    names = {t for f in FAMILIES for t in f.tools} | {"transfer_to_human_agents"}
    return sorted(names)


def user_split(seed: int, user_id: str, test_fraction: float, validation_fraction: float = 0.0) -> str:
    """'train', 'validation' or 'test' for a user: a stable hash, so a user (and their orders) is in one split.
    Validation users come from above the test share, so adding them leaves the test split as it was."""
    digest = hashlib.sha256(f"{seed}:{user_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < test_fraction:
        return "test"
    return "validation" if u < test_fraction + validation_fraction else "train"


def _owner(db, entity: str) -> str:
    return db.orders[entity].user_id if entity in db.orders else entity


def make_family_tasks(db, family: str, split: str, n: int, seed: int = 0, test_fraction: float = 0.5,
                      validation_fraction: float = 0.0) -> list[Task]:
    """The first `n` tasks of one family in one split ('train', 'validation' or 'test')."""
    if family not in _BY_NAME:
        raise ValueError(f"env.families: unknown family {family!r}; choose from {sorted(_BY_NAME)}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    fam = _BY_NAME[family]
    if split == "validation" and not validation_fraction:
        raise ValueError("split 'validation' is empty: set env.validation_fraction above 0")
    pool = [e for e in fam.pool(db)
            if user_split(seed, _owner(db, e), test_fraction, validation_fraction) == split]
    if not pool:
        raise ValueError(f"family {family!r} has no candidates in split {split!r} (test_fraction={test_fraction}, "
                         f"validation_fraction={validation_fraction})")
    random.Random(f"{seed}:{family}:{split}").shuffle(pool)
    if n > len(pool):
        raise ValueError(f"family {family!r} has only {len(pool)} distinct {split} tasks; asked for {n}")
    tasks = []
    for i, entity in enumerate(pool[:n]):
        fields = fam.make(db, entity, random.Random(f"{seed}:{family}:{split}:{i}"))
        extra = fields.pop("extra_tags", ())
        tags = [t for t in CAPABILITY_TAGS if t in fam.tags or t in extra]
        tasks.append(Task(id=f"{family}-{split}-{i:03d}", env="retail", split=split, family=family,
                          capability_tags=tags, difficulty=fam.difficulty, seed=seed,
                          meta={"entity": entity, "user_id": _owner(db, entity)}, **fields))
    return tasks


def build_family_tasks(db, cfg: EnvConfig, split: str) -> list[Task]:
    """Tasks of every configured family for 'train', 'validation', 'test' or 'all' (train, validation where there
    is one, then test), easiest first."""
    if split not in SPLITS + ("all",):
        raise ValueError(f"split must be 'train', 'validation', 'test' or 'all', got {split!r}")
    unknown = [f for f in cfg.families if f not in _BY_NAME]
    if unknown:
        raise ValueError(f"env.families: unknown family {unknown[0]!r}; choose from {sorted(_BY_NAME)}")
    chosen = [f.name for f in FAMILIES if f.name in (cfg.families or FULL_SET)]
    splits = tuple(s for s in SPLITS if s != "validation" or cfg.validation_fraction) if split == "all" else (split,)
    return [t for s in splits for fam in chosen
            for t in make_family_tasks(db, fam, s, cfg.per_family(s), cfg.seed, cfg.test_fraction,
                                       cfg.validation_fraction)]
