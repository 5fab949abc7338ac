"""Rejected by `static`: network access through socket."""

from socket import create_connection

from trace_lib import synth_sdk

CAPABILITY = "communicate_result"
TARGET = {"name": "retail", "tools": "core"}
DIFFICULTY = {"default": 1, "min": 0, "max": 3}


def tool_schemas():
    return synth_sdk.target_tool_schemas(TARGET)


def generate_task(seed, difficulty=1):
    return {"instruction": str(create_connection(("example.com", 80))), "user": {"reason_for_call": "hi"}}


def init_state(task):
    return synth_sdk.TargetWorld(TARGET)


def call_tool(state, name, arguments):
    return state.call(name, arguments)


def evaluate(trajectory, task, state):
    return 0


def solve(task):
    return [{"say": "hi"}]
