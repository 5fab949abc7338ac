"""Plain-text views of records for people and for analyst prompts.

One renderer, so a notebook reader and the analyst LLM see a trajectory the same way.
"""

from __future__ import annotations

import json

from trace_lib.records import Message, Trajectory


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + f" …[{len(text) - limit + 15} chars cut]"


def render_message(msg: Message, limit: int = 600) -> str:
    if msg.role == "assistant" and msg.invalid is not None:
        return f"AGENT (invalid action: {msg.invalid}): {_clip(msg.content, limit)}"
    if msg.role == "assistant" and msg.tool_calls:
        calls = "; ".join(f"{c.name}({json.dumps(c.arguments, sort_keys=True)})" for c in msg.tool_calls)
        return f"AGENT calls {calls}"
    if msg.role == "assistant":
        return f"AGENT: {_clip(msg.content, limit)}"
    if msg.role == "tool":
        tag = "TOOL ERROR" if msg.error else "TOOL"
        return f"{tag} [{msg.name}]: {_clip(msg.content, limit)}"
    if msg.role == "user":
        return f"USER: {_clip(msg.content, limit)}"
    return f"SYSTEM: {_clip(msg.content, 200)}"


def render_trajectory(traj: Trajectory, limit: int = 600, include_system: bool = False) -> str:
    """Header line (task, outcome, counts) followed by one line per turn."""
    head = (f"[{traj.id}] family={traj.family} success={traj.success} reward={traj.reward:g} "
            f"end={traj.termination} tool_calls={traj.tool_calls} invalid={traj.invalid_actions} "
            f"tool_errors={traj.tool_errors}")
    body = [render_message(m, limit) for m in traj.messages if include_system or m.role != "system"]
    return "\n".join([head, *body])
