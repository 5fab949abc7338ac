"""Provenance of each kept capability: from the failed trajectories it came from to the test tasks it changed.

`read_run` reads a finished run's records (discovery, scores and labels, the synthesized environments, the
adapters and their training logs, the rollout ledgers, the evaluation episodes); `provenance` joins them, one
record per kept capability, and is pure. The report stage writes the records to reports/provenance.json and
renders them (`evaluation.pages`).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trace_lib.budget import total_rollouts
from trace_lib.io import iter_jsonl, read_jsonl
from trace_lib.records import (
    AdapterManifest,
    Capability,
    CapabilityScore,
    Label,
    SyntheticEnvManifest,
    Trajectory,
)
from trace_lib.paths import Paths
from trace_lib.sandbox import SandboxError, SandboxProcess
from trace_lib.stats import task_outcomes

TRACE_KEYS = ("trace_argmax", "trace_top_p")
"""Evaluation episode files of TRACE itself, the first one present is the one whose routes are read."""
QUOTE_CHARS = 400
"""Longest quote of an agent turn in a record; the pages show the whole episode."""
SAMPLE_SEED = 0
"""Seed of the sample task a capability's record shows from its environment (generated in the sandbox)."""


@dataclass(frozen=True)
class RunRecords:
    """What `provenance` joins, as read from one run's data/ folder."""

    kept: list[Capability] = field(default_factory=list)
    """The capabilities the score stage kept (data/score/kept.jsonl), with their evidence."""
    scores: list[CapabilityScore] = field(default_factory=list)
    labels: list[Label] = field(default_factory=list)
    train_episodes: list[Trajectory] = field(default_factory=list)
    envs: list[SyntheticEnvManifest] = field(default_factory=list)
    env_texts: dict[str, str] = field(default_factory=dict)
    """Capability -> the installed module's source ('' where none was installed)."""
    env_samples: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Capability -> one task its installed environment generates (`sample_task`)."""
    adapters: list[AdapterManifest] = field(default_factory=list)
    curves: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Adapter name -> its train_log.jsonl rows (one per iteration)."""
    synth_rollouts: dict[str, int] = field(default_factory=dict)
    train_rollouts: dict[str, int] = field(default_factory=dict)
    evaluation: dict[str, list[Trajectory]] = field(default_factory=dict)
    """Evaluation key (base, trace_argmax, single_<capability>, ...) -> its episodes."""


def rollouts_by_key(path: Path) -> dict[str, int]:
    """Key (capability or adapter) -> rollouts in one ledger (`budget.total_rollouts`), over its stages; {} where
    the ledger is missing."""
    out: dict[str, int] = {}
    for stage_key, n in total_rollouts([path], missing_ok=True)["by_key"].items():
        key = stage_key.partition("/")[2]
        out[key] = out.get(key, 0) + n
    return out


