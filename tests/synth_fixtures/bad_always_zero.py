"""Fixture (broken): evaluate always returns 0, so even the reference fails. Derived from a valid synthesized environment (capability communicate_result, target retail/core).

A seed picks an order of the target database; the customer asks for its status; the agent must look
the order up and tell the customer the status it read.
"""

import random

from trace_lib import synth_sdk

CAPABILITY = "communicate_result"
TARGET = {"name": "retail", "tools": "core"}
DIFFICULTY = {"default": 1, "min": 0, "max": 3}  # unused knob: one lookup at every difficulty


def tool_schemas():
    return synth_sdk.target_tool_schemas(TARGET)


def generate_task(seed, difficulty=1):
    db = synth_sdk.target_db(TARGET)
    order_id = random.Random(seed).choice(sorted(db.orders))
    status = db.orders[order_id].status
    return {
        "instruction": f"The customer asks for the status of order {order_id}; the agent must say it is {status}.",
        "user": {"reason_for_call": f"Hi, what is the status of my order {order_id}?",
                 "known_info": {"order_id": order_id}},
        "required_outputs": [status],
        "gold_actions": [{"name": "get_order_details", "arguments": {"order_id": order_id}}],
        "meta": {"order_id": order_id, "status": status},
    }


def init_state(task):
    return synth_sdk.TargetWorld(TARGET)


def call_tool(state, name, arguments):
    return state.call(name, arguments)


def evaluate(trajectory, task, state):
    return 0


def solve(task):
    meta = task["meta"]
    return [{"tool": "get_order_details", "arguments": {"order_id": meta["order_id"]}},
            {"say": f"Your order {meta['order_id']} is {meta['status']}."}]
