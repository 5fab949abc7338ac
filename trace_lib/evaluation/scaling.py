"""Budget points and the ablation table of the scaling stage (paper: the rollout-scaling figure, ablations).

Reads the snapshots an adapter's training kept (`<adapter>/snapshots/iter-<k>/`: PEFT folder +
snapshot.json {iteration, rollouts}, written by `trace_lib.training.trainer.keep_snapshot`) and, for the
ablation rows, the evaluate stage's episodes (`Paths.eval_episodes`) of this run or of another run named
in `scaling.ablation_runs`; writes nothing (the stage is `stages/scaling.py`).

Budgets are reused, not retrained: the points walk the adapters' snapshots (`train.snapshots`, one per
checkpoint, `train.save_every`) one adapter at a time, round by round (`budget_points`), a point at budget B
being the newest of them that fits in B, and the router's decisions
are the evaluate stage's — the router is the base model, so its choice does not depend on the adapters'
budget (`point_routing` renames each chosen adapter to that point's snapshot). Budget 0 is the base model
and the last point is the final adapters.

Ablations need other trainings (no contrastive filter, no synthesis, efficiency reward on/off): their
rows read another run of this pipeline named in `scaling.ablation_runs` (a `dvc exp` workspace or a
papermill sweep root) and otherwise say they were not run and how to run them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from trace_lib.config import ScalingConfig
from trace_lib.evaluation.tables import success_interval
from trace_lib.io import read_json, read_jsonl
from trace_lib.paths import Paths
from trace_lib.records import Trajectory
from trace_lib.stats import rate_row
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

    The adapters advance in turn, one snapshot of one adapter at a time (adapters in name order): after
    round k every adapter is at its k-th snapshot, and within a round the adapters before the one just
    advanced are a snapshot ahead of those after it. An adapter not yet advanced is None: its tasks run
    on the base model, as a task routed to "none" does. Every adapter's last step is its final adapter
    (a snapshot with the final's rollouts is the final). `iteration` is 0 for the base model, None for
    the final adapters, k where every adapter is at its iteration-k snapshot, and otherwise each
    adapter's iteration named (`staggered_label`). `extra` rollouts (discovery on the target, the
    synthesize stage's band checks) count in every total but 0. With `budgets`, each requested total
    takes the largest point that fits in it (duplicates merged); without, every step is a point.
    Budget 0, the base model, is always the first point and the final adapters (the evaluate stage's
    row) always the last, whatever `budgets` asks for.
    """
    steps: dict[str, list[Snapshot | str]] = {
        cap: [*(s for s in snapshots.get(cap, []) if s.rollouts < finals[cap]), "final"] for cap in sorted(finals)}
    points = [{"total": 0, "iteration": 0, "adapters": {}}]
    state: dict[str, Snapshot | str | None] = dict.fromkeys(sorted(finals))
    for k in range(max(map(len, steps.values()), default=0)):
        for cap, ladder in steps.items():
            if k >= len(ladder):
                continue
            state[cap] = ladder[k]
            total = extra + sum(_rollouts(s, finals[c]) for c, s in state.items())
            point = {"total": total, "iteration": _iteration(state), "adapters": dict(state)}
            if total > points[-1]["total"]:
                points.append(point)
            elif len(points) > 1:  # a step that spent nothing: the newer state stands for the point
                points[-1] = point
    if budgets is None:
        return points
    picked: list[dict[str, Any]] = [points[0]]
    for b in sorted(budgets):
        fits = [p for p in points if p["total"] <= b]
        if fits and fits[-1] not in picked:
            picked.append(fits[-1])
    if points[-1] not in picked:
        picked.append(points[-1])
    return picked


def _rollouts(step: Snapshot | str | None, final: int) -> int:
    return 0 if step is None else final if step == "final" else step.rollouts