def sample_task(module: Path, difficulty: int) -> dict[str, Any]:
    """The task `module` generates at `SAMPLE_SEED` and `difficulty`, served from its sandbox: what the user says,
    what must be said and done; {"error": why} where the module cannot give one."""
    try:
        with SandboxProcess(module) as box:
            task = box.request("generate_task", seed=SAMPLE_SEED, difficulty=difficulty)
        user = task["user"]
        return {"seed": SAMPLE_SEED, "difficulty": difficulty, "opening": str(user["reason_for_call"]),
                "instruction": str(task["instruction"]), "required_outputs": [str(o) for o in task["required_outputs"]],
                "gold_actions": [{"name": str(a["name"]), "arguments": dict(a.get("arguments", {}))}
                                 for a in task["gold_actions"]]}
    except (SandboxError, OSError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    except (KeyError, TypeError, AttributeError) as err:
        return {"error": f"the module's task lacks a field of the contract ({type(err).__name__}: {err})"}


def read_run(root: Path | str) -> RunRecords:
    """The records of the run under `root`; a stage that has not run leaves its fields empty."""
    paths = Paths(root)

    def records(path: Path, model: Any) -> list[Any]:
        return read_jsonl(path, model) if path.is_file() else []

    envs = records(paths.env_manifests, SyntheticEnvManifest)
    env_texts, env_samples = {}, {}
    for m in envs:
        module = Path(root) / m.path
        installed = m.valid and module.is_file()
        env_texts[m.capability_id] = module.read_text(encoding="utf-8") if installed else ""
        if installed:
            env_samples[m.capability_id] = sample_task(module, int(m.difficulty.get("value") or 0))
    adapters = records(paths.adapter_manifests, AdapterManifest)
    curves = {}
    for a in adapters:
        log = Path(root) / a.path / "train_log.jsonl"
        curves[a.capability_id] = list(iter_jsonl(log)) if log.is_file() else []
    train_rollouts = {a.capability_id: total_rollouts([paths.train_ledger(a.capability_id)], missing_ok=True)["total"]
                      for a in adapters}
    evaluation = {p.stem: read_jsonl(p, Trajectory)
                  for p in sorted(paths.eval_trajectories.glob("*.jsonl"))} if paths.eval_trajectories.is_dir() else {}
    return RunRecords(kept=records(paths.kept, Capability), scores=records(paths.scores, CapabilityScore),
                      labels=records(paths.labels, Label), train_episodes=records(paths.rollouts("train"), Trajectory),
                      envs=envs, env_texts=env_texts, env_samples=env_samples, adapters=adapters, curves=curves,
                      synth_rollouts=rollouts_by_key(paths.synth_rollouts), train_rollouts=train_rollouts,
                      evaluation=evaluation)


def last_agent_turn(messages: Sequence[Any]) -> tuple[int | None, str]:
    """Index and text of the agent's last turn (what it said, or the calls it made): where an episode ended."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role != "assistant":
            continue
        if m.tool_calls:
            text = "; ".join(f"{c.name}({json.dumps(c.arguments, sort_keys=True)})" for c in m.tool_calls)
        else:
            text = m.content
        return i, " ".join(text.split())[:QUOTE_CHARS]
    return None, ""


def module_doc(source: str) -> str:
    """A synthesized module's docstring ('' where it has none or does not parse)."""
    try:
        return ast.get_docstring(ast.parse(source)) or ""
    except SyntaxError:
        return ""


def changed_tasks(base: Iterable[Trajectory], other: Iterable[Trajectory],
                  only: set[str] | None = None) -> dict[str, list[str]]:
    """Task ids that `other` solves and `base` fails (fixed) and the reverse (broken), over the tasks both played
    (restricted to `only` when given), sorted. A task with several samples counts as solved when most are."""
    b = {k: v > 0.5 for k, v in task_outcomes(list(base)).items()}
    o = {k: v > 0.5 for k, v in task_outcomes(list(other)).items()}
    shared = sorted(set(b) & set(o) & (only if only is not None else set(b)))
    return {"fixed": [t for t in shared if o[t] and not b[t]], "broken": [t for t in shared if b[t] and not o[t]]}


def _curve(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("iteration", "rollouts", "success_rate", "reward", "loss", "frac_reward_zero_std")
    return [{k: r.get(k) for k in keep} for r in rows]


def capability_provenance(cap: Capability, run: RunRecords) -> dict[str, Any]:
    """The chain of one capability (module docstring above), from the run's records."""
    episodes = {t.id: t for t in run.train_episodes}
    score = next((s for s in run.scores if s.capability_id == cap.id), None)
    lacking: dict[str, list[str]] = {}
    for lb in run.labels:
        if lb.capability_id == cap.id and lb.label == "LACKING":
            notes = lacking.setdefault(lb.trajectory_id, [])
            if lb.rationale not in notes:
                notes.append(lb.rationale)
    evidence = []
    for tid in cap.evidence:
        t = episodes.get(tid)
        turn, quote = last_agent_turn(t.messages) if t is not None else (None, "")
        evidence.append({"trajectory_id": tid, "task_id": t.task_id if t else None, "family": t.family if t else None,
                         "success": t.success if t else None, "last_agent_turn": turn, "quote": quote,
                         "rationale": lacking.get(tid, [])})
    env = next((m for m in run.envs if m.capability_id == cap.id), None)
    source = run.env_texts.get(cap.id, "")
    adapter = next((a for a in run.adapters if a.capability_id == cap.id), None)
    trace_key = next((k for k in TRACE_KEYS if k in run.evaluation), None)
    routed = sorted({t.task_id for t in run.evaluation.get(trace_key, []) if t.adapter == cap.id}) if trace_key else []
    base = run.evaluation.get("base", [])
    single = run.evaluation.get(f"single_{cap.id}")
    return {
        "capability": {"id": cap.id, "name": cap.name, "description": cap.description,
                       "recognition": cap.recognition, "source": cap.source},
        "evidence": evidence,
        "score": None if score is None else {
            "delta": score.delta, "delta_ci": list(score.delta_ci) if score.delta_ci else None,
            "coverage": score.coverage, "n_pos": score.n_pos, "n_neg": score.n_neg, "e_pos": score.e_pos,
            "e_neg": score.e_neg, "kept_runs": score.kept_runs, "n_runs": score.n_runs, "reason": score.reason},
        "environment": None if env is None else {
            "installed": env.valid, "path": env.path if env.valid else None, "sha256": env.sha256 or None,
            "source": env.source, "reason": env.reason, "difficulty": env.difficulty.get("value"),
            "calibration": env.calibration, "description": module_doc(source),
            "sample_task": run.env_samples.get(cap.id),
            "rollouts": run.synth_rollouts.get(cap.id, 0)},
        "adapter": None if adapter is None else {
            "path": adapter.path, "rollouts_used": adapter.rollouts_used, "iterations": adapter.iterations,
            "final_reward": adapter.final_reward,
            "env_sha256": adapter.env_sha256 or None,
            "env_matches": bool(env is not None and env.sha256 and adapter.env_sha256 == env.sha256),
            "snapshot": "the last iteration (no snapshot is chosen)", "curve": _curve(run.curves.get(cap.id, [])),
            "rollouts": run.train_rollouts.get(cap.id, 0)},
        "evaluation": {
            "trace_key": trace_key, "routed": routed,
            "trace": changed_tasks(base, run.evaluation.get(trace_key, []), set(routed)) if trace_key and base
            else {"fixed": [], "broken": []},
            "alone": changed_tasks(base, single) if single is not None and base else None},
        "rollouts": {"calibration": run.synth_rollouts.get(cap.id, 0), "training": run.train_rollouts.get(cap.id, 0)},
    }


def provenance(run: RunRecords) -> list[dict[str, Any]]:
    """One record per kept capability, in the order they were kept."""
    return [capability_provenance(c, run) for c in run.kept]
