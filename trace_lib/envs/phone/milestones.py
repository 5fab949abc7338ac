"""Milestone and minefield scoring of a phone episode (ToolSandbox's evaluation, arXiv 2408.04682).

Reads an episode's snapshots and a scenario's milestones; writes nothing. A *snapshot* is taken after
every event of the episode: each tool call (the world's four tables after it, and the call) and each
message the agent says to the user. A *milestone* is a set of constraints on one snapshot; milestones
form a DAG (`after`: the milestones that must be matched at an earlier or the same snapshot). A
*minefield* is a constraint that must never hold.

Similarities, each in [0, 1]:

* `added` / `updated` / `removed` rows of a table, compared with a reference snapshot (below);
  `added` needs exactly as many new rows as the constraint lists (one); a row's similarity is the
  geometric mean of its columns' (text columns `content` and `query`: ROUGE-L F1 over words, the
  rest exact);
* `setting`: the listed settings hold (geometric mean of 0/1 per setting);
* `call`: the snapshot's event is a successful call of the tool with the listed arguments (numbers
  within 1e-6, text columns ROUGE-L, the rest exact);
* `said`: the snapshot's event is a message to the user; the share of the listed facts it states
  (the matcher of `trace_lib.envs.said`).

Row constraints compare with the snapshot where the milestone's latest `after` matched (the starting
world when it has none): "a message added after the contact lookup". A milestone's similarity at a
snapshot is the geometric mean of its constraints'. The episode's similarity is the best assignment
of milestones to snapshots that respects the DAG, as the mean over milestones (1 with none); a
minefield that holds anywhere makes it 0, and so does a guardrail: tables that no milestone of the
scenario constrains (every table, with no milestones) must equal the starting world at every
snapshot, so a change nobody asked for costs the whole score (ToolSandbox guards per milestone
against its DAG predecessors; guarding the whole episode also catches changes after the last
milestone and in scenarios without milestones). *Perfect* means similarity 1.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trace_lib.envs.phone.world import ID_COLUMNS
from trace_lib.envs.said import output_found

TEXT_COLUMNS = ("content", "query", "body")
ROW_KEYS = ID_COLUMNS


class Constraint(BaseModel):
    """One condition on a snapshot (module docstring)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["added", "updated", "removed", "setting", "call", "said"]
    table: str | None = None
    """`added` / `updated` / `removed`: contacts, messages or reminders."""
    row: dict[str, Any] = Field(default_factory=dict)
    """Row constraints: the columns that must match (`updated` / `removed`: must hold the row's id)."""
    tool: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    """`call`: the tool and the arguments that must match (others are free)."""
    facts: list[str] = Field(default_factory=list)
    """`said`: what the message must state."""
    values: dict[str, bool] = Field(default_factory=dict)
    """`setting`: setting -> required value."""

    def tables(self) -> set[str]:
        if self.kind == "setting":
            return {"settings"}
        return {self.table} if self.table else set()


class Milestone(BaseModel):
    model_config = ConfigDict(extra="forbid")
    constraints: list[Constraint]
    after: list[int] = Field(default_factory=list)
    """Indices of milestones that must match at an earlier or the same snapshot."""


class Snapshot(BaseModel):
    """The world's tables after one event, and the event: a tool call or a message to the user."""

    model_config = ConfigDict(extra="forbid")
    tables: dict[str, Any]
    call: dict[str, Any] | None = None
    """{name, arguments, ok}"""
    said: str | None = None


