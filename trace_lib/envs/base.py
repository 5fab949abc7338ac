"""The environment protocol every trace environment follows (target, τ²-bench, synthesized).

The paper's tuple (X, P, R, y): tasks come from a generator or a task file (X), `step` is the
transition P, `reward` is R, and the task's gold actions / required outputs are the target y.

An episode, as in τ²-bench: `reset(task)` returns the opening messages (system prompt and the
user's first turn); the agent then answers with one assistant `Message` per `step`. A message with
tool calls is executed tool by tool; a message without them goes to the user simulator; a message
whose text could not be parsed (`Message.invalid`) is answered with an error observation and
counted, never raised. The episode ends when the user stops, a transfer tool is called, the step /
error limits are hit, or (with `end_on_repeat`) the agent repeats a call it made before; a run that ends
on a limit or a repeat scores 0.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from trace_lib.envs.limits import ToolLimits, ToolOutcome, call_guarded, call_limited
from trace_lib.envs.said import texts_said
from trace_lib.records import Message, Task, ToolCall

ToolKind = Literal["read", "write", "generic"]
LIMIT_ENDINGS = ("max_steps", "max_errors", "repeated_call")
"""Terminations that score 0 whatever the state (τ²-bench scores a run cut off by a limit as a failure)."""


def _is_repeat(earlier: list[Message], call: ToolCall) -> bool:
    """Whether an earlier agent turn made a call with `call`'s name and arguments."""
    return any(c.name == call.name and c.arguments == call.arguments
               for m in earlier if m.role == "assistant" for c in m.tool_calls)


class ToolSpec(BaseModel):
    """A tool as the agent sees it (JSON-schema function) plus whether it changes state."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    description: str
    parameters: dict[str, Any]
    kind: ToolKind = "read"

    def to_schema(self) -> dict[str, Any]:
        """The `{"type": "function", "function": ...}` form chat templates and TRL expect."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class UserTurn:
    content: str
    stop: bool = False


@dataclass
class StepResult:
    observations: list[Message]
    done: bool
    termination: str | None = None


@dataclass
class EpisodeState:
    task: Task
    messages: list[Message] = field(default_factory=list)
    steps: int = 0
    tool_calls: int = 0
    invalid_actions: int = 0
    tool_errors: int = 0
    suspicious_turns: int = 0
    tool_faults: int = 0
    done: bool = False
    termination: str | None = None


