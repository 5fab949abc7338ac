"""Scaling stage: success against rollout budget, and the ablation table.

Reads (written by the train and evaluate stages):

    data/adapters/<cap>/snapshots/iter-<k>/     the adapter after iteration k (PEFT) + snapshot.json
                                                {iteration, rollouts}; the final adapter is the folder itself
    data/adapters/_baselines/grpo_target/...    the same for GRPO on the target (when trained)
    data/evaluate/routes/trace_argmax.jsonl     the router's decision per task
    data/evaluate/trajectories/<method>.jsonl   base, trace_argmax, ... episodes (reused, never re-decoded)
    reports/metrics/evaluate.json               budgets and which methods ran

Writes

    data/scaling/points.jsonl                   one row per (method, budget): success, CI, tool calls
    data/scaling/trajectories/<method>@<budget>.jsonl
    reports/tables/scaling.md, reports/tables/ablations.md
    reports/figures/scaling.png
    reports/metrics/scaling.json

Paper: the rollout-scaling figure (success vs rollouts for TRACE and GRPO on the target) and the
ablation table. Budgets are reused, not retrained: a point at budget B uses the newest snapshot of each
adapter whose rollouts fit in B (`train.snapshot_every`), and the router's decisions are the evaluate
stage's — the router is the base model, so its choice does not depend on the adapters' budget. Budget 0
is the base model and the last point is the evaluate stage's own TRACE row, so on the CPU default only
the intermediate snapshots decode new episodes (greedy, shared through `evaluate_policy`'s memo).

Ablations need other trainings (no contrastive filter, no synthesis, efficiency reward on/off): their
rows read another run of this pipeline named in `scaling.ablation_runs` (a `dvc exp` workspace or a
papermill sweep root) and otherwise say they were not run and how to run them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from trace_lib.config import ScalingConfig
from trace_lib.stats import rate_row
from trace_lib.io import atomic_write_text, read_json, read_jsonl, write_json, write_jsonl
from trace_lib.records import Trajectory
from trace_lib.training.trainer import SNAPSHOTS



@dataclass(frozen=True)
class Snapshot:
    adapter: str
    iteration: int
    rollouts: int
    path: Path


def find_snapshots(adapter_dir: Path) -> list[Snapshot]:
    """An adapter's snapshots, oldest first (folders with a PEFT config and snapshot.json)."""
    folder = Path(adapter_dir) / SNAPSHOTS
    out = []
    for sub in sorted(folder.glob("iter-*")) if folder.is_dir() else []:
        meta = sub / "snapshot.json"
        if meta.is_file() and (sub / "adapter_config.json").is_file():
            m = read_json(meta)
            out.append(Snapshot(adapter_dir.name, int(m["iteration"]), int(m["rollouts"]), sub))
    return sorted(out, key=lambda s: s.iteration)


