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
ablation table. Budget points come from the adapters' snapshots (`trace_lib.evaluation.scaling`), the curves and
their episodes from `trace_lib.evaluation.scaling_curves`; a point routes each task as the evaluate stage's router
did. Budget 0 is the base model and the last
point is the evaluate stage's own TRACE row, so on the CPU default only the intermediate snapshots
decode new episodes (greedy, shared through `evaluate_policy`'s memo; with `evaluate.decode_together`
every point's in one batch whose rows run under different snapshots, `runner.decode_into_memo`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trace_lib.engine.backends import open_policy
from trace_lib.config import Params, ScalingConfig
from trace_lib.budget import adapter_budget, find_adapters, trace_budget
from trace_lib.evaluation.runner import eval_rollout_config, eval_targets
from trace_lib.evaluation.scaling import (
    ablation_rows,
    ablation_table,
    budget_points,
    find_snapshots,
    scaling_table,
    trajectories_of,
)
from trace_lib.evaluation.scaling_curves import PointDecoder, gepa_point, grpo_curve, trace_curve
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
from trace_lib.records import RouteDecision


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
    names = sorted(caps)
    budget = trace_budget(root, names, params.rollout.split)
    snaps = {n: find_snapshots(caps[n]) for n in names}
    points = budget_points(snaps, budget["by_adapter"], budget["synthesize"] + budget["discovery"], cfg.budgets)
    base = trajectories_of(root, "base")
    routes = paths.route_decisions("trace_argmax")
    decode = PointDecoder(
        lambda adapters: open_policy(params.model, params.policy, Path(params.model.out_dir), adapters,
                                     threads=params.rollout.threads),
        {**caps, **baselines}, eval_rollout_config(params.rollout, ecfg), lambda: eval_targets(params.env, ecfg, root),
        ecfg, progress)
    rows, written = trace_curve(points, base, trajectories_of(root, "trace_argmax"),
                                read_jsonl(routes, RouteDecision) if routes.is_file() else None, evaluated, ecfg,
                                decode)
    grpo_final = trajectories_of(root, "grpo_target")
    g_points = None
    if "grpo_target" in baselines and grpo_final is not None and base is not None:
        n, _ = adapter_budget(root, "grpo_target", baseline=True)
        g_points = budget_points({"grpo_target": find_snapshots(baselines["grpo_target"])}, {"grpo_target": n}, 0,
                                 cfg.budgets)
    g_rows, g_written = grpo_curve(g_points, base, grpo_final, evaluated, budget["total"], ecfg, decode)
    rows += g_rows + [gepa_point(trajectories_of(root, "gepa"), evaluated, budget["total"], ecfg)]
    written.update(g_written)
    ablations = ablation_rows(root, cfg, evaluated, params.train.reward.efficiency, ecfg.n_boot, ecfg.seed)
    for key, trajs in sorted(written.items()):
        write_jsonl(paths.scaling_episodes(key), trajs)
    write_jsonl(paths.scaling_points, rows)
    atomic_write_text(paths.table("scaling"), markdown(scaling_table(rows)))
    atomic_write_text(paths.table("ablations"), markdown(ablation_table(ablations)))
    save_figure(scaling_curve(rows, f"{evaluated.get('split', '')} split of {', '.join(evaluated.get('envs', []))}"),
                paths.figure("scaling"))
    metrics = {"points": rows, "ablations": ablations, "trace_budget": budget,
               "decoded_points": len(decode.decoded),
               "snapshots_same_as_base": decode.same_as_base,
               "seconds": round(time.perf_counter() - t0, 1)}
    write_json(paths.metrics("scaling"), metrics)
    return metrics
