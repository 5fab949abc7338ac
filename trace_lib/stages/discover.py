"""Stage `discover`: candidate capabilities from batches of failed trajectories (paper §3.1).

Reads params.yaml (`seed`, `env`, `rollout.split`, `analyst`, `discover`), the rollout trajectories
`data/rollouts/<split>.jsonl` and the environment's tasks and tool kinds. Writes
`data/discover/proposals.jsonl` (every per-batch proposal before merging, its source ending in
'run R batch B'), `data/discover/capabilities.jsonl` (the merged Capability records with their
evidence), `data/discover/ledger.jsonl` (analyst tokens and cost; LLM analysts only) and
`reports/metrics/discover.json`. The procedure is `trace_lib.analyst.discover`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_lib.analyst.discover import merge_proposals, proposal_records, propose_all
from trace_lib.llm import LLMError, analyst_client
from trace_lib.config import Params
from trace_lib.envs import load_tasks, make_env
from trace_lib.io import read_jsonl, write_json, write_jsonl
from trace_lib.paths import Paths
from trace_lib.records import Trajectory


def run_discover(params: Params, root: Path = Path(".")) -> dict[str, Any]:
    """Read the rollouts, propose per batch over R runs, merge, write proposals, candidates and metrics.

    Raises LLMError when every batch's analyst call failed (the metrics, with the errors, are written first).
    """
    paths = Paths(root)
    trajectories = read_jsonl(paths.rollouts(params.rollout.split), Trajectory)
    tasks = load_tasks(params.env, params.rollout.split, root)
    tool_kinds = make_env(params.env).tool_kinds()
    client = analyst_client(params.analyst, paths.discover_ledger, root, params.seed)
    cfg = params.discover
    proposals, errors = propose_all(trajectories, tasks, tool_kinds, cfg, client, params.seed)
    caps = merge_proposals(proposals, cfg, client)
    write_jsonl(paths.proposals, proposal_records(proposals))
    write_jsonl(paths.capabilities, caps)
    n_fail = sum(not t.success for t in trajectories)
    metrics = {
        "analyst": "rules" if client is None else f"{client.backend}:{client.model}",
        "trajectories": len(trajectories), "failures": n_fail,
        "runs": cfg.runs, "batch_size": cfg.batch_size, "proposals": len(proposals),
        "batch_errors": errors, "candidates": len(caps),
        "evidence": {c.id: len(c.evidence) for c in caps},
        "note": "no failures: nothing to discover" if n_fail == 0 else "",
    }
    write_json(paths.metrics("discover"), metrics)
    if errors and not proposals:
        raise LLMError(f"discover: every batch failed; first error: {errors[0]}")
    return metrics
