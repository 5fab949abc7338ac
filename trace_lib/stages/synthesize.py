"""Stage `synthesize`: one validated training environment per kept capability (paper §3.2).

Reads params.yaml (`seed`, `env`, `rollout.split`, `analyst`, `synthesize`, and `model` when validation
checks the difficulty band), `data/score/kept.jsonl` and the evidence in
`data/rollouts/<split>.jsonl` (the LLM synthesizer shows some; the template synthesizer draws its task kinds
from their tasks). Writes, per capability, `data/envs/<capability>/` (attempts, and
`env.py` + `manifest.json` when one passed validation; see `trace_lib.synth.synthesize`), the list
`data/envs/manifests.jsonl` (valid or not, with the reason), `data/envs/llm_ledger.jsonl` (LLM
synthesizers), `data/envs/rollouts.jsonl` (rollouts spent on difficulty-band checks) and
`reports/metrics/synthesize.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_lib.analyst.llm import analyst_client
from trace_lib.config import Params
from trace_lib.io import read_jsonl, write_json, write_jsonl
from trace_lib.paths import Paths
from trace_lib.records import Capability, Trajectory
from trace_lib.synth.synthesize import resolve_synth_backend, synthesize_env
from trace_lib.training.budget import RolloutLedger


def run_synthesize(params: Params, root: Path = Path(".")) -> dict[str, Any]:
    """Every kept capability gets a validated environment or a recorded reason; writes the manifests and metrics."""
    paths = Paths(root)
    kept = read_jsonl(paths.kept, Capability)
    backend = resolve_synth_backend(params.synthesize, params.analyst.backend)
    client = None if backend == "template" else analyst_client(
        params.analyst.model_copy(update={"backend": backend}), paths.synth_ledger, root, params.seed)
    rollouts = paths.rollouts(params.rollout.split)
    evidence = read_jsonl(rollouts, Trajectory) if rollouts.is_file() else []
    policy = ledger = None
    if params.synthesize.validation.band:
        # Heavy (torch): imported only when validation rolls the policy out.
        from trace_lib.agent.policy import load_policy

        policy = load_policy(Path(params.model.out_dir), dtype=params.model.dtype, device=params.model.device,
                             tool_format=params.model.tool_format)
        ledger = RolloutLedger(paths.synth_rollouts)
    manifests = [synthesize_env(cap, backend, params, root, client=client, evidence=evidence,
                                policy=policy, ledger=ledger) for cap in kept]
    write_jsonl(paths.env_manifests, manifests)
    metrics = {
        "backend": backend,
        "kept": len(kept),
        "valid": sum(m.valid for m in manifests),
        "envs": {m.capability_id: {"valid": m.valid, "attempts": m.attempts,
                                   "failed": m.validation.get("failed"), "reason": m.reason} for m in manifests},
        "note": "no kept capabilities: nothing to synthesize" if not kept else "",
    }
    write_json(paths.metrics("synthesize"), metrics)
    return metrics
