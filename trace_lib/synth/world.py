"""The target world behind `trace_lib.synth_sdk`: the target's tools run on a private database.

Read by synthetic environment modules (through `trace_lib.synth_sdk`) inside the sandbox and by the
template synthesizer; writes nothing. Paper §3.2: a synthetic environment exposes the SAME tools as
the target, so a LoRA adapter trained on it acts on the real target without any interface shift.
Rather than re-implementing the tools (and drifting from them), a module builds a `TargetWorld`:
τ²-bench's own tool implementations over a private copy of the target's database, with schemas
read from the target at run time. The module contract is documented in `trace_lib.synth_sdk`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from trace_lib.envs.said import said_to_user


class ToolError(Exception):
    """A tool refused the call (unknown id, wrong status, bad arguments); the text is the observation."""


def _retail():
    from trace_lib.envs.retail import env as retail

    return retail


def _check_target(target: dict[str, Any]) -> tuple[str, str]:
    name = target.get("name")
    tools = target.get("tools", "core")
    if name == "retail":
        return name, tools
    if name in ("tau2-retail", "phone"):
        return name, "all"
    raise ValueError(f"synth_sdk: target {name!r} is not supported; 'retail', 'tau2-retail' and 'phone' are")


@lru_cache(maxsize=None)
def _specs(name: str, tools: str) -> tuple:
    # Cached: building τ²'s tool objects parses every docstring, and a world is made per episode.
    if name == "phone":
        from trace_lib.envs.phone.world import phone_tool_specs

        return tuple(phone_tool_specs())
    if name == "tau2-retail":  # τ²-bench shows the agent whole docstrings; the built-in target one sentence
        from trace_lib.envs.tau2 import env as tau2

        return tuple(tau2.tool_specs("retail"))
    return tuple(_retail().retail_tool_specs(tools))


def target_tool_schemas(target: dict[str, Any]) -> list[dict[str, Any]]:
    """The target's tool schemas, exactly as the agent sees them on the target."""
    return [spec.to_schema() for spec in _specs(*_check_target(target))]


def target_tool_kinds(target: dict[str, Any]) -> dict[str, str]:
    """Tool name -> 'read' / 'write' / 'generic', as on the target."""
    return {spec.name: spec.kind for spec in _specs(*_check_target(target))}


def target_db(target: dict[str, Any]):
    """The target's pristine database (τ²'s RetailDB): read it, never mutate it."""
    if _check_target(target)[0] == "phone":
        raise ValueError("synth_sdk: the phone target has no shared database; each scenario carries its world")
    return _retail().load_base_db()


class TargetWorld:
    """τ²'s tools on a private copy-on-write copy of the target database (one per episode)."""

    def __init__(self, target: dict[str, Any]) -> None:
        name, tools = _check_target(target)
        if name == "phone":
            raise ValueError("synth_sdk: TargetWorld wraps the retail tools; a phone world is "
                             "trace_lib.envs.phone.world.PhoneWorld (from a task's meta['world'])")
        retail = _retail()
        self._retail = retail
        self._session = retail.Session()
        self._names = {spec.name for spec in _specs(name, tools)}
        self._compact = name == "retail"  # results as the built-in target shows them (τ²'s own: whole)
        self.calls: list[dict[str, Any]] = []
        """Every call made, in order: {"name", "arguments", "ok"}."""

    @property
    def db(self):
        return self._session.db

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run `name(**arguments)` with τ²'s implementation; raise ToolError on refusal."""
        from trace_lib.records import ToolCall

        if name not in self._names:
            self.calls.append({"name": name, "arguments": arguments, "ok": False})
            raise ToolError(f"Tool '{name}' not found.")
        text, is_error = self._retail.execute_call(self._session, ToolCall(name=name, arguments=arguments),
                                                   compact=self._compact)
        self.calls.append({"name": name, "arguments": arguments, "ok": not is_error})
        if is_error:
            raise ToolError(text.removeprefix("Error: "))
        return text

    def db_hash(self) -> str:
        return self._session.db_hash()


def gold_world(target: dict[str, Any], gold_actions: list[dict[str, Any]]) -> TargetWorld:
    """A fresh world after replaying `gold_actions` ({name, arguments}); refused calls are skipped."""
    world = TargetWorld(target)
    for action in gold_actions:
        try:
            world.call(action["name"], action.get("arguments", {}))
        except ToolError:
            pass
    return world


def gold_db_hash(target: dict[str, Any], gold_actions: list[dict[str, Any]]) -> str:
    """Hash of the target database after replaying `gold_actions` ({name, arguments}) on a fresh world."""
    return gold_world(target, gold_actions).db_hash()


def same_db(a: TargetWorld, b: TargetWorld) -> bool:
    """Whether two worlds' databases are equal, as equal `db_hash`es would say, but much faster:
    rows neither world wrote are the shared pristine rows, so only the written ones are compared."""
    rows = a._session.owned | b._session.owned
    return all(getattr(a.db, table)[key] == getattr(b.db, table)[key] for table, key in rows)


def said(trajectory: dict[str, Any], needle: str, also_required: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether the agent told the user `needle` (`trace_lib.envs.said`, the reward's own matcher; `also_required`:
    the task's other required values, which may stand beside it)."""
    return said_to_user(trajectory.get("messages", []), needle, also_required)


def tool_calls(trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    """The agent's tool calls in order: {"name", "arguments"}."""
    return [{"name": c.get("name"), "arguments": c.get("arguments", {})}
            for m in trajectory.get("messages", []) if m.get("role") == "assistant"
            for c in m.get("tool_calls", [])]
