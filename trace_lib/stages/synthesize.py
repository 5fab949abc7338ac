"""Stage `synthesize`: one validated training environment per kept capability (paper §3.2).

Reads params.yaml (`seed`, `env`, `rollout.split`, `analyst`, `synthesize`, and `model` when validation
checks the difficulty band), `data/score/kept.jsonl` and the evidence in
`data/rollouts/<split>.jsonl` (the LLM synthesizer shows some; the template synthesizer draws its task kinds
from their tasks). Writes, per capability, `data/envs/<capability>/` (attempts, and
`env.py` + `manifest.json` when one passed validation; see `trace_lib.synth.synthesize`), the list
`data/envs/manifests.jsonl` (valid or not, with the reason), `data/envs/llm_ledger.jsonl` (LLM
synthesizers), `data/envs/rollouts.jsonl` (rollouts spent on difficulty-band checks and calibration, part of
TRACE's budget) and `reports/metrics/synthesize.json`. With `synthesize.calibration` each valid environment is
fitted to the base model (`trace_lib.training.calibrate`): its manifest records the difficulty and start it
trains at and a transfer check on the target's failed train tasks behind it, or it is dropped with the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_lib.llm import analyst_client
from trace_lib.config import Params
from trace_lib.io import read_jsonl, write_json, write_jsonl
from trace_lib.paths import Paths
from trace_lib.envs import load_tasks
from trace_lib.records import Capability, SyntheticEnvManifest, Task, Trajectory
from trace_lib.sandbox import SandboxProcess
from trace_lib.synth.synthesize import evidence_template_kinds, resolve_synth_backend, synthesize_env, target_spec
from trace_lib.synth.templates import kind_outcomes, task_kinds, unsolved_kinds
from trace_lib.budget import RolloutLedger
from trace_lib.training.calibrate import calibrate, tasks_behind, transfer_check
from trace_lib.training.sources import sandbox_limits, synthetic_source, target_source


def run_synthesize(params: Params, root: Path = Path(".")) -> dict[str, Any]:
    """Every kept capability gets a validated environment or a recorded reason; writes the manifests and metrics."""
    paths = Paths(root)
    kept = read_jsonl(paths.kept, Capability)
    backend = resolve_synth_backend(params.synthesize, params.analyst)
    client = None if backend == "template" else analyst_client(
        params.analyst.model_copy(update={"backend": backend}), paths.synth_ledger, root, params.seed)
    rollouts = paths.rollouts(params.rollout.split)
    evidence = read_jsonl(rollouts, Trajectory) if rollouts.is_file() else []
    policy = ledger = None
    if params.synthesize.validation.band or params.synthesize.calibration.enabled:
        # Heavy (torch): imported only when validation or calibration rolls the policy out.
        from trace_lib.engine.policy import load_policy

        policy = load_policy(Path(params.model.out_dir), dtype=params.model.dtype, device=params.model.device,
                             tool_format=params.model.tool_format)
        ledger = RolloutLedger(paths.synth_rollouts)
    drawn = {cap.id: kinds_to_train(cap, params, root, evidence) for cap in kept} if backend == "template" else {}
    manifests = [synthesize_env(cap, backend, params.synthesize, params.env, params.rollout.split, root, client=client,
                                evidence=evidence, policy=policy, ledger=ledger,
                                kinds=drawn[cap.id]["drawn"] if drawn.get(cap.id) else None)
                 for cap in kept]
    if params.synthesize.calibration.enabled:
        caps = {c.id: c for c in kept}
        n = params.synthesize.calibration.transfer_tasks
        tasks = load_tasks(params.env, params.rollout.split, root) if n and evidence else []
        manifests = [calibrated(m, params, root, policy, ledger,
                                tasks_behind(evidence, caps[m.capability_id].evidence,
                                             of_kinds(tasks, drawn.get(m.capability_id), params), n),
                                drawn.get(m.capability_id)) if m.valid else m
                     for m in manifests]
    write_jsonl(paths.env_manifests, manifests)
    metrics = {
        "backend": backend,
        "kept": len(kept),
        "valid": sum(m.valid for m in manifests),
        "envs": {m.capability_id: {"valid": m.valid, "attempts": m.attempts,
                                   "failed": m.validation.get("failed"), "reason": m.reason,
                                   "calibration": {k: v for k, v in m.calibration.items() if k != "reason"}}
                 for m in manifests},
        "note": "no kept capabilities: nothing to synthesize" if not kept else "",
    }
    write_json(paths.metrics("synthesize"), metrics)
    return metrics


def kinds_to_train(cap: Capability, params: Params, root: Path, evidence: list[Trajectory]) -> dict[str, Any] | None:
    """With reference samples and calibration on, the task kinds a template environment draws: those the failed
    target tasks behind `cap` asked (`templates.template_kinds`), less the kinds the base model already solves on
    the target (`templates.unsolved_kinds`: solved in more than `calibration.success_hi` of its rollout episodes of
    that kind). Returns the kinds drawn and each kind's (solved, played) episodes; None where this does not apply
    (the template draws no kinds, or without references: the kind the base solves is what earns GRPO reward)."""
    cfg = params.synthesize
    if not (params.train.reference_samples and cfg.calibration.enabled and evidence):
        return None
    target = target_spec(params.env)
    tasks = {t.id: t.model_dump(mode="json") for t in load_tasks(params.env, params.rollout.split, root)}
    asked = evidence_template_kinds(cap, target, evidence, list(tasks.values()))
    if not asked:
        return None
    outcomes = kind_outcomes(target, tasks, [(e.task_id, e.success) for e in evidence])
    kinds = unsolved_kinds(asked, outcomes, cfg.calibration.success_hi)
    return {"drawn": kinds, "asked": asked, "base_solved": {k: f"{s}/{n}" for k, (s, n) in outcomes.items()}}


def of_kinds(tasks: list[Task], kinds: dict[str, Any] | None, params: Params) -> list[Task]:
    """The target `tasks` that ask one of the kinds the environment draws (`kinds_to_train`), so the transfer check
    plays the failures it trains for; all of `tasks` where the kinds are not chosen."""
    if not kinds:
        return tasks
    target = target_spec(params.env)
    return [t for t in tasks if set(task_kinds(target, t.model_dump(mode="json"))) & set(kinds["drawn"])]


def calibrated(manifest: SyntheticEnvManifest, params: Params, root: Path, policy: Any,
               ledger: RolloutLedger, behind: list[Task], kinds: dict[str, Any] | None = None) -> SyntheticEnvManifest:
    """`manifest` with its calibration (`training.calibrate`): the difficulty it trains at, or, where no setting is
    in band, not valid, its module removed and the reason recorded. Where a setting fits, the base model then plays
    `behind` (target tasks the capability's evidence failed) from its start, recorded as `calibration.transfer`.
    `kinds` (`kinds_to_train`) is recorded as `calibration.kinds`. Every episode played goes to `ledger`."""
    cfg = params.synthesize.calibration
    with SandboxProcess(root / manifest.path, sandbox_limits(params.synthesize.validation)) as box:
        knob = box.meta["DIFFICULTY"]
        result = calibrate(policy, lambda d: synthetic_source(box, manifest.capability_id, params.env,
                                                                 params.train.max_steps_per_episode, d),
                           cfg, params.train, params.synthesize.difficulty, params.seed, (knob["min"], knob["max"]))
    if kinds:
        result["kinds"] = kinds
    if result["ok"] and behind:
        target = target_source(params.env, params.rollout.split, root)
        result["transfer"] = transfer_check(policy, target, behind, result["start_late"] >= 1.0,
                                            cfg, params.train, params.seed)
    ledger.add("synthesize", result["rollouts"] + result.get("transfer", {}).get("rollouts", 0),
               key=manifest.capability_id)
    env_dir = Paths(root).env_dir(manifest.capability_id)
    if not result["ok"]:
        (env_dir / "env.py").unlink(missing_ok=True)
        (env_dir / "manifest.json").unlink(missing_ok=True)
        return manifest.model_copy(update={"valid": False, "reason": f"calibration: {result['reason']}",
                                           "calibration": result})
    out = manifest.model_copy(update={"calibration": result, "difficulty": {"value": result["difficulty"]}})
    write_json(env_dir / "manifest.json", out.model_dump(mode="json"))
    return out
