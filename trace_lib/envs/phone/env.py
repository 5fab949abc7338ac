"""`PhoneEnv`: the phone world behind trace's environment protocol (`trace_lib.envs.base`).

Reads a scenario `Task` (its `meta`: starting world, milestones, minefields); writes nothing. Each
tool call runs on the episode's `PhoneWorld` and leaves a snapshot (the tables after it and the
call); each message to the user leaves one too; the scripted user (`trace_lib.envs.user`) answers
what it is asked and ends the conversation on a final answer. The reward is the milestone similarity
(`milestones.score_episode`); an episode cut off by the step or error limit scores 0, as in every
trace environment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trace_lib.envs.base import Environment, ToolSpec, UserTurn
from trace_lib.envs.phone.milestones import Snapshot, score_scenario
from trace_lib.envs.phone.world import PhoneWorld, execute, phone_tool_specs
from trace_lib.envs.user import ScriptedUser
from trace_lib.records import Task, ToolCall

SYSTEM_PROMPT = (
    "You are the assistant on the user's phone. Use the tools to do what the user asks, then tell the user the "
    "result. Don't make assumptions about what values to plug into tools: ask the user when a request leaves "
    "something out, and say so when a request cannot be done with the tools. When a tool returns an error, read "
    "it, fix the cause and try again. Phone numbers are written as +1 and ten digits; times as ISO 8601 "
    "(2026-03-14T17:00:00)."
)


def call_snapshot(world: PhoneWorld, name: str, arguments: dict[str, Any], ok: bool) -> Snapshot:
    """The snapshot a tool call leaves: the tables after it, and the call."""
    return Snapshot(tables=world.snapshot(), call={"name": name, "arguments": arguments, "ok": ok})


def said_snapshot(world: PhoneWorld, text: str) -> Snapshot:
    """The snapshot a message to the user leaves."""
    return Snapshot(tables=world.snapshot(), said=text or "")


def replay_snapshots(messages: list[dict[str, Any]], start_world: dict[str, Any]) -> tuple[list[Snapshot], dict]:
    """An episode's snapshots rebuilt from its messages (dicts) by replaying its tool calls on a fresh
    world (the tools are deterministic), and the starting tables: what `PhoneEnv` records live."""
    world = PhoneWorld.from_dict(start_world)
    start = world.snapshot()
    snaps = []
    for m in messages:
        if m.get("role") != "assistant" or m.get("invalid") is not None:
            continue
        calls = m.get("tool_calls") or []
        for c in calls:
            arguments = c.get("arguments") or {}
            _, is_error = execute(world, c.get("name", ""), arguments)
            snaps.append(call_snapshot(world, c.get("name"), arguments, not is_error))
        if not calls:
            snaps.append(said_snapshot(world, m.get("content") or ""))
    return snaps, start


class PhoneEnv(Environment):
    """ToolSandbox-style phone: stateful tools with implicit dependencies, milestone/minefield reward."""

    name = "phone"
    transfer_tools = frozenset()
    isolate_tools = False
    """The phone's tools are trace's own pure functions over a small in-memory state (no eval, no I/O,
    bounded work), so they run in-process; `call_guarded` still turns any exception into an error."""

    def __init__(self, max_steps: int = 8, max_errors: int = 4, user_max_turns: int = 6,
                 user_factory: Callable[[Task], Any] | None = None) -> None:
        super().__init__(max_steps=max_steps, max_errors=max_errors)
        self.user_max_turns = user_max_turns
        self.user_factory = user_factory
        """Builds the user for a task (`env.user: llm`); None: the scripted user."""
        self.world: PhoneWorld | None = None
        self.start: dict[str, Any] = {}
        self.snapshots: list[Snapshot] = []
        self._user: Any = None

    @property
    def tools(self) -> list[ToolSpec]:
        return list(phone_tool_specs())

    def system_prompt(self, task: Task) -> str:
        return SYSTEM_PROMPT

    def _reset_state(self, task: Task) -> None:
        if "world" not in task.meta:
            raise ValueError(f"task {task.id!r} is not a phone scenario (no meta.world)")
        self.world = PhoneWorld.from_dict(task.meta["world"])
        self.start = self.world.snapshot()
        self.snapshots = []
        if self.user_factory is not None:
            self._user = self.user_factory(task)
        else:
            self._user = ScriptedUser(task.user, max_turns=self.user_max_turns)

    def _execute(self, call: ToolCall) -> tuple[str, bool]:
        assert self.world is not None
        text, is_error = execute(self.world, call.name, call.arguments)
        self.snapshots.append(call_snapshot(self.world, call.name, call.arguments, not is_error))
        return text, is_error

    def _user_reply(self, agent_text: str) -> UserTurn:
        assert self.world is not None
        self.snapshots.append(said_snapshot(self.world, agent_text))
        return super()._user_reply(agent_text)

    def _score(self) -> tuple[float, dict[str, Any]]:
        st = self._require_state()
        meta = st.task.meta
        result = score_scenario(meta, self.snapshots, self.start)
        return result["similarity"], {**result, "categories": list(meta.get("categories", [])),
                                      "user": getattr(self._user, "mode", "scripted")}


def user_instructions(task: Task) -> str:
    """The scenario as an LLM user reads it (τ²'s user prompt wraps it): the request, what the user
    knows and reveals only when asked, what it does not know."""
    lines = ["You are using the assistant on your own phone (not calling a store).",
             f"Your request, as you first say it: {task.user.reason_for_call}"]
    if task.user.known_info:
        lines.append("What you know and say only when the assistant asks: "
                     + "; ".join(f"{k}: {v}" for k, v in task.user.known_info.items()) + ".")
    if task.user.unknown_info:
        lines.append("What you do not know (never make it up): " + ", ".join(task.user.unknown_info) + ".")
    lines.append("You may let the assistant change phone settings (low battery mode, cellular, wifi, location "
                 "services). End the conversation once the request is done or the assistant says it cannot be done.")
    return "\n".join(lines)


def llm_user_factory(cfg: Any) -> Callable[[Task], Any]:
    """An LLM user per task through the cached LLM call (`llm_user.user_client`: `env.user_backend`, `user_model`)."""
    from trace_lib.envs.llm_user import LLMUser, user_client

    client = user_client(cfg)
    return lambda task: LLMUser(client, user_instructions(task), stage="phone_user")


def play_steps(env: PhoneEnv, task: Task, steps: list[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    """Play a scripted agent (`{"call": {name, arguments}}` / `{"say": text}` steps, as `meta.reference`)
    until the steps run out or the episode ends; the episode's reward and info. A scenario is sound
    when its reference plays perfect (tests check every one)."""
    from trace_lib.records import Message

    env.reset(task)
    for k, step in enumerate(steps):
        if env.done:
            break
        if "call" in step:
            action = Message(role="assistant", tool_calls=[ToolCall(id=f"call_{k}", **step["call"])])
        else:
            action = Message(role="assistant", content=step["say"])
        env.step(action)
    return env.reward()
