"""Stage `score`: label every trajectory x candidate, contrast failures with successes, select (paper §3.1).

Reads params.yaml (`seed`, `env`, `rollout.split`, `analyst`, `score`), `data/rollouts/<split>.jsonl`,
`data/discover/capabilities.jsonl` and the environment's tasks and tool kinds. Writes
`data/score/labels.jsonl` (Label records), `data/score/scores.jsonl` (CapabilityScore records),
`data/score/runs.jsonl` (per-run Δ/coverage, for the stability figure), `data/score/kept.jsonl` (the
kept Capability records, input of synthesis), `data/score/ledger.jsonl` (LLM analysts only) and
`reports/metrics/score.json` (the selection, each candidate's reason, and the ground-truth
precision/recall on the built-in families). The statistics are `trace_lib.analyst.score`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_lib.llm import analyst_client
from trace_lib.analyst.score import (
    ground_truth_metrics,
    label_trajectories,
    score_capabilities,
    score_runs,
)
from trace_lib.config import Params
from trace_lib.envs import load_tasks, make_env
from trace_lib.io import read_jsonl, write_json, write_jsonl
from trace_lib.paths import Paths
from trace_lib.records import Capability, Trajectory


def run_score(params: Params, root: Path = Path(".")) -> dict[str, Any]:
    """Label, score, select, check against the families' tags; write the records and the metrics."""
    paths = Paths(root)
    trajectories = read_jsonl(paths.rollouts(params.rollout.split), Trajectory)
    caps = read_jsonl(paths.capabilities, Capability)
    tasks = load_tasks(params.env, params.rollout.split, root)
    tool_kinds = make_env(params.env).tool_kinds()
    client = analyst_client(params.analyst, paths.score_ledger, root, params.seed)
    cfg = params.score
    labels = label_trajectories(trajectories, caps, tasks, tool_kinds, cfg, client, params.seed)
    ids = [c.id for c in caps]
    runs = score_runs(labels, trajectories, cfg, ids, params.seed)
    scores = score_capabilities(labels, trajectories, cfg, ids, params.seed, runs)
    kept = [s.capability_id for s in scores if s.kept]
    write_jsonl(paths.labels, labels)
    write_jsonl(paths.scores, scores)
    write_jsonl(paths.score_runs, runs)
    write_jsonl(paths.kept, [c for c in caps if c.id in set(kept)])
    n_pos = sum(t.success for t in trajectories)
    metrics = {
        "analyst": "rules" if client is None else f"{client.backend}:{client.model}",
        "trajectories": len(trajectories), "successes": n_pos, "failures": len(trajectories) - n_pos,
        "candidates": len(caps), "kept": kept, "n_kept": len(kept),
        "delta": cfg.delta, "rho": cfg.rho, "n_runs": cfg.n_runs, "k_keep": cfg.k_keep,
        "label_errors": sum(lb.rationale.startswith("analyst error") for lb in labels),
        "reasons": {s.capability_id: s.reason for s in scores},
        "ground_truth": ground_truth_metrics(kept, tasks),
        "ground_truth_candidates": ground_truth_metrics(ids, tasks),
    }
    write_json(paths.metrics("score"), metrics)
    return metrics
