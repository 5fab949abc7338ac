"""The template synthesizer on the phone target: one environment per capability the phone's scenarios tag.

Reads the phone environment's scenario families (`trace_lib.envs.phone.scenarios`); writes nothing.
Where the retail templates are written per capability, the phone's scenarios already come with
capability tags, milestones, minefields and a reference solution, so a capability's training
environment is the phone's own families drawn on seeds the target never uses (split `synth`),
keeping the scenarios whose tags include the capability. The world and tools are the target's
(`trace_lib.envs.phone.world`), so the adapter meets no interface shift (paper §3.2).

Multi-level reward (`trace_lib.synth.rubric`): each milestone is a step (its similarity), the
minefields and the episode limits are gates; so the rubric's score is the phone's milestone
similarity. Scenarios where doing nothing is right (insufficient information, no milestone) are
left out: a training environment must not reward an agent that does nothing (`validate` checks it).
The difficulty knob is the family's difficulty: a task of difficulty d comes from a family of
difficulty at most d (at least the capability's easiest).
"""

from __future__ import annotations

import copy
import json
import random
from functools import lru_cache
from typing import Any

from trace_lib.envs.base import LIMIT_ENDINGS
from trace_lib.envs.phone import scenarios
from trace_lib.envs.phone.env import replay_snapshots
from trace_lib.envs.phone.milestones import score_scenario
from trace_lib.envs.phone.world import PhoneWorld, execute, phone_tool_specs
from trace_lib.synth.rubric import rubric
from trace_lib.synth.template_kit import DIFFICULTY
from trace_lib.synth.world import ToolError

SYNTH_SPLIT = "synth"
"""The seed space of synthetic phone tasks: scenario RNGs are keyed by split, so never a train/test one."""
TRIES = 200


@lru_cache(maxsize=None)
def _families_for(capability: str) -> tuple[tuple[str, int], ...]:
    """(family, difficulty) of the families with a scenario tagged `capability` among their first 16
    synth seeds, and milestones to reach (so doing nothing fails)."""
    out = []
    for fam in scenarios.FAMILIES:
        for i in range(16):
            task = scenarios.scenario_task(fam, 0, SYNTH_SPLIT, i)
            if capability in task.capability_tags and task.meta["milestones"]:
                out.append((fam.name, fam.difficulty))
                break
    return tuple(out)


# --- the phone target's part of `trace_lib.synth_sdk` (also what the templates below are made of) ------
def phone_world(world: dict[str, Any]) -> PhoneWorld:
    """The episode's phone from a scenario's starting world (`meta["world"]`: now, settings, contacts,
    messages, reminders), a private copy."""
    return PhoneWorld.from_dict(world)


def phone_call(state: PhoneWorld, name: str, arguments: dict[str, Any]) -> str:
    """Run the target's tool `name` on `state`; a refusal (a setting a tool depends on is off, a bad
    argument, an unknown id) raises `ToolError` with the phone's own message."""
    text, is_error = execute(state, name, arguments)
    if is_error:
        raise ToolError(text.removeprefix("Error: "))
    return text


