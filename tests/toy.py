"""In-memory toy environment and scripted policies for fast tests of the episode machinery."""

from __future__ import annotations

import json
from dataclasses import dataclass

from trace_lib.envs.base import Environment, ToolSpec, UserTurn
from trace_lib.records import Message, Task, ToolCall, Trajectory, UserScenario

CONTRACT_STUB = """
CAPABILITY = "c"
TARGET = {"name": "retail", "tools": "core"}
DIFFICULTY = {"default": 1, "min": 0, "max": 3}
def tool_schemas(): return []
def generate_task(seed, difficulty=1): return {}
def init_state(task): return None
def call_tool(state, name, arguments): return ""
def evaluate(trajectory, task, state): return 0
def solve(task): return []
"""
"""The smallest module that satisfies the synthesized-environment contract (evaluate always 0)."""

KV_TOOLS = [
    ToolSpec(name="get_value", description="Read a value.", kind="read",
             parameters={"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),
    ToolSpec(name="set_value", description="Write a value.", kind="write",
             parameters={"type": "object", "properties": {"key": {"type": "string"}, "value": {"type": "integer"}},
                         "required": ["key", "value"]}),
]


def kv_task(i: int, family: str = "read") -> Task:
    return Task(id=f"toy/{family}/{i}", env="toy", split="train", family=family,
                instruction=f"Ask for the value of k{i}.",
                user=UserScenario(reason_for_call=f"What is the value of k{i}?"),
                gold_actions=[ToolCall(name="get_value", arguments={"key": f"k{i}"})],
                required_outputs=[str(10 * i)])


class KVEnv(Environment):
    """A dict behind two tools; the user asks for one value and stops after any answer."""

    name = "toy"

    def __init__(self, max_steps: int = 5, max_errors: int = 3) -> None:
        super().__init__(max_steps, max_errors)
        self.db: dict[str, int] = {}

    @property
    def tools(self) -> list[ToolSpec]:
        return KV_TOOLS

    def system_prompt(self, task: Task) -> str:
        return "You look up values."

    def _reset_state(self, task: Task) -> None:
        self.db = {f"k{i}": 10 * i for i in range(20)}

    def _execute(self, call: ToolCall) -> tuple[str, bool]:
        key = call.arguments["key"]
        if key not in self.db:
            return f"Error: no key {key}", True
        if call.name == "set_value":
            self.db[key] = int(call.arguments["value"])
        return json.dumps({"key": key, "value": self.db[key]}), False

    def _user_opening(self, task: Task) -> str:
        return task.user.reason_for_call

    def _user_reply(self, agent_text: str) -> UserTurn:
        return UserTurn("Thanks, bye.", stop=True)

    def _score(self):
        said = " ".join(self.agent_texts())
        ok = all(out in said for out in self.state.task.required_outputs)
        return float(ok), {"outputs_ok": ok}


@dataclass
class Gen:
    text: str
    message: Message
    prompt_tokens: int
    completion_tokens: int


class ScriptedPolicy:
    """Looks the value up, then reports it; `bad_every` makes every n-th episode emit garbage."""

    policy_id = "scripted"

    def __init__(self, bad_every: int = 0) -> None:
        self.bad_every = bad_every
        self.calls: list[int] = []
        self.required: list[list[bool]] = []

    def generate(self, conversations, tools, *, temperature, top_p, max_new_tokens, seed, constrained,
                 require_tool_call=False):
        self.required.append(list(require_tool_call))
        self.calls.append(len(conversations))
        out = []
        for conv in conversations:
            opening = conv[1].content
            key = opening.split("value of ")[1].rstrip("?")
            idx = int(key[1:])
            last = conv[-1]
            if self.bad_every and idx % self.bad_every == 0:
                msg = Message(role="assistant", content="<tool_call>{", invalid="unclosed <tool_call>")
            elif last.role == "user":
                msg = Message(role="assistant", tool_calls=[ToolCall(name="get_value", arguments={"key": key})])
            else:
                value = json.loads(last.content)["value"]
                msg = Message(role="assistant", content=f"The value is {value}.")
            out.append(Gen(msg.content, msg, prompt_tokens=10, completion_tokens=5))
        return out


PICK_TOOLS = [ToolSpec(name=name, description=f"Close the request: {name}.", kind="write",
                       parameters={"type": "object", "properties": {}})
              for name in ("approve", "refund", "escalate", "cancel")]


class PickEnv(Environment):
    """One decision: the first tool call ends the episode, and it succeeds iff it is `target`.

    With grammar-constrained decoding the agent's only free choice is the tool's name, so a
    policy gradient on the reward moves exactly that choice: learnable by the tiny random model.
    """

    name = "pick"

    def __init__(self, target: str = "approve", max_steps: int = 2, max_errors: int = 2) -> None:
        super().__init__(max_steps, max_errors)
        self.target = target
        self.transfer_tools = frozenset(t.name for t in PICK_TOOLS)  # any call ends the episode

    @property
    def tools(self) -> list[ToolSpec]:
        return PICK_TOOLS

    def system_prompt(self, task: Task) -> str:
        return "You close customer requests with one tool call."

    def _reset_state(self, task: Task) -> None:
        pass

    def _execute(self, call: ToolCall) -> tuple[str, bool]:
        return f"Request closed: {call.name}.", False

    def _user_opening(self, task: Task) -> str:
        return task.user.reason_for_call

    def _user_reply(self, agent_text: str) -> UserTurn:
        return UserTurn("Please close my request with a tool.", stop=False)

    def _score(self):
        calls = [c.name for m in self.state.messages if m.role == "assistant" for c in m.tool_calls]
        ok = calls[:1] == [self.target]
        return float(ok), {"first_call": calls[0] if calls else None}


def pick_tasks(seeds: list[int]) -> list[Task]:
    return [Task(id=f"pick/{s}", env="pick", split="train", family="pick", seed=s,
                 instruction="Close the request.", user=UserScenario(reason_for_call=f"Please close request #{s}."))
            for s in seeds]


def outcome_trajectory(task: str, success: bool, family: str = "f", sample: int = 0) -> Trajectory:
    """A finished test-split trajectory of `task` that only says whether it succeeded."""
    return Trajectory(id=f"{task}#{sample}", task_id=task, env="toy", family=family, split="test", policy_id="p",
                      seed=0, sample=sample, messages=[Message(role="user", content="hi")], reward=float(success),
                      success=success, termination="user_stop", tool_calls=1, invalid_actions=0, tool_errors=0,
                      turns=2, prompt_tokens=0, completion_tokens=0)


class ChattyKVEnv(KVEnv):
    """KVEnv whose user answers a question with the key instead of hanging up."""

    def _user_reply(self, agent_text):
        return UserTurn("It is k1.", stop=False) if agent_text.endswith("?") else super()._user_reply(agent_text)