# --- similarities --------------------------------------------------------------------------------
_WORD = re.compile(r"[a-z0-9]+(?:\.[0-9]+)?")


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased words (written here: one LCS, no tokenizer package needed)."""
    a, b = _WORD.findall(str(candidate).lower()), _WORD.findall(str(reference).lower())
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def value_similarity(column: str, got: Any, want: Any) -> float:
    if column in TEXT_COLUMNS and isinstance(want, str):
        return rouge_l(got if got is not None else "", want)
    if isinstance(want, int | float) and not isinstance(want, bool):
        try:
            return float(abs(float(got) - float(want)) <= 1e-6)
        except (TypeError, ValueError):
            return 0.0
    return float(got == want)


def geometric_mean(values: Sequence[float]) -> float:
    if not values:
        return 1.0
    if min(values) <= 0:
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def row_similarity(row: dict[str, Any], want: dict[str, Any]) -> float:
    return geometric_mean([value_similarity(k, row.get(k), v) for k, v in want.items()])


def _rows(tables: dict[str, Any], table: str) -> dict[str, dict[str, Any]]:
    return {r[ROW_KEYS[table]]: r for r in tables.get(table, [])}


def constraint_similarity(c: Constraint, snap: Snapshot, start: dict[str, Any], attempts: bool = False) -> float:
    """How well `snap` meets `c` (module docstring); rows compared with the tables `start`; a `call`
    constraint with `attempts` also matches a refused call."""
    if c.kind == "setting":
        return geometric_mean([float(snap.tables["settings"].get(k) == v) for k, v in c.values.items()])
    if c.kind == "call":
        call = snap.call
        if not call or not (call.get("ok") or attempts) or call.get("name") != c.tool:
            return 0.0
        return geometric_mean([value_similarity(k, call.get("arguments", {}).get(k), v) for k, v in c.args.items()])
    if c.kind == "said":
        if snap.said is None:
            return 0.0
        return sum(output_found(f, [snap.said], strict=False) for f in c.facts) / len(c.facts) if c.facts else 1.0
    assert c.table is not None
    now, before = _rows(snap.tables, c.table), _rows(start, c.table)
    if c.kind == "added":
        new = [r for k, r in now.items() if k not in before]
        return row_similarity(new[0], c.row) if len(new) == 1 else 0.0
    key = c.row.get(ROW_KEYS[c.table])
    if c.kind == "removed":
        return float(key in before and key not in now)
    if key not in now or now[key] == before.get(key):
        return 0.0
    return row_similarity(now[key], c.row)


# --- matching ------------------------------------------------------------------------------------
def _check_dag(milestones: Sequence[Milestone]) -> None:
    for i, x in enumerate(milestones):
        bad = [j for j in x.after if not 0 <= j < i]
        if bad:
            raise ValueError(f"milestone {i}: 'after' must name earlier milestones, got {bad}")


def guarded_tables(milestones: Sequence[Milestone], start: dict[str, Any]) -> list[str]:
    """Tables no milestone constrains: they must stay as the episode found them."""
    allowed = set().union(*(c.tables() for x in milestones for c in x.constraints))
    return [t for t in start if t not in allowed]


def best_assignment(milestones: Sequence[Milestone], snaps: Sequence[Snapshot],
                    start: dict[str, Any]) -> tuple[float, list[float]]:
    """The largest sum of milestone similarities over assignments of milestones (in index order, a
    topological order) to snapshots, each at or after the snapshots of its `after`; and each milestone's
    similarity in it. Row constraints compare with the latest snapshot of the milestone's `after` (the
    starting world for a milestone without one), so "added after the lookup" means what it says."""
    _check_dag(milestones)
    n, cols = len(milestones), len(snaps)
    sims: dict[tuple[int, int, int], float] = {}

    def sim(i: int, s: int, ref: int) -> float:
        key = (i, s, ref)
        if key not in sims:
            base = start if ref < 0 else snaps[ref].tables
            sims[key] = geometric_mean([constraint_similarity(c, snaps[s], base) for c in milestones[i].constraints])
        return sims[key]

    memo: dict[tuple, tuple[float, list[float]]] = {}

    def go(i: int, placed: tuple[int, ...]) -> tuple[float, list[float]]:
        if i == n:
            return 0.0, []
        needed = tuple(placed[j] for j in range(i) if any(j in milestones[k].after for k in range(i, n)))
        if (i, needed) in memo:
            return memo[(i, needed)]
        ref = max((placed[j] for j in milestones[i].after), default=-1)
        best: tuple[float, list[float]] = (-1.0, [])
        for s in range(max(ref, 0), cols):
            value = sim(i, s, ref)
            rest, tail = go(i + 1, placed + (s,))
            if value + rest > best[0]:
                best = (value + rest, [value, *tail])
        if best[0] < 0:  # no snapshot left: this milestone scores 0 and the later ones are still placed
            rest, tail = go(i + 1, placed + (cols,))
            best = (rest, [0.0, *tail])
        memo[(i, needed)] = best
        return best

    return go(0, ())


def score_scenario(meta: dict[str, Any], snaps: Sequence[Snapshot], start: dict[str, Any]) -> dict[str, Any]:
    """`score_episode` with the milestones and minefields of a scenario's `meta` (as the tasks store them)."""
    return score_episode([Milestone.model_validate(x) for x in meta.get("milestones", [])],
                         [Constraint.model_validate(x) for x in meta.get("minefields", [])], snaps, start)


def score_episode(milestones: Sequence[Milestone], minefields: Sequence[Constraint], snaps: Sequence[Snapshot],
                  start: dict[str, Any]) -> dict[str, Any]:
    """{similarity, perfect, milestones (each one's matched similarity), minefield (index hit or None),
    changed (a table no milestone names that the episode changed, or None)}. A minefield on a call is
    hit by any attempt of the call, refused or not; a changed table zeroes the score like a minefield."""
    mine = next((k for k, c in enumerate(minefields)
                 if any(constraint_similarity(c, s, start, attempts=True) > 0 for s in snaps)), None)
    guarded = guarded_tables(milestones, start)
    changed = next((t for s in snaps for t in guarded if s.tables[t] != start[t]), None)
    if milestones:
        total, each = best_assignment(milestones, snaps, start)
        similarity = total / len(milestones)
    else:
        each, similarity = [], 1.0
    if mine is not None or changed is not None:
        similarity = 0.0
    similarity = round(similarity, 6)
    return {"similarity": similarity, "perfect": similarity >= 1.0 - 1e-9,
            "milestones": [round(x, 6) for x in each], "minefield": mine, "changed": changed}