class Environment(ABC):
    """Shared episode mechanics; subclasses supply tools, tool execution, the user and scoring."""

    name: str = "env"
    transfer_tools: frozenset[str] = frozenset({"transfer_to_human_agents"})
    end_on_repeat: bool = False
    """End the episode (scoring 0) when the agent makes a tool call equal to an earlier one of the episode
    (name and arguments); the call is not run. `env.end_on_repeated_call` sets it through `make_env`."""
    isolate_tools: bool = True
    """Run tool calls through `call_limited` (a forked copy under a time limit). Environments whose
    tools already run out of process under limits (the synthesized ones) turn it off."""

    def __init__(self, max_steps: int = 10, max_errors: int = 5, tool_limits: ToolLimits | None = None) -> None:
        self.max_steps = max_steps
        self.max_errors = max_errors
        self.tool_limits = tool_limits or ToolLimits()
        self.state: EpisodeState | None = None

    # --- to implement -------------------------------------------------------------------------
    @property
    @abstractmethod
    def tools(self) -> list[ToolSpec]: ...

    @abstractmethod
    def system_prompt(self, task: Task) -> str: ...

    @abstractmethod
    def _reset_state(self, task: Task) -> None:
        """Fresh database / world for `task`."""

    @abstractmethod
    def _execute(self, call: ToolCall) -> tuple[str, bool]:
        """Run one tool call on the current state; return (observation text, is_error)."""

    _user: Any = None
    """The current episode's simulated user (`_reset_state` sets it), with `opening()` and `reply(text)`
    as `trace_lib.envs.user.ScriptedUser` has them; an environment whose user speaks otherwise (τ²'s)
    overrides the two methods below instead."""

    def _user_opening(self, task: Task) -> str:
        return self._episode_user().opening()

    def _user_reply(self, agent_text: str) -> UserTurn:
        return self._episode_user().reply(agent_text)

    def _episode_user(self) -> Any:
        if self._user is None:
            raise RuntimeError(f"{type(self).__name__} has no user for this episode: call reset() first")
        return self._user

    @abstractmethod
    def _score(self) -> tuple[float, dict[str, Any]]:
        """Reward of the finished episode in [0, 1] and a breakdown for the record."""

    # --- protocol -----------------------------------------------------------------------------
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.to_schema() for t in self.tools]

    def tool_kinds(self) -> dict[str, ToolKind]:
        return {t.name: t.kind for t in self.tools}

    def reset(self, task: Task) -> list[Message]:
        self._reset_state(task)
        opening = [
            Message(role="system", content=self.system_prompt(task)),
            Message(role="user", content=self._user_opening(task)),
        ]
        self.state = EpisodeState(task=task, messages=list(opening))
        return opening

    @property
    def done(self) -> bool:
        return self.state is not None and self.state.done

    def step(self, action: Message) -> StepResult:
        """Apply one assistant message and return what the agent observes next."""
        st = self._require_state()
        if st.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self._take(st, action)
        observations: list[Message] = []
        if action.invalid is not None:
            st.invalid_actions += 1
            observations.append(
                Message(role="tool", name="invalid_action", error=True,
                        content=f"Error: invalid action: {action.invalid}")
            )
        elif action.tool_calls:
            for call in action.tool_calls:
                if self.end_on_repeat and _is_repeat(st.messages[:-1], call):
                    observations.append(Message(role="tool", name=call.name, tool_call_id=call.id, error=True,
                                                content=f"Error: {call.name} was already called with these "
                                                        "arguments; the episode ends."))
                    self._finish(st, "repeated_call")
                    break
                observations.append(self._run_tool(st, call))
                if call.name in self.transfer_tools:
                    self._finish(st, "transfer")
                    break
        else:
            turn = self._user_reply(action.content)
            observations.append(Message(role="user", content=turn.content))
            if turn.stop:
                self._finish(st, "user_stop")
        st.messages.extend(observations)
        if not st.done and st.invalid_actions + st.tool_errors >= self.max_errors:
            self._finish(st, "max_errors")
        if not st.done and st.steps >= self.max_steps:
            self._finish(st, "max_steps")
        return StepResult(observations, st.done, st.termination)

    def reward(self) -> tuple[float, dict[str, Any]]:
        """Score of the finished episode; episodes that ended on a limit score 0, as in τ²-bench."""
        st = self._require_state()
        if st.termination in LIMIT_ENDINGS:
            return 0.0, {"termination": st.termination}
        value, info = self._score()
        return value, {"termination": st.termination, **info}

    # --- helpers ------------------------------------------------------------------------------
    def _take(self, st: EpisodeState, action: Message) -> None:
        """Record the agent's turn and count it (a suspicious turn is counted whatever follows)."""
        st.messages.append(action)
        st.steps += 1
        if action.suspicious is not None:
            st.suspicious_turns += 1

    def _run_tool(self, st: EpisodeState, call: ToolCall) -> Message:
        st.tool_calls += 1
        known = {t.name for t in self.tools}
        if call.name not in known:
            outcome = ToolOutcome(f"Error: unknown tool '{call.name}'. Available tools: {', '.join(sorted(known))}",
                                  True)
        else:
            outcome = self._execute_limited(call)
        return self._tool_message(st, call, outcome)

    def _execute_limited(self, call: ToolCall) -> ToolOutcome:
        """`_execute` under the tool limits: a timeout, crash or huge result becomes an error or a cut
        observation, never an exception (module `limits`)."""
        if not self.isolate_tools:
            return call_guarded(lambda: self._execute(call), self.tool_limits)
        return call_limited(lambda: self._execute(call), self.tool_limits)

    @staticmethod
    def _tool_message(st: EpisodeState, call: ToolCall, outcome: ToolOutcome) -> Message:
        if outcome.is_error:
            st.tool_errors += 1
        if outcome.fault is not None:
            st.tool_faults += 1
        return Message(role="tool", name=call.name, tool_call_id=call.id, content=outcome.text,
                       error=outcome.is_error)

    def _finish(self, st: EpisodeState, why: str) -> None:
        st.done = True
        st.termination = why

    def _require_state(self) -> EpisodeState:
        if self.state is None:
            raise RuntimeError("call reset(task) before step()")
        return self.state

    def agent_texts(self) -> list[str]:
        """Everything the agent said to the user so far (for COMMUNICATE-style checks)."""
        st = self._require_state()
        return texts_said(st.messages)

