"""Stage `scaling`: success against rollout budget, and the ablation table.

Reads (written by the train and evaluate stages):

    data/adapters/<cap>/snapshots/iter-<k>/     the adapter after iteration k (PEFT) + snapshot.json
                                                {iteration, rollouts}; the final adapter is the folder itself
    data/adapters/_baselines/grpo_target/...    the same for GRPO on the target (when trained)
    data/train/.../rollouts.jsonl, data/envs/rollouts.jsonl
                                                the rollout ledgers behind TRACE's budget
    data/evaluate/routes/trace_argmax.jsonl     the router's decision per task
    data/evaluate/trajectories/<method>.jsonl   base, trace_argmax, ... episodes (reused, never re-decoded)
    reports/metrics/evaluate.json               budgets and which methods ran

Writes

    data/scaling/points.jsonl                   one row per (method, budget): success, CI, tool calls
    data/scaling/trajectories/<method>@<budget>.jsonl
    reports/tables/scaling.md, reports/tables/ablations.md
    reports/figures/scaling.png
    reports/metrics/scaling.json

Paper: the rollout-scaling figure (success vs rollouts for TRACE, GRPO on the target and GEPA) and the
ablation table. Budget points come from the adapters' snapshots (`trace_lib.evaluation.scaling`); a
point routes each task as the evaluate stage's router did. Budget 0 is the base model and the last
point is the evaluate stage's own TRACE row, so on the CPU default only the intermediate snapshots
decode new episodes (greedy, shared through `evaluate_policy`'s memo; with `evaluate.decode_together`
every point's in one batch whose rows run under different snapshots, `runner.decode_into_memo`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trace_lib.engine.adapters import adapter_is_identity
from trace_lib.engine.backends import open_policy
from trace_lib.config import Params, ScalingConfig
from trace_lib.envs import make_env
from trace_lib.budget import adapter_budget, find_adapters, trace_budget
from trace_lib.evaluation.runner import (
    decode_into_memo,
    eval_rollout_config,
    eval_targets,
    evaluate_policy,
    memo_key,
)
from trace_lib.evaluation.scaling import (
    ablation_rows,
    ablation_table,
    budget_points,
    find_snapshots,
    point_routing,
    point_row,
    routed_adapters,
    scaling_table,
    snapshot_name,
    trajectories_of,
)
from trace_lib.evaluation.tables import markdown
from trace_lib.io import (
    atomic_write_text,
    read_json,
    read_jsonl,
    write_json,
    write_jsonl,
)
from trace_lib.paths import Paths
from trace_lib.plots import save_figure
from trace_lib.plots.evaluate import scaling_curve
from trace_lib.records import RouteDecision, Trajectory


def run_scaling(params: Params, root: Path = Path("."), *, progress: bool = True) -> dict[str, Any]:
    """The whole stage (see the module docstring); returns the metrics written to scaling.json."""
    t0 = time.perf_counter()
    cfg: ScalingConfig = params.scaling
    ecfg = params.evaluate
    paths = Paths(root)
    metrics_path = paths.metrics("evaluate")
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} not found: run the evaluate stage first")
    evaluated = read_json(metrics_path)
    caps, baselines = find_adapters(root)
    folders = {**caps, **baselines}
    names = sorted(caps)
    budget = trace_budget(root, names, params.rollout.split)
    snaps = {n: find_snapshots(caps[n]) for n in names}
    points = budget_points(snaps, budget["by_adapter"], budget["synthesize"] + budget["discovery"], cfg.budgets)
    base = trajectories_of(root, "base")
    final = trajectories_of(root, "trace_argmax")
    routes = paths.route_decisions("trace_argmax")
    decisions = read_jsonl(routes, RouteDecision) if routes.is_file() else None
    rows: list[dict[str, Any]] = []
    written: dict[str, list[Trajectory]] = {}
    # snapshots still equal to the base model (at temperature 0 their tasks reuse its episodes), and how many
    # intermediate points of either curve had episodes to decode
    same_as_base: list[str] = []
    decoded: list[int | str] = []
    todo = [p for p in points if p["iteration"] not in (0, None)]
    if base is None:
        reason = evaluated["methods"].get("base", {}).get("reason") or "the base model was not evaluated"
        rows += [point_row("TRACE", p["total"], p["iteration"], None, reason) for p in points]
    elif decisions is None or final is None:
        reason = "TRACE (argmax) was not evaluated: " + evaluated["methods"].get("trace_argmax", {}).get("reason", "")
        rows.append(point_row("TRACE", 0, 0, base, "", ecfg.n_boot, ecfg.ci_level, ecfg.seed))
        rows += [point_row("TRACE", p["total"], p["iteration"], None, reason) for p in points[1:]]
    else:
        choices = routed_adapters(decisions)
        by_point = {points[-1]["total"]: final, 0: base}
        if todo:  # a task on a final adapter at a staggered point runs as in the evaluate stage's TRACE row
            by_point.update(_decode_points(params, root, folders, todo, choices, [(base, {}), (final, points[-1])],
                                           progress, same_as_base, decoded))
        for p in points:
            trajs = by_point[p["total"]]
            rows.append(point_row("TRACE", p["total"], p["iteration"], trajs, "", ecfg.n_boot, ecfg.ci_level,
                                  ecfg.seed))
            if p["iteration"] not in (0, None):
                written[f"trace@{p['total']}"] = trajs
    grpo = evaluated["methods"].get("grpo_target", {})
    grpo_final = trajectories_of(root, "grpo_target")
    if "grpo_target" in baselines and grpo_final is not None and base is not None:
        # GRPO on the target: one adapter on every task, at each of its snapshots too
        n, _ = adapter_budget(root, "grpo_target", baseline=True)
        g_points = budget_points({"grpo_target": find_snapshots(baselines["grpo_target"])}, {"grpo_target": n},
                                 0, cfg.budgets)
        g_todo = [p for p in g_points if p["iteration"] not in (0, None)]
        everyone = {t.task_id: ["grpo_target"] for t in base}
        by_point = {g_points[-1]["total"]: grpo_final, 0: base}
        if g_todo:
            by_point.update(_decode_points(params, root, folders, g_todo, everyone, [(base, {})], progress,
                                           same_as_base, decoded))
        for p in g_points:
            rows.append(point_row("GRPO on target", p["total"], p["iteration"], by_point[p["total"]], "",
                                  ecfg.n_boot, ecfg.ci_level, ecfg.seed))
            if p["iteration"] not in (0, None):
                written[f"grpo_target@{p['total']}"] = by_point[p["total"]]
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
        write_jsonl(paths.scaling_episodes(key), trajs)
    write_jsonl(paths.scaling_points, rows)
    atomic_write_text(paths.table("scaling"), markdown(scaling_table(rows)))
    atomic_write_text(paths.table("ablations"), markdown(ablation_table(ablations)))
    save_figure(scaling_curve(rows, f"{evaluated.get('split', '')} split of {', '.join(evaluated.get('envs', []))}"),
                paths.figure("scaling"))
    metrics = {"points": rows, "ablations": ablations, "trace_budget": budget,
               "decoded_points": len(decoded),
               "snapshots_same_as_base": same_as_base,
               "seconds": round(time.perf_counter() - t0, 1)}
    write_json(paths.metrics("scaling"), metrics)
    return metrics


def _decode_points(params: Params, root: Path, folders: dict[str, Path], todo: list[dict[str, Any]],
                   choices: dict[str, list[str]], known: Sequence[tuple[Sequence[Trajectory], dict[str, Any]]],
                   progress: bool, same_as_base: list[str], decoded: list[int | str]) -> dict[int, list[Trajectory]]:
    """Episodes at each intermediate budget point (keyed by its total), each task under its chosen
    adapters' snapshots (`folders`: adapter name -> its final adapter's folder).

    A snapshot that is the base model (`adapter_is_identity`) is left out of a task's weights (its
    delta is zero) and never loaded; its name is appended to `same_as_base`. A final adapter is kept
    in the weights whatever its delta, as the evaluate stage keeps it. `known`: episodes already
    played, each with the point they were played at (`{}`: the base model). At temperature 0 a task
    under the weights of such a point reuses its episode (a task left with no adapter the base model's,
    a task on a final adapter the evaluate stage's), and only the adapters of the other tasks are
    loaded. The iteration of each point with a task still to decode is appended to `decoded`."""
    ecfg = params.evaluate
    staged = {snapshot_name(p, c): s.path for p in todo for c, s in p["adapters"].items() if s not in (None, "final")}
    snapshots = {**staged, **{snapshot_name(p, c): folders[c] for p in todo for c, s in p["adapters"].items()
                              if s == "final"}}
    identity = {name for name, path in staged.items() if adapter_is_identity(path)}  # each snapshot read once
    same_as_base += sorted(identity)
    rcfg = eval_rollout_config(params.rollout, ecfg)
    targets = eval_targets(params.env, ecfg, root)
    memo: dict | None = None
    if rcfg.temperature == 0:
        memo = {}
        for trajs, point in known:  # the first source that played a task under some weights is its memo entry
            played = point_routing(choices, point) if point else {}
            these: dict[tuple, list[Trajectory]] = {}
            for env_cfg, tasks in targets:
                ids = {t.id for t in tasks}
                for t in trajs:
                    if t.task_id in ids:
                        these.setdefault(memo_key(env_cfg.name, played.get(t.task_id, {}), t.task_id), []).append(t)
            for key, episodes in these.items():
                memo.setdefault(key, episodes)
    routings = {p["total"]: {task: {a: x for a, x in w.items() if a not in identity}
                             for task, w in point_routing(choices, p).items()} for p in todo}

    def task_routing(p: dict, tasks) -> dict[str, dict[str, float]]:
        """Point `p`'s weights for each of `tasks` ({} for a task its routing leaves on the base model)."""
        return {t.id: routings[p["total"]].get(t.id, {}) for t in tasks}

    needed: set[str] = set()
    seen = set(memo or ())
    before = len(decoded)
    for p in todo:
        new = False
        for env_cfg, tasks in targets:
            for task_id, w in task_routing(p, tasks).items():
                key = memo_key(env_cfg.name, w, task_id)
                if memo is None or key not in seen:  # an episode still to decode
                    needed |= set(w)
                    seen.add(key)
                    new = True
        if new:
            decoded.append(p["iteration"])
    # every episode reused: the model is not even loaded
    policy = None if len(decoded) == before else open_policy(
        params.model, params.policy, Path(params.model.out_dir), {n: str(snapshots[n]) for n in sorted(needed)},
        threads=params.rollout.threads)
    if memo is not None and policy is not None and ecfg.decode_together:  # every point's new episodes in one batch
        for env_cfg, tasks in targets:
            decode_into_memo(policy, tasks, lambda e=env_cfg: make_env(e), rcfg, ecfg.seed,
                             [task_routing(p, tasks) for p in todo], memo, env_cfg.name, progress)
    out = {}
    for p in todo:
        trajs: list[Trajectory] = []
        for env_cfg, tasks in targets:
            trajs += evaluate_policy(policy, tasks, lambda e=env_cfg: make_env(e), rcfg, ecfg.seed,
                                     task_routing(p, tasks), progress, memo, env_cfg.name)
        out[p["total"]] = trajs
    return out