def _iteration(state: dict[str, Snapshot | str | None]) -> int | str | None:
    """A point's `iteration`: see `budget_points`."""
    its = {cap: "final" if s == "final" else 0 if s is None else s.iteration for cap, s in state.items()}
    if len(set(its.values())) == 1:
        only = next(iter(its.values()))
        return None if only == "final" else only
    return staggered_label(its)


def staggered_label(iterations: dict[str, int | str]) -> str:
    """Each adapter's iteration at a point where they differ, e.g. 'a final, b 1' (0: not yet trained)."""
    return ", ".join(f"{cap} {it}" for cap, it in sorted(iterations.items()))


def routed_adapters(decisions: Sequence[Any]) -> dict[str, list[str]]:
    """Task id -> the adapters a router decision sends it to ([] = the base model)."""
    return {d.task_id: [c for c, a in sorted(d.weights.items()) if a] for d in decisions}


def point_routing(choices: dict[str, list[str]], point: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Task id -> weights at a budget point: each chosen adapter renamed to that point's snapshot."""
    return {task_id: {snapshot_name(point, c): 1.0 for c in chosen if point["adapters"].get(c) is not None}
            for task_id, chosen in choices.items()}


def snapshot_name(point: dict[str, Any], cap: str) -> str:
    snap = point["adapters"][cap]
    return cap if snap == "final" else f"{cap}@iter-{snap.iteration}"


# --- tables ------------------------------------------------------------------------------------------
def point_row(method: str, point_total: int, iteration: int | str | None, trajs: Sequence[Trajectory] | None,
              reason: str = "", n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """One scaling point (or a not-run reason): success with its intervals, mean tool calls per success.
    `iteration` as `budget_points` gives it: 0 (base), k, None (final) or a staggered point's label."""
    row: dict[str, Any] = {"method": method, "budget": point_total, "iteration": iteration, "reason": reason}
    if trajs is not None:
        row.update(rate_row(trajs, n_boot, level, seed))
        wins = [t for t in trajs if t.success]
        row["tool_calls_per_success"] = sum(t.tool_calls for t in wins) / len(wins) if wins else None
    return row


def pct(row: dict[str, Any]) -> str:
    if "success_rate" not in row:
        return f"not run: {row.get('reason', '')}"
    lo, hi = success_interval(row)
    return f"{100 * row['success_rate']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] ({row['n']})"


def scaling_table(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame([{"method": r["method"], "rollouts": r["budget"],
                          "iteration": "base" if r["iteration"] == 0 else ("final" if r["iteration"] is None
                                                                            else r["iteration"]),
                          "success % [95% Wilson] (n)": pct(r)} for r in rows])


ABLATIONS: tuple[tuple[str, str, str, str], ...] = (
    # (row key, ablation, variant, where it comes from: 'this:<method key>' or 'run:<ablation_runs key>')
    ("trace_argmax", "full method", "TRACE, argmax routing", "this:trace_argmax"),
    ("trace_top_p", "routing", "top-p routing", "this:trace_top_p"),
    ("oracle_route", "routing", "oracle routing", "this:oracle_route"),  # the evaluate stage's label, when it ran
    ("linear_merge", "no routing", "linear merge of the adapters", "this:linear_merge"),
    ("distilled", "no routing", "one adapter distilled from the capability adapters", "this:distilled"),
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
    """A run's evaluation episodes of one method (or None when that method did not run there)."""
    path = Paths(root).eval_episodes(key)
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
        if key == "oracle_route":  # which oracle: the lacking capability or the task tags (evaluate.oracle)
            variant = methods.get(name, {}).get("label", variant)
        row.update({"ablation": ablation, "variant": variant, "source": where if trajs is not None else ""})
        rows.append(row)
    return rows


def ablation_table(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame([{
        "ablation": r["ablation"], "variant": r["variant"], "success % [95% Wilson] (n)": pct(r),
        "tool calls / success": "" if r.get("tool_calls_per_success") is None else f"{r['tool_calls_per_success']:.2f}",
        "source": r["source"]} for r in rows])