def budget_points(snapshots: dict[str, list[Snapshot]], finals: dict[str, int], extra: int = 0,
                  budgets: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """TRACE's budget points: {total, iteration, adapters: {cap: Snapshot | 'final' | None}}.

    Point k uses every adapter's snapshot at iteration k (the last iteration: the final adapter).
    `extra` rollouts (the synthesize stage's band checks) count in every total but 0. With `budgets`,
    each requested total takes the largest point that fits in it (duplicates merged); without, every
    iteration is a point. Budget 0, the base model, is always the first point.
    """
    iterations = sorted({s.iteration for ss in snapshots.values() for s in ss})
    points = [{"total": 0, "iteration": 0, "adapters": {}}]
    for k in iterations:
        chosen = {cap: next((s for s in snapshots.get(cap, []) if s.iteration == k), None) for cap in finals}
        if all(chosen.values()):
            points.append({"total": extra + sum(s.rollouts for s in chosen.values()), "iteration": k,
                           "adapters": chosen})
    last = {"total": extra + sum(finals.values()), "iteration": None, "adapters": dict.fromkeys(finals, "final")}
    if finals and last["total"] > points[-1]["total"]:
        points.append(last)
    if budgets is None:
        return points
    picked: list[dict[str, Any]] = []
    for b in sorted(budgets):
        fits = [p for p in points if p["total"] <= b]
        if fits and fits[-1] not in picked:
            picked.append(fits[-1])
    return picked


def routed_adapters(decisions: Sequence[Any]) -> dict[str, list[str]]:
    """Task id -> the adapters a router decision sends it to ([] = the base model)."""
    return {d.task_id: [c for c, a in sorted(d.weights.items()) if a] for d in decisions}


def point_routing(choices: dict[str, list[str]], point: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Task id -> weights at a budget point: each chosen adapter renamed to that point's snapshot."""
    out = {}
    for task_id, chosen in choices.items():
        out[task_id] = {} if point["iteration"] == 0 else {snapshot_name(point, c): 1.0 for c in chosen}
    return out


def snapshot_name(point: dict[str, Any], cap: str) -> str:
    snap = point["adapters"][cap]
    return cap if snap == "final" else f"{cap}@iter-{snap.iteration}"


# --- tables ------------------------------------------------------------------------------------------
def point_row(method: str, point_total: int, iteration: int | None, trajs: Sequence[Trajectory] | None,
              reason: str = "", n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """One scaling point (or a not-run reason): success with bootstrap CI, mean tool calls per success."""
    row: dict[str, Any] = {"method": method, "budget": point_total, "iteration": iteration, "reason": reason}
    if trajs is not None:
        row.update(rate_row(trajs, n_boot, level, seed))
        wins = [t for t in trajs if t.success]
        row["tool_calls_per_success"] = sum(t.tool_calls for t in wins) / len(wins) if wins else None
    return row


def pct(row: dict[str, Any]) -> str:
    if "success_rate" not in row:
        return f"not run: {row.get('reason', '')}"
    return f"{100 * row['success_rate']:.1f} [{100 * row['ci_low']:.1f}, {100 * row['ci_high']:.1f}] ({row['n']})"


def scaling_table(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame([{"method": r["method"], "rollouts": r["budget"],
                          "iteration": "base" if r["iteration"] == 0 else ("final" if r["iteration"] is None
                                                                            else r["iteration"]),
                          "success % [95% CI] (n)": pct(r)} for r in rows])


ABLATIONS: tuple[tuple[str, str, str, str], ...] = (
    # (row key, ablation, variant, where it comes from: 'this:<method key>' or 'run:<ablation_runs key>')
    ("trace_argmax", "full method", "TRACE, argmax routing", "this:trace_argmax"),
    ("trace_top_p", "routing", "top-p routing", "this:trace_top_p"),
    ("oracle_route", "routing", "oracle routing (task tags)", "this:oracle_route"),
    ("linear_merge", "no routing", "linear merge of the adapters", "this:linear_merge"),
    ("base", "no training", "base model", "this:base"),
    ("no_filter", "no contrastive filter", "adapters for every discovered capability", "run:no_filter"),
    ("no_synthesis", "no synthesis", "adapters trained on the target's tasks of their capability", "run:no_synthesis"),
    ("efficiency_on", "efficiency reward", "on (train.reward.efficiency: true)", "run:efficiency_on"),
    ("efficiency_off", "efficiency reward", "off", "run:efficiency_off"),
)

HOW_TO = {
    "no_filter": "a run that keeps every candidate (`dvc exp run -S score.delta=-1 -S score.rho=0`), "
                 "named in scaling.ablation_runs.no_filter",
    "no_synthesis": "a run whose adapters train on the target's tasks of their capability, named in "
                    "scaling.ablation_runs.no_synthesis (train.py trains on synthetic environments, or on "
                    "every target task for the grpo_target baseline; the per-capability target split is "
                    "not implemented)",
    "efficiency_on": "a run with `-S train.reward.efficiency=true`, named in scaling.ablation_runs.efficiency_on",
    "efficiency_off": "a run with `-S train.reward.efficiency=false`, named in scaling.ablation_runs.efficiency_off",
}


def trajectories_of(root: Path, key: str) -> list[Trajectory] | None:
    path = Path(root) / "data" / "evaluate" / "trajectories" / f"{key}.jsonl"
    return read_jsonl(path, Trajectory) if path.is_file() else None


def ablation_rows(root: Path, cfg: ScalingConfig, evaluate_metrics: dict[str, Any], efficiency_on: bool,
                  n_boot: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """The ablation table's rows: this run's methods, and other runs' TRACE rows where named."""
    methods = evaluate_metrics.get("methods", {})
    own_eff = "efficiency_on" if efficiency_on else "efficiency_off"
    rows = []
    for key, ablation, variant, source in ABLATIONS:
        kind, name = source.split(":")
        reason, trajs, where = "", None, "this run"
        if key == own_eff:
            kind, name = "this", "trace_argmax"
        if kind == "this":
            trajs = trajectories_of(root, name)
            if trajs is None:
                reason = methods.get(name, {}).get("reason") or f"{name} not evaluated"
        elif name in cfg.ablation_runs:
            other = Path(cfg.ablation_runs[name])
            where = other.as_posix()
            trajs = trajectories_of(other if other.is_absolute() else root / other, "trace_argmax")
            reason = "" if trajs is not None else f"{where}: no data/evaluate/trajectories/trace_argmax.jsonl"
        else:
            reason = f"needs {HOW_TO[name]}"
        row = point_row(key, 0, None, trajs, reason, n_boot, seed=seed)
        row.update({"ablation": ablation, "variant": variant, "source": where if trajs is not None else ""})
        rows.append(row)
    return rows


def ablation_table(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame([{
        "ablation": r["ablation"], "variant": r["variant"], "success % [95% CI] (n)": pct(r),
        "tool calls / success": "" if r.get("tool_calls_per_success") is None else f"{r['tool_calls_per_success']:.2f}",
        "source": r["source"]} for r in rows])


# --- the stage ---------------------------------------------------------------------------------------
def scaling_paths(root: Path = Path(".")) -> dict[str, Path]:
    return {
        "points": root / "data" / "scaling" / "points.jsonl",
        "trajectories": root / "data" / "scaling" / "trajectories",
        "table": root / "reports" / "tables" / "scaling.md",
        "ablations": root / "reports" / "tables" / "ablations.md",
        "figure": root / "reports" / "figures" / "scaling.png",
        "metrics": root / "reports" / "metrics" / "scaling.json",
    }


def run_scaling(params: Any, root: Path = Path("."), progress: bool = True) -> dict[str, Any]:
    """The whole stage (see the module docstring); returns the metrics written to scaling.json."""
    from trace_lib.evaluation import inputs
    from trace_lib.evaluation.tables import markdown
    from trace_lib.plots import save_figure
    from trace_lib.plots.evaluate import scaling_curve
    from trace_lib.routing.route import RouteDecision

    t0 = time.perf_counter()
    cfg: ScalingConfig = params.scaling
    ecfg = params.evaluate
    paths = scaling_paths(root)
    metrics_path = root / "reports" / "metrics" / "evaluate.json"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} not found: run the evaluate stage first")
    evaluated = read_json(metrics_path)
    caps, baselines = inputs.find_adapters(root)
    names = sorted(caps)
    budget = inputs.trace_budget(root, names)
    snaps = {n: find_snapshots(caps[n]) for n in names}
    points = budget_points(snaps, budget["by_adapter"], budget["synthesize"], cfg.budgets)
    base = trajectories_of(root, "base")
    final = trajectories_of(root, "trace_argmax")
    routes = root / "data" / "evaluate" / "routes" / "trace_argmax.jsonl"
    decisions = read_jsonl(routes, RouteDecision) if routes.is_file() else None
    rows: list[dict[str, Any]] = []
    written: dict[str, list[Trajectory]] = {}
    todo = [p for p in points if p["iteration"] not in (0, None)]
    if base is None:
        reason = evaluated["methods"].get("base", {}).get("reason") or "the base model was not evaluated"
        rows += [point_row("TRACE", p["total"], p["iteration"], None, reason) for p in points]
    elif decisions is None or final is None:
        reason = "TRACE (argmax) was not evaluated: " + evaluated["methods"].get("trace_argmax", {}).get("reason", "")
        rows.append(point_row("TRACE", 0, 0, base, "", ecfg.n_boot, ecfg.ci_level, ecfg.seed))
        rows += [point_row("TRACE", p["total"], p["iteration"], None, reason) for p in points[1:]]
    else:
        by_point = {0: base, None: final}
        if todo:
            by_point.update(_decode_points(params, root, todo, routed_adapters(decisions), base, progress))
        for p in points:
            trajs = by_point[p["iteration"]]
            rows.append(point_row("TRACE", p["total"], p["iteration"], trajs, "", ecfg.n_boot, ecfg.ci_level,
                                  ecfg.seed))
            if p["iteration"] not in (0, None):
                written[f"trace@{p['total']}"] = trajs
    grpo = evaluated["methods"].get("grpo_target", {})
    grpo_final = trajectories_of(root, "grpo_target")
    if "grpo_target" in baselines and grpo_final is not None and base is not None:
        # GRPO on the target: one adapter on every task, at each of its snapshots too
        n, _ = inputs.adapter_budget(root, "grpo_target", baseline=True)
        g_points = budget_points({"grpo_target": find_snapshots(baselines["grpo_target"])}, {"grpo_target": n},
                                 0, cfg.budgets)
        g_todo = [p for p in g_points if p["iteration"] not in (0, None)]
        everyone = {t.task_id: ["grpo_target"] for t in base}
        by_point = {0: base, None: grpo_final}
        if g_todo:
            by_point.update(_decode_points(params, root, g_todo, everyone, base, progress))
        for p in g_points:
            rows.append(point_row("GRPO on target", p["total"], p["iteration"], by_point[p["iteration"]], "",
                                  ecfg.n_boot, ecfg.ci_level, ecfg.seed))
            if p["iteration"] not in (0, None):
                written[f"grpo_target@{p['total']}"] = by_point[p["iteration"]]
    else:
        rows.append(point_row("GRPO on target", budget["total"], None, None,
                              grpo.get("reason") or "not evaluated"))
    gepa = evaluated["methods"].get("gepa", {})
    gepa_trajs = trajectories_of(root, "gepa")
    if gepa.get("status") == "run" and gepa_trajs is not None:  # its final prompt, at the rollouts it spent
        rows.append(point_row("GEPA", int(gepa.get("rollouts") or 0), None, gepa_trajs, "", ecfg.n_boot,
                              ecfg.ci_level, ecfg.seed))
    else:
        rows.append(point_row("GEPA", budget["total"], None, None, gepa.get("reason") or "not evaluated"))

    ablations = ablation_rows(root, cfg, evaluated, params.train.reward.efficiency, ecfg.n_boot, ecfg.seed)
    for key, trajs in sorted(written.items()):
        write_jsonl(paths["trajectories"] / f"{key}.jsonl", trajs)
    write_jsonl(paths["points"], rows)
    atomic_write_text(paths["table"], markdown(scaling_table(rows)))
    atomic_write_text(paths["ablations"], markdown(ablation_table(ablations)))
    save_figure(scaling_curve(rows, f"{evaluated.get('split', '')} split of {', '.join(evaluated.get('envs', []))}"),
                paths["figure"])
    metrics = {"points": rows, "ablations": ablations, "trace_budget": budget,
               "decoded_points": len(todo) if base is not None and decisions is not None else 0,
               "seconds": round(time.perf_counter() - t0, 1)}
    write_json(paths["metrics"], metrics)
    return metrics


def _decode_points(params: Any, root: Path, todo: list[dict[str, Any]], choices: dict[str, list[str]],
                   base: Sequence[Trajectory], progress: bool) -> dict[int, list[Trajectory]]:
    """Episodes at each intermediate budget point, each task under its chosen adapters' snapshots
    (base episodes reused for tasks sent to no adapter)."""
    from trace_lib.evaluation.runner import _make_env, eval_rollout_config, eval_targets, evaluate_policy
    from trace_lib.agent.policy import load_policy

    ecfg = params.evaluate
    adapters = {snapshot_name(p, c): str(s.path) for p in todo for c, s in p["adapters"].items()}
    policy = load_policy(root / params.model.out_dir, dtype=params.model.dtype, threads=params.rollout.threads,
                         adapters=adapters)
    rcfg = eval_rollout_config(params.rollout, ecfg)
    targets = eval_targets(params.env, ecfg)
    memo: dict | None = None
    if rcfg.temperature == 0:  # tasks the router sends to 'none' run as the base model did
        memo = {}
        for env_cfg, tasks in targets:
            ids = {t.id for t in tasks}
            for t in base:
                if t.task_id in ids:
                    memo.setdefault((env_cfg.name, (), t.task_id), []).append(t)
    out = {}
    for p in todo:
        routing = point_routing(choices, p)
        trajs: list[Trajectory] = []
        for env_cfg, tasks in targets:
            trajs += evaluate_policy(policy, tasks, lambda e=env_cfg: _make_env(e), rcfg, ecfg.seed,
                                     {t.id: routing.get(t.id, {}) for t in tasks}, progress, memo, env_cfg.name)
        out[p["iteration"]] = trajs
    return out
