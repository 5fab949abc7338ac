"""Valid: good_lookup with prints to stdout in every function (they must not corrupt the protocol)."""

import random

from trace_lib import synth_sdk

CAPABILITY = "communicate_result"
TARGET = {"name": "retail", "tools": "core"}
DIFFICULTY = {"default": 1, "min": 0, "max": 3}  # unused knob: one lookup at every difficulty


print('module imported')


def tool_schemas():
    print('tool_schemas called')
    return synth_sdk.target_tool_schemas(TARGET)


def generate_task(seed, difficulty=1):
    print('generating', seed, '\n{"id": 1, "ok": true}')
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
    print('calling', name)
    return state.call(name, arguments)


def evaluate(trajectory, task, state):
    print('evaluating')
    return int(synth_sdk.said(trajectory, task["meta"]["status"]))


def solve(task):
    print('solving')
    meta = task["meta"]
    return [{"tool": "get_order_details", "arguments": {"order_id": meta["order_id"]}},
            {"say": f"Your order {meta['order_id']} is {meta['status']}."}]
