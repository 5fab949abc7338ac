"""The public contract of synthesized environment modules: the one trace module they may import.

Read by synthetic environment modules (`data/envs/<capability>/env.py`) inside the sandbox; writes
nothing. Paper §3.2: a synthetic environment exposes the SAME tools as the target, so a LoRA adapter
trained on it acts on the real target without any interface shift. Rather than re-implementing the
tools (and drifting from them), a module builds a `TargetWorld`: τ²-bench's own tool implementations
over a private copy of the target's database, with schemas read from the target at run time.

The module contract (checked by `trace_lib.synth.validate.validate_env`, driven through
`trace_lib.envs.synthetic.SyntheticEnv`), all module-level names:

    CAPABILITY: str                      the capability id the environment trains
    TARGET: dict                         {"name": "retail", "tools": "core"}: the target env section
    DIFFICULTY: dict                     {"default": 1, "min": 0, "max": 3} (generator knob range)
    tool_schemas() -> list[dict]         the target's tools, JSON-schema function format; validation
                                         requires them equal to the target's own (names, arguments,
                                         descriptions)
    generate_task(seed, difficulty) -> dict
                                         fields of a `trace_lib.records.Task` except id/env/split/
                                         family: instruction, user (UserScenario fields),
                                         required_outputs, gold_actions [{name, arguments}], meta;
                                         JSON-serialisable, deterministic in (seed, difficulty)
    init_state(task) -> object           the episode's world (stays inside the sandbox)
    call_tool(state, name, arguments) -> str
                                         run one tool call; raise ToolError (or any exception) to
                                         refuse, the message becomes the agent's error observation
    evaluate(trajectory, task, state) -> dict | int
                                         multi-level rewards: {"steps": {name: value in [0, 1]},
                                         "gates": {name: bool}} scores the mean of the steps when
                                         every gate holds, else 0 (`trace_lib.synth.rubric`); or 1
                                         when the capability was exercised correctly, else 0;
                                         trajectory = {"messages": [Message dicts], "termination": str,
                                         "tool_calls": int, "tool_errors": int, "invalid_actions": int}
    solve(task) -> list[dict]            reference actions, replayed against the scripted user:
                                         {"tool": name, "arguments": {...}} or {"say": text}

On the phone target (`TARGET = {"name": "phone", ...}`) there is no shared database: each task carries its
starting world in `meta["world"]`, and `phone_world(world)`, `phone_call(state, name, arguments)` and
`phone_rubric(trajectory, meta)` (milestones and minefields in `meta`, scored as the phone scores them)
stand in for `TargetWorld` and the retail helpers.

A module rendered by the offline template synthesizer binds `template(CAPABILITY, TARGET)` and
delegates each of these functions to the object it returns (`trace_lib.synth.templates`).

Only the standard-library modules in `trace_lib.sandbox.ALLOWED_IMPORTS`, this module and τ²-bench's
domain packages may be imported by a module; the sandbox checks that before running anything.
"""

from __future__ import annotations

from typing import Any

from trace_lib.synth import templates
from trace_lib.synth.templates_phone import phone_call, phone_rubric, phone_world
from trace_lib.synth.world import (
    TargetWorld, ToolError, gold_db_hash, gold_world, same_db, said, target_db, target_tool_kinds,
    target_tool_schemas, tool_calls,
)

__all__ = ["TargetWorld", "ToolError", "gold_db_hash", "gold_world", "phone_call", "phone_rubric", "phone_world",
           "same_db", "said", "target_db", "target_tool_kinds", "target_tool_schemas", "template", "tool_calls"]


def template(capability: str, target: dict[str, Any], kinds: dict[str, int] | None = None) -> templates.BoundTemplate:
    """The offline template synthesizer's environment for `capability` on `target`: an object whose
    methods are the contract's functions (`trace_lib.synth.templates.BoundTemplate`); `kinds` weights the
    task kinds it draws (task kind -> weight)."""
    return templates.bind_template(capability, target, kinds)
