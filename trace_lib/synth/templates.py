"""The offline template synthesizer: one parameterized environment per capability (paper §3.2).

Reads the target's database and tool schemas through `trace_lib.synth_sdk` (never mutating them);
writes nothing. `render_template_module` returns the source text of a synthesized module
(`data/envs/<capability>/env.py`); the synthesize stage writes it. This is the synthesizer that
pairs with the rules analyst: where the paper has an LLM write a focused environment for a kept
capability, we bind a hand-written generator for each of the eight ids in
`trace_lib.capabilities`. Every template runs on the target's own tools over a private copy of
its database (`synth_sdk.TargetWorld`), so an adapter trained on it meets no interface shift.

Why the runtime code lives here and not in the rendered text: the sandbox lets a synthesized module
import only `trace_lib.synth_sdk` (plus the standard library and τ²'s domain packages). The
rendered module therefore calls `synth_sdk.template(CAPABILITY, TARGET)`, which binds the template
and returns a `BoundTemplate` whose methods are the contract's functions. The module stays a
dozen readable lines whose docstring says what it trains and how it rewards, and the generators
are tested once, here, instead of being copied into every module.

Seeds draw users (and their orders) from the TRAIN side of the target's split only: the built-in
target holds out users by `families.user_split(0, user_id, 0.5)`, and on τ²-bench retail we also
drop every user that a τ² test task is about. Synthetic training must never have seen the people
and orders the adapters are finally evaluated on, or a gain could come from memorised records.

This module is the registry: it binds a capability's template to a target and renders the module
text. The shared generation and evaluation pieces are in `trace_lib.synth.template_kit`, the
templates in `trace_lib.synth.templates_read` (no write expected) and `trace_lib.synth.templates_write`.
"""

from __future__ import annotations

import copy
import json
import random
import textwrap
from functools import lru_cache
from collections.abc import Sequence
from typing import Any

from trace_lib.capabilities import CAPABILITY_TAGS
from trace_lib.envs.base import LIMIT_ENDINGS
from trace_lib.synth import templates_phone, templates_read, templates_write
from trace_lib.synth.template_kit import DIFFICULTY, Checks, Episode, Template, pool
from trace_lib.synth.world import TargetWorld, target_tool_kinds, target_tool_schemas


# --- registry and binding -----------------------------------------------------------------------
@lru_cache(maxsize=1)
def _registry() -> dict[str, Template]:
    found = {t.capability: t for t in templates_read.TEMPLATES + templates_write.TEMPLATES}
    return {cap: found[cap] for cap in CAPABILITY_TAGS if cap in found}


def template_capabilities(target: str = "retail") -> list[str]:
    """Capability ids with a template on the target named `target`, in `CAPABILITY_TAGS` order (the
    retail templates also serve τ²-bench retail; the phone's come from its scenarios)."""
    if target == "phone":
        return templates_phone.phone_capabilities()
    return list(_registry())


def get_template(capability: str) -> Template:
    if capability not in _registry():
        raise ValueError(f"synthesize: no template for capability {capability!r}; templates exist for "
                         f"{template_capabilities()}")
    return _registry()[capability]


def _plain(task: Any) -> dict[str, Any]:
    return task.model_dump(mode="json") if hasattr(task, "model_dump") else task