def phone_rubric(trajectory: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Score an episode as the phone does (`trace_lib.envs.phone.milestones`): replay its tool calls on
    `meta["world"]`, match the snapshots to `meta["milestones"]`; each milestone is a rubric step (its
    similarity) and `meta["minefields"]` (and tables no milestone names staying unchanged) the gate."""
    missing = [k for k in ("world", "milestones") if k not in meta]
    if missing:
        raise ValueError(f"phone_rubric: the task's meta lacks {missing} (the starting world and the milestones)")
    if not meta["milestones"]:
        raise ValueError("phone_rubric: the task has no milestones; a training task needs at least one (with none, "
                         "an agent that does nothing would score 1)")
    snaps, start = replay_snapshots(trajectory.get("messages", []), meta["world"])
    result = score_scenario(meta, snaps, start)
    steps = {_label(i, x): v for i, (x, v) in enumerate(zip(meta["milestones"], result["milestones"], strict=True))}
    return rubric(steps, {"no_minefield": result["minefield"] is None and result["changed"] is None})


def phone_capabilities() -> list[str]:
    """Capability ids with a phone template, in `trace_lib.capabilities` order."""
    from trace_lib.capabilities import CAPABILITY_TAGS

    return [c for c in CAPABILITY_TAGS if _families_for(c)]


def _label(i: int, milestone: dict[str, Any]) -> str:
    c = milestone["constraints"][0] if milestone["constraints"] else {"kind": "any"}
    what = c.get("tool") or c.get("table") or ("_".join(sorted(c.get("values", {}))) or c["kind"])
    return f"m{i + 1}_{c['kind']}_{what}"


class BoundPhoneTemplate:
    """The contract's functions for one capability on the phone target (see `trace_lib.synth_sdk`)."""

    def __init__(self, capability: str, target: dict[str, Any]) -> None:
        if target.get("name") != "phone":
            raise ValueError(f"phone templates bind to the phone target, got {target.get('name')!r}")
        self.families = _families_for(capability)
        if not self.families:
            raise ValueError(f"synthesize: no phone scenario trains {capability!r}; phone templates exist for "
                             f"{phone_capabilities()}")
        self.capability = capability
        self.target = dict(target)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [spec.to_schema() for spec in phone_tool_specs()]

    def generate_task(self, seed: int, difficulty: int) -> dict[str, Any]:
        if not DIFFICULTY["min"] <= difficulty <= DIFFICULTY["max"]:
            raise ValueError(f"difficulty must be in [{DIFFICULTY['min']}, {DIFFICULTY['max']}], got {difficulty}")
        easiest = min(d for _, d in self.families)
        names = [n for n, d in self.families if d <= max(difficulty, easiest)]
        by_name = {f.name: f for f in scenarios.FAMILIES}
        rng = random.Random(f"{self.capability}:{seed}:{difficulty}")
        for attempt in range(TRIES):
            fam = by_name[rng.choice(names)]
            task = scenarios.scenario_task(fam, seed, SYNTH_SPLIT, attempt)
            if self.capability in task.capability_tags and task.meta["milestones"]:
                break
        else:  # pragma: no cover - every family in `names` had such a scenario among 16 seeds
            raise RuntimeError(f"no {self.capability} scenario in {TRIES} tries")
        meta = {**task.meta, "capability": self.capability, "target": "phone", "seed": seed,
                "difficulty": difficulty, "family": fam.name}
        out = {"instruction": task.instruction, "user": task.user.model_dump(mode="json"),
               "required_outputs": task.required_outputs,
               "gold_actions": [c.model_dump(mode="json", exclude_none=True) for c in task.gold_actions],
               "capability_tags": task.capability_tags, "meta": meta}
        return json.loads(json.dumps(out))

    def init_state(self, task: dict[str, Any]) -> Any:
        return phone_world(task["meta"]["world"])

    def call_tool(self, state: Any, name: str, arguments: dict[str, Any]) -> str:
        return phone_call(state, name, arguments)

    def evaluate(self, trajectory: dict[str, Any], task: dict[str, Any], state: Any) -> int | dict[str, Any]:
        """The milestones as rubric steps, the minefields as a gate; 0 for an episode cut off by a limit or a
        repeated call."""
        if trajectory.get("termination") in LIMIT_ENDINGS:
            return 0
        task = task.model_dump(mode="json") if hasattr(task, "model_dump") else task
        return phone_rubric(trajectory, task["meta"])

    def solve(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        task = task.model_dump(mode="json") if hasattr(task, "model_dump") else task
        return [{"tool": s["call"]["name"], "arguments": copy.deepcopy(s["call"]["arguments"])} if "call" in s
                else {"say": s["say"]} for s in task["meta"]["reference"]]


def phone_module_doc(capability: str) -> tuple[str, str, str]:
    """(episodes, reward, difficulty) texts of the rendered module's docstring."""
    fams = ", ".join(n for n, _ in _families_for(capability))
    return (f"the phone's own scenario families whose scenarios train it ({fams}), on seeds the target never "
            "uses, with the target's world, tools and scripted user.",
            "the phone's milestone similarity as a rubric: one step per milestone (its similarity), a gate on "
            "the minefields.",
            "a task of difficulty d comes from a family of difficulty at most d (0-3).")
