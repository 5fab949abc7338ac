"""Plain-text views of records for people and for analyst prompts.

Reads and writes nothing. One renderer, so a notebook reader and the analyst LLM see a trajectory
the same way: `render_trajectory` for both, `render_for_analyst` (task statement + clipped
conversation) and `tools_block` for the analyst's prompts (§3.1, §3.2), `render_task` for a
generated training task as the agent and the scripted customer see it.
"""

from __future__ import annotations

import json

from trace_lib.records import Message, Task, Trajectory


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + f" …[{len(text) - limit + 15} chars cut]"


def cut(text: str, limit: int) -> str:
    """`text` up to `limit` characters, then a line saying how many were cut."""
    return text if len(text) <= limit else text[:limit] + f"\n…[{len(text) - limit} chars cut]"


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


def render_for_analyst(traj: Trajectory, task: Task | None, chars: int) -> str:
    """A trajectory as the analyst sees it: the task statement, then the conversation, clipped."""
    # Long failures (loops) say what they have to say early.
    text = cut(render_trajectory(traj, limit=chars), 8 * chars)
    head = f"Task: {task.instruction}\n" if task is not None else ""
    return head + text


def tools_block(tool_kinds: dict[str, str]) -> str:
    """The target's tools as prompt lines `- name: kind` (read / write / generic), sorted by name."""
    return "\n".join(f"- {name}: {kind}" for name, kind in sorted(tool_kinds.items())) or "- (none)"


def render_task(task: Task) -> str:
    """A task as the agent and the scripted customer see it: instruction, the customer's opening and
    knowledge, the gold actions and the outputs the agent must say."""
    calls = "; ".join(f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})"
                      for c in task.gold_actions)
    return "\n".join([f"=== {task.id} (difficulty {task.difficulty})",
                      f"instruction: {task.instruction}",
                      f"customer opens: {task.user.reason_for_call}",
                      f"customer knows: {task.user.known_info}",
                      f"gold actions: {calls or '(none)'}",
                      f"must say: {task.required_outputs}"])