class BoundTemplate:
    """A template bound to a target: its methods are the synthesized-module contract's functions."""

    def __init__(self, template: Template, target: dict[str, Any], task_kinds: dict[str, int] | None = None) -> None:
        self.kinds = target_tool_kinds(target)  # also fails early, naming the supported targets
        if task_kinds and not template.weighted:
            raise ValueError(f"the {template.capability} template draws no task kinds (given {sorted(task_kinds)})")
        self.template = template
        self.target = dict(target)
        self.task_kinds = dict(task_kinds or {})

    def tool_schemas(self) -> list[dict[str, Any]]:
        return target_tool_schemas(self.target)

    def generate_task(self, seed: int, difficulty: int) -> dict[str, Any]:
        if not DIFFICULTY["min"] <= difficulty <= DIFFICULTY["max"]:
            raise ValueError(f"difficulty must be in [{DIFFICULTY['min']}, {DIFFICULTY['max']}], got {difficulty}")
        cap = self.template.capability
        extra = {"kinds": self.task_kinds, "seed": seed} if self.task_kinds else {}
        fields = self.template.generate(pool(self.target["name"]), random.Random(f"{cap}:{seed}:{difficulty}"),
                                        difficulty, **extra)
        plan = fields.pop("plan")
        user = {"known_info": {}, "unknown_info": [], "task_instructions": "", "confirm": True, **fields.pop("user")}
        task = {"instruction": fields.pop("instruction"), "user": user,
                "required_outputs": fields.pop("required_outputs", []), "gold_actions": fields.pop("gold_actions"),
                "meta": {"capability": cap, "target": self.target["name"], "seed": seed,
                         "difficulty": difficulty, **fields, "reference": plan}}
        return json.loads(json.dumps(task))  # plain JSON types, and a copy nobody else holds

    def init_state(self, task: dict[str, Any]) -> TargetWorld:
        return TargetWorld(self.target)

    def call_tool(self, state: TargetWorld, name: str, arguments: dict[str, Any]) -> str:
        return state.call(name, arguments)

    def evaluate(self, trajectory: dict[str, Any], task: dict[str, Any], state: TargetWorld) -> int | dict[str, Any]:
        """The template's rubric (`trace_lib.synth.rubric`); 0 for an episode cut off by a limit or a repeated
        call."""
        task = _plain(task)
        ep = Episode(trajectory, self.kinds)
        if ep.termination in LIMIT_ENDINGS:
            return 0
        return self.template.check(ep, task, Checks(ep, task, state, self.target))

    def solve(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return copy.deepcopy(_plain(task)["meta"]["reference"])


def bind_template(capability: str, target: dict[str, Any],
                  kinds: dict[str, int] | None = None) -> BoundTemplate | templates_phone.BoundPhoneTemplate:
    """The template for `capability` on `target` (what `synth_sdk.template` returns); `kinds` weights the task
    kinds of a template that draws them (`Template.weighted`)."""
    if target.get("name") == "phone":
        if kinds:
            raise ValueError("the phone templates draw no task kinds")
        return templates_phone.BoundPhoneTemplate(capability, target)
    return BoundTemplate(get_template(capability), target, kinds)


def template_kinds(capability: str, target: dict[str, Any], tasks: list[dict[str, Any]]) -> dict[str, int]:
    """Task kind -> weight for `capability`'s template from the failed target tasks behind it (its evidence):
    {} where the template draws no kinds or the target is not the retail database."""
    if target.get("name") == "phone" or not get_template(capability).weighted:
        return {}
    return templates_read.evidence_kinds(pool(target["name"]).db, tasks)


def task_kinds(target: dict[str, Any], task: dict[str, Any]) -> list[str]:
    """The kinds one target task asks, as `templates_read.evidence_kinds` classifies them; [] on a target other than
    the retail database."""
    if target.get("name") == "phone":
        return []
    return list(templates_read.evidence_kinds(pool(target["name"]).db, [task]))


def kind_outcomes(target: dict[str, Any], tasks: dict[str, dict[str, Any]],
                  episodes: Sequence[tuple[str, bool]]) -> dict[str, tuple[int, int]]:
    """Task kind -> (episodes solved, episodes played) over the base model's target `episodes` ((task id, success)
    pairs; `tasks`: the target tasks by id), each task's kinds by `task_kinds`; {} on a target other than the retail
    database."""
    asks = {task_id: task_kinds(target, task) for task_id, task in tasks.items()}
    out: dict[str, list[int]] = {}
    for task_id, success in episodes:
        for kind in asks.get(task_id, []):
            solved_played = out.setdefault(kind, [0, 0])
            solved_played[0] += success
            solved_played[1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def unsolved_kinds(kinds: dict[str, int], outcomes: dict[str, tuple[int, int]], most: float) -> dict[str, int]:
    """`kinds` without those the base model already solves: a kind whose share of solved target episodes
    (`kind_outcomes`) exceeds `most`. All of `kinds` where that would leave none."""
    left = {k: w for k, w in kinds.items() if k not in outcomes or outcomes[k][0] <= most * outcomes[k][1]}
    return left or dict(kinds)


def render_template_module(capability: str, target: dict[str, Any], difficulty_default: int = 1,
                           kinds: dict[str, int] | None = None) -> str:
    """Source text of a synthesized module binding the template (with `kinds`: drawing its tasks' kinds with
    those weights); same inputs give the same bytes."""
    if target.get("name") == "phone":
        templates_phone.BoundPhoneTemplate(capability, target)  # fails early, naming the phone's capabilities
        episodes, reward, difficulty = templates_phone.phone_module_doc(capability)
    else:
        tpl = get_template(capability)
        episodes, reward, difficulty = tpl.episodes, tpl.reward, tpl.difficulty
        BoundTemplate(tpl, target, kinds)  # fails early where the template draws no kinds
    target_tool_kinds(target)
    if not DIFFICULTY["min"] <= difficulty_default <= DIFFICULTY["max"]:
        raise ValueError(f"difficulty_default must be in [{DIFFICULTY['min']}, {DIFFICULTY['max']}]")
    knob = {**DIFFICULTY, "default": difficulty_default}

    def para(label: str, text: str) -> str:
        return textwrap.fill(f"{label}: {text}", width=100, subsequent_indent="    ")

    doc = "\n\n".join([
        f"Synthetic environment for `{capability}` on the {target['name']} target (template synthesizer).",
        para("Trains", CAPABILITY_TAGS[capability] + "."),
        para("Episodes", episodes),
        para("Reward", reward + " Partial credit: the mean of the rubric's steps when every gate holds "
             "(trace_lib.synth.rubric). Episodes cut off by the step or error limit score 0."),
        para("Difficulty", difficulty),
        *([para("Kinds", "drawn with the weights in KINDS: how often the failed target tasks behind this "
                "capability asked each kind.")] if kinds else []),
        textwrap.fill("Rendered by trace_lib.synth.templates.render_template_module (paper §3.2). The "
                      "generator, the target's tools and the checker live in trace_lib.synth.templates; "
                      "this module reaches them through trace_lib.synth_sdk.template, the only trace "
                      "module a synthesized environment may import.", width=100),
    ])
    target_src = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(target[k])}" for k in sorted(target)) + "}"
    knob_src = "{" + ", ".join(f'"{k}": {knob[k]}' for k in ("default", "min", "max")) + "}"
    kinds_src = ("\nKINDS = {" + ", ".join(f"{json.dumps(k)}: {int(v)}" for k, v in kinds.items()) + "}") if kinds else ""
    bind = "template(CAPABILITY, TARGET, KINDS)" if kinds else "template(CAPABILITY, TARGET)"
    return f'''"""{doc}
"""

from trace_lib.synth_sdk import target_tool_schemas, template

CAPABILITY = {json.dumps(capability)}
TARGET = {target_src}
DIFFICULTY = {knob_src}{kinds_src}

_TEMPLATE = {bind}


def tool_schemas():
    return target_tool_schemas(TARGET)


def generate_task(seed, difficulty):
    return _TEMPLATE.generate_task(seed, difficulty)


def init_state(task):
    return _TEMPLATE.init_state(task)


def call_tool(state, name, arguments):
    return _TEMPLATE.call_tool(state, name, arguments)


def evaluate(trajectory, task, state):
    return _TEMPLATE.evaluate(trajectory, task, state)


def solve(task):
    return _TEMPLATE.solve(task)
'''
