"""Multi-level rewards: a synthetic environment's verdict as named rubric items.

Reads and writes nothing. Paper §3.2 asks a synthesized environment for rewards at several levels
(partial credit for the sub-steps of its capability), so that GRPO groups have signal before the
policy ever completes an episode. A module's `evaluate` may return either

* 0 or 1 (or a bool): all-or-nothing, as before; or
* a rubric: `{"steps": {name: value in [0, 1]}, "gates": {name: bool}}`. Steps are the sub-steps the
  capability is made of (each order read, each fact said, the confirmation asked, the change made);
  gates are what must not go wrong (no write where none was asked for, no call repeated three times).

The episode's score is the mean of the steps when every gate holds and 0 otherwise, so an agent that
does nothing, or does the forbidden thing, earns nothing, and the score reaches 1 (success) only
when every step is complete. Steps that a do-nothing agent would pass ("nothing was written") belong
among the gates; `trace_lib.synth.validate` checks that a do-nothing agent fails, whatever the form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


class RubricError(ValueError):
    """An `evaluate` result that is neither 0/1 nor a well-formed rubric; the message says why."""


def share(flags: Sequence[bool]) -> float:
    """The fraction of `flags` that hold (1.0 for none: nothing was asked)."""
    return sum(map(bool, flags)) / len(flags) if flags else 1.0


def rubric(steps: Mapping[str, float | bool], gates: Mapping[str, bool] | None = None) -> dict[str, Any]:
    """A rubric verdict in the contract's form (values as plain floats and bools, names kept in order)."""
    return {"steps": {k: float(v) for k, v in steps.items()}, "gates": {k: bool(v) for k, v in (gates or {}).items()}}


def rubric_score(steps: Mapping[str, float], gates: Mapping[str, bool]) -> float:
    """Mean of the steps if every gate holds, else 0."""
    if not all(gates.values()):
        return 0.0
    return sum(steps.values()) / len(steps)


def _step_value(name: str, value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or math.isnan(value) or not 0 <= value <= 1:
        raise RubricError(f"rubric step {name!r} is {value!r}, expected a number in [0, 1] or a bool")
    return float(value)


def verdict(value: Any) -> dict[str, Any]:
    """`{"score", "steps", "gates"}` of an `evaluate` result (RubricError if it is malformed).

    0/1 gives empty steps and gates; a rubric gives its items, validated, and `rubric_score`."""
    if isinstance(value, bool) or (isinstance(value, (int, float)) and value in (0, 1)):
        return {"score": float(value), "steps": {}, "gates": {}}
    if not isinstance(value, Mapping):
        raise RubricError(f"evaluate returned {value!r}, expected 0, 1 or a rubric "
                          '{"steps": {name: value in [0, 1]}, "gates": {name: bool}}')
    unknown = sorted(set(value) - {"steps", "gates"})
    if unknown:
        raise RubricError(f"rubric has unknown keys {unknown}; expected 'steps' and optionally 'gates'")
    steps, gates = value.get("steps"), value.get("gates", {})
    if not isinstance(steps, Mapping) or not steps:
        raise RubricError(f"rubric 'steps' is {steps!r}, expected a non-empty dict of name -> value in [0, 1]")
    if not isinstance(gates, Mapping):
        raise RubricError(f"rubric 'gates' is {gates!r}, expected a dict of name -> bool")
    for name in list(steps) + list(gates):
        if not isinstance(name, str) or not name:
            raise RubricError(f"rubric item name {name!r} is not a non-empty string")
    bad_gates = {k: v for k, v in gates.items() if not isinstance(v, bool) and v not in (0, 1)}
    if bad_gates:
        raise RubricError(f"rubric gates {bad_gates} are not bools")
    clean_steps = {k: _step_value(k, v) for k, v in steps.items()}
    clean_gates = {k: bool(v) for k, v in gates.items()}
    return {"score": rubric_score(clean_steps, clean_gates), "steps": clean_steps, "gates": clean_gates}


def item_means(rubrics: Sequence[Mapping[str, Any] | None]) -> dict[str, float]:
    """Per item, its mean over the episodes whose verdict has it (a gate counts 1 when it holds); steps
    first, then gates, each in first-seen order. Episodes without a rubric (cut off by a limit, or an
    all-or-nothing environment) are left out."""
    values: dict[str, list[float]] = {}
    for part in ("steps", "gates"):
        for r in rubrics:
            for name, v in ((r or {}).get(part) or {}).items():
                values.setdefault(name, []).append(float(v))
    return {name: sum(vs) / len(vs) for name, vs in values.items()}
