"""The hint swap: expert guidance in some of a group's rollouts, absent from what is trained.

Pure functions over records; used by `grpo.AgentRollout`. Reads and writes nothing.

Where the base model rarely succeeds, a GRPO group of K rollouts usually has identical (zero)
rewards and teaches nothing. The authors' training environments therefore add an
`<expert_guidance>` hint to 25–50% of a group's rollouts: those episodes are played with the hint in
their opening user turn, and the hint is removed from the token sequence before the gradient step,
so the trained sequence is the unhinted prompt followed by the guided episode's turns. A guided
success then raises the probability of acting that way without the guidance. Guided rollouts are
rollouts like any other in the ledger.

The hint says what a correct episode does: the reference actions of the task (a synthetic
environment's `solve(task)`, or a target task's gold actions and required outputs), rendered as
numbered steps. Every environment with a reference solution gets one, template-made or LLM-written.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from trace_lib.records import Message, Task

HINT_OPEN = "<expert_guidance>"
HINT_CLOSE = "</expert_guidance>"
MAX_HINT_STEPS = 8
"""Steps a hint spells out; longer references are cut (the first steps matter most to a small model)."""
MAX_SAY_CHARS = 300


def hinted_samples(group_size: int, fraction: float) -> list[int]:
    """Which samples (0..K-1) of a group play with the hint: the last round(fraction·K), at most K-1,
    and at least one whenever fraction > 0 (a group keeps at least one unguided rollout)."""
    if fraction <= 0:
        return []
    n = min(group_size - 1, max(1, round(fraction * group_size)))
    return list(range(group_size - n, group_size))


def _step_text(step: Any) -> str | None:
    """One reference action as an instruction; None for a step in no known form."""
    if not isinstance(step, dict):
        return None
    if "say" in step:
        text = " ".join(str(step["say"]).split())[:MAX_SAY_CHARS]
        return f'tell the customer: "{text}"'
    name = step.get("tool", step.get("name"))
    if not isinstance(name, str) or not name:
        return None
    args = step.get("arguments", {})
    try:
        shown = json.dumps(args, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return f"call {name} with {shown}"


def hint_from_steps(steps: Any) -> str | None:
    """The guidance text for a list of reference actions ({"tool", "arguments"} or {"say"}), or None
    when there is no usable step."""
    if not isinstance(steps, Sequence) or isinstance(steps, (str, bytes)):
        return None
    lines = [t for t in (_step_text(s) for s in steps) if t]
    if not lines:
        return None
    shown = lines[:MAX_HINT_STEPS]
    return "A correct way to handle this: " + " ".join(f"({i}) {t}." for i, t in enumerate(shown, 1))


def reference_steps(task: Task) -> list[dict[str, Any]]:
    """A target task's reference actions: its gold tool calls, then each required output said."""
    steps: list[dict[str, Any]] = [{"tool": c.name, "arguments": c.arguments} for c in task.gold_actions]
    if task.required_outputs:
        steps.append({"say": "The answer: " + ", ".join(task.required_outputs)})
    return steps


def with_hint(opening: Sequence[Message], hint: str) -> list[Message]:
    """The opening with the guidance appended to its last user turn (the system turn, shared by every
    rollout and cached once, stays as it is)."""
    out = list(opening)
    for i in range(len(out) - 1, -1, -1):
        if out[i].role == "user":
            text = f"{out[i].content or ''}\n\n{HINT_OPEN}{hint}{HINT_CLOSE}"
            out[i] = out[i].model_copy(update={"content": text})
            return out
    raise ValueError("the opening has no user turn to carry the hint")
