"""Discovery: candidate capabilities from batches of failed trajectories (paper §3.1).

Reads and writes nothing: functions from Trajectory / Task records (and the environment's tool
kinds) to Capability records. The discover stage (`stages/discover.py`) reads the rollouts
and writes the proposals and the merged candidates.

The procedure: for each of R runs, shuffle the failures D- with that run's seed and cut them into
batches of `batch_size` (~50 in the paper); the analyst proposes a capability dictionary (name,
description, how to recognise it, evidence ids) per batch; proposals of all runs are pooled and
near-duplicates merged, by MiniLM embeddings of "name: description" (`trace_lib.analyst.embed`),
by the analyst, or by exact name. Evidence is the union of the members' evidence.

With the `rules` analyst there is no LLM: a batch's proposals are the detectors of
`trace_lib.analyst.detectors` that return LACKING on at least `min_evidence` of its trajectories, and
merging is by detector id.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from trace_lib.analyst.detectors import DETECTORS, detect, detector_capabilities
from trace_lib.analyst.embed import embed_texts
from trace_lib.llm import LLMClient, LLMError
from trace_lib.analyst.prompting import load_prompt
from trace_lib.analyst.render import render_for_analyst, tools_block
from trace_lib.config import DiscoverConfig
from trace_lib.records import Capability, Task, Trajectory

PROPOSAL_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["capabilities"],
    "properties": {"capabilities": {"type": "array", "items": {
        "type": "object", "required": ["name", "description", "recognition", "evidence"],
        "properties": {"name": {"type": "string", "minLength": 3}, "description": {"type": "string"},
                       "recognition": {"type": "string"},
                       "evidence": {"type": "array", "items": {"type": "string"}}}}}},
}
MERGE_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["groups"],
    "properties": {"groups": {"type": "array", "items": {
        "type": "object", "required": ["name", "description", "members"],
        "properties": {"name": {"type": "string", "minLength": 3}, "description": {"type": "string"},
                       "recognition": {"type": "string"},
                       "members": {"type": "array", "items": {"type": "string"}}}}}},
}


@dataclass(frozen=True)
class Proposal:
    """One capability proposed on batch `batch` of run `run` (both counted from 0)."""

    run: int
    batch: int
    capability: Capability


def slug(name: str) -> str:
    """A capability id from a name: lower case, words joined by '_', at most 48 characters."""
    s = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return s[:48].rstrip("_") or "capability"


def failure_batches(failures: Sequence[Trajectory], batch_size: int, seed: int,
                    max_batches: int | None = None) -> list[list[Trajectory]]:
    """Failures shuffled with `seed` (from id order, so input order does not matter), in batches."""
    pool = sorted(failures, key=lambda t: t.id)
    random.Random(seed).shuffle(pool)
    batches = [pool[i:i + batch_size] for i in range(0, len(pool), batch_size)]
    return batches[:max_batches] if max_batches else batches


def propose_rules(batch: Sequence[Trajectory], tasks: dict[str, Task], tool_kinds: dict[str, str],
                  min_evidence: int = 1) -> list[Capability]:
    """The detectors that return LACKING on at least `min_evidence` trajectories of the batch."""
    lacking: dict[str, list[str]] = {cid: [] for cid in DETECTORS}
    for traj in batch:
        for label in detect(traj, tool_kinds, tasks.get(traj.task_id)):
            if label.label == "LACKING":
                lacking[label.capability_id].append(traj.id)
    caps = []
    for cap in detector_capabilities():
        ids = lacking[cap.id]
        if len(ids) >= min_evidence:
            caps.append(cap.model_copy(update={"evidence": sorted(ids)}))
    return caps


def propose_llm(batch: Sequence[Trajectory], tasks: dict[str, Task], tool_kinds: dict[str, str],
                cfg: DiscoverConfig, client: LLMClient, tag: str = "") -> list[Capability]:
    """One analyst call: a capability dictionary for this batch; evidence outside it is dropped."""
    system = load_prompt("discover_system.md", tools=tools_block(tool_kinds))
    body = "\n\n".join(render_for_analyst(t, tasks.get(t.task_id), cfg.trajectory_chars) for t in batch)
    user = f"{len(batch)} failed conversations{(' (' + tag + ')') if tag else ''}:\n\n{body}"
    reply = client.complete_json(system, [{"role": "user", "content": user}], PROPOSAL_SCHEMA,
                                 max_tokens=cfg.max_tokens, temperature=cfg.temperature, stage="discover")
    ids = {t.id for t in batch}
    caps = []
    for item in reply["capabilities"]:
        caps.append(Capability(id=slug(item["name"]), name=item["name"].strip(),
                               description=item["description"].strip(), recognition=item["recognition"].strip(),
                               evidence=sorted({e for e in item["evidence"] if e in ids}),
                               source=f"{client.backend}:{client.model}"))
    return caps


def propose_all(trajectories: Sequence[Trajectory], tasks: Sequence[Task], tool_kinds: dict[str, str],
                cfg: DiscoverConfig, client: LLMClient | None, seed: int = 0) -> tuple[list[Proposal], list[str]]:
    """Per-batch proposals over R runs, and the batches that failed (recorded, not raised)."""
    by_id = {t.id: t for t in tasks}
    failures = [t for t in trajectories if not t.success]
    proposals: list[Proposal] = []
    errors: list[str] = []
    for run in range(cfg.runs):
        for b, batch in enumerate(failure_batches(failures, cfg.batch_size, seed * 1000 + run, cfg.max_batches)):
            if client is None:
                caps = propose_rules(batch, by_id, tool_kinds, cfg.min_evidence)
            else:
                try:
                    caps = propose_llm(batch, by_id, tool_kinds, cfg, client, tag=f"run {run + 1}, batch {b + 1}")
                except LLMError as err:
                    errors.append(f"run {run} batch {b}: {err}")
                    continue
            proposals += [Proposal(run, b, c) for c in caps]
    return proposals, errors


def _combine(members: list[Capability], name: str | None = None, description: str | None = None,
             recognition: str | None = None) -> Capability:
    head = members[0]
    return Capability(id=slug(name) if name else head.id, name=name or head.name,
                      description=description or head.description, recognition=recognition or head.recognition,
                      evidence=sorted({e for m in members for e in m.evidence}), source=head.source)


def _ranked(caps: Sequence[Capability]) -> list[Capability]:
    # The best-supported wording represents a group; ties by id keep the result order-free.
    return sorted(caps, key=lambda c: (-len(c.evidence), c.id, c.name, c.description))


def merge_capabilities(caps: Sequence[Capability], method: str = "embedding", threshold: float = 0.85,
                       client: LLMClient | None = None, embed=embed_texts) -> list[Capability]:
    """Pool proposals: same id always merges; then near-duplicates by `method`. Sorted by id."""
    by_id: dict[str, list[Capability]] = {}
    for c in _ranked(caps):
        by_id.setdefault(c.id, []).append(c)
    pooled = _ranked([_combine(members) for members in by_id.values()])
    if method == "embedding" and len(pooled) > 1:
        vecs = embed([f"{c.name}: {c.description}" for c in pooled])
        groups: list[list[int]] = []
        for i in range(len(pooled)):
            home = next((g for g in groups if float(vecs[g[0]] @ vecs[i]) >= threshold), None)
            if home is None:
                groups.append([i])
            else:
                home.append(i)
        pooled = [_combine([pooled[i] for i in g]) for g in groups]
    elif method == "analyst" and client is not None and len(pooled) > 1:
        pooled = _merge_with_analyst(pooled, client)
    out: dict[str, Capability] = {}
    for c in _ranked(pooled):
        cid, k = c.id, 2
        while cid in out:  # different skills whose names slug alike keep distinct ids
            cid, k = f"{c.id}_{k}", k + 1
        out[cid] = c.model_copy(update={"id": cid})
    return [out[k] for k in sorted(out)]


def _merge_with_analyst(pooled: list[Capability], client: LLMClient) -> list[Capability]:
    listing = "\n".join(f"- {c.id}: {c.name}. {c.description} (evidence: {len(c.evidence)})" for c in pooled)
    reply = client.complete_json(load_prompt("discover_merge.md"), [{"role": "user", "content": listing}],
                                 MERGE_SCHEMA, max_tokens=4096, temperature=0.0, stage="discover")
    known = {c.id: c for c in pooled}
    used: set[str] = set()
    merged = []
    for g in reply["groups"]:
        members = [known[m] for m in dict.fromkeys(g["members"]) if m in known and m not in used]
        if members:
            used.update(m.id for m in members)
            merged.append(_combine(_ranked(members), g["name"], g["description"], g.get("recognition")))
    return merged + [c for c in pooled if c.id not in used]  # the analyst forgot these: keep as is


def merge_proposals(proposals: Sequence[Proposal], cfg: DiscoverConfig, client: LLMClient | None) -> list[Capability]:
    """The candidates: every run's proposals pooled and merged (by detector id for the rules analyst,
    else by `cfg.merge`)."""
    method = "name" if client is None else cfg.merge
    return merge_capabilities([p.capability for p in proposals], method, cfg.merge_threshold, client)


# --- proposals as records -----------------------------------------------------------------------
_ORIGIN = re.compile(r"run (\d+) batch (\d+)$")


def proposal_records(proposals: Sequence[Proposal]) -> list[Capability]:
    """Proposals as Capability records whose `source` ends in 'run R batch B' (what the stage writes)."""
    return [p.capability.model_copy(update={"source": f"{p.capability.source} run {p.run} batch {p.batch}"})
            for p in proposals]


def proposal_rows(records: Sequence[Capability]) -> pd.DataFrame:
    """One row per written proposal: capability id, evidence count, source, and the run and batch read
    back from the source (None where it does not end in 'run R batch B')."""
    rows = []
    for c in records:
        origin = _ORIGIN.search(c.source)
        rows.append({"capability": c.id, "evidence": len(c.evidence), "source": c.source,
                     "run": int(origin.group(1)) if origin else None,
                     "batch": int(origin.group(2)) if origin else None})
    return pd.DataFrame(rows, columns=["capability", "evidence", "source", "run", "batch"])
