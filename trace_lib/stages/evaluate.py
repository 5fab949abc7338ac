"""Stage `evaluate`: the router + capability adapters on held-out target tasks, against baselines.

Reads params.yaml (sections `model`, `policy`, `env`, `rollout`, `analyst`, `synthesize`, `train`,
`evaluate`), the prepared model (or the server `policy` names: adapters loaded into it by name, routes
scored from its log-probabilities, merges served as concatenated adapters) and what
`trace_lib.evaluation.inputs` lists (adapters, ledgers, synthetic envs, kept capabilities); writes

    data/evaluate/trajectories/<method>.jsonl   every evaluation episode (Trajectory, no timings)
    data/evaluate/routes/<method>.jsonl         the router's decision per task (RouteDecision)
    data/evaluate/results.jsonl                 one EvalResult per method that ran
    data/evaluate/gepa_*                        the GEPA row's prompt and ledgers (`trace_lib.evaluation.gepa`)
    data/evaluate/oracle_labels.jsonl           the analyst's labels of the base model's episodes (the labels
                                                oracle; `oracle_llm.jsonl`: an LLM analyst's ledger)
    data/evaluate/validation_labels.jsonl       the same on the validation split (`env.validation_fraction`),
                                                where `evaluate.router: auto` chooses the router
    reports/tables/{table1,routing,interference,capabilities}.md, table1.csv
    reports/metrics/evaluate.json               rates, CIs, paired tests vs base, budgets, routing quality
    reports/figures/evaluate_*.png              success per method, interference heatmap, routing confusion

Paper §4 (Table 1, the routing-vs-merging comparison, the interference analysis); the methods are listed in
`trace_lib.evaluation.methods`.

Running a method is `trace_lib.evaluation.runner`; the tables are `trace_lib.evaluation.tables`. Greedy
episodes are shared between methods that send a task to the same weights; with `evaluate.decode_together`
(on in the cpu profile) every method's are decoded in one batch whose rows run under different weights
(`runner.decode_into_memo`, `engine.row_lora`) before the rows are assembled (GEPA's, under another system
prompt, apart); the interference matrix then decodes each synthetic environment's episodes of the base model
and of every adapter in one such batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from trace_lib.engine.backends import open_policy
from trace_lib.engine.model import numerics
from trace_lib.config import EvaluateConfig, Params
from trace_lib.envs import graded_reward, make_env
from trace_lib.budget import find_adapters, trace_budget
from trace_lib.evaluation import inputs
from trace_lib.evaluation.router_side import LabelsOracle, interference_envs, open_sandboxes
from trace_lib.evaluation.methods import Evaluation, MethodSpecs, route_tasks, router_quality, run_specs
from trace_lib.evaluation.gepa import gepa_status, run_gepa
from trace_lib.evaluation.runner import eval_rollout_config, eval_targets, interference_matrix
from trace_lib.evaluation.outputs import evaluate_metrics, evaluate_tables
from trace_lib.evaluation.outputs import evaluate_metrics
from trace_lib.evaluation.tables import MethodRun, eval_results, summarize_runs
from trace_lib.io import atomic_write_text, write_json, write_jsonl
from trace_lib.paths import Paths
from trace_lib.plots import save_figure
from trace_lib.plots.evaluate import evaluate_figures
from trace_lib.records import Task
from trace_lib.sandbox import limits_from_config


def run_evaluate(params: Params, root: Path = Path("."), *, progress: bool = True) -> dict[str, Any]:
    """The whole stage (see the module docstring); returns the metrics written to evaluate.json."""
    cfg: EvaluateConfig = params.evaluate
    t0 = time.perf_counter()
    paths = Paths(root)
    paths.oracle_labels.unlink(missing_ok=True)  # a previous run's, which this one may not replace
    paths.validation_labels.unlink(missing_ok=True)
    caps, baselines = find_adapters(root)
    names = sorted(caps)
    policy = open_policy(params.model, params.policy, Path(params.model.out_dir), {**caps, **baselines},
                         threads=params.rollout.threads)
    for folder in [*caps.values(), *baselines.values()]:
        inputs.check_base_model(folder, policy.base_id)
    ev = Evaluation(policy, root, names, cfg, params.env, eval_rollout_config(params.rollout, cfg),
                    eval_targets(params.env, cfg, root), trace_budget(root, names, params.rollout.split),
                    LabelsOracle(params.analyst, params.score, params.seed, root, names), progress)
    no_caps = inputs.why_no_adapters(root) if not names else None
    specs = MethodSpecs(cfg.methods, params.profile)
    specs.add("base", "base", "base", routing_for=lambda e, ts: None, budget_n=0, source="no training")
    specs.add_baselines(baselines, root)
    gepa_record = _add_gepa(specs, ev, params)
    specs.add_merges_and_singles(names, no_caps, ev.budget)
    specs.add_oracle(cfg.oracle, names, no_caps, ev.tasks, ev.budget["total"], ev.labelled_oracle)
    specs.add_distilled(baselines, no_caps, ev.budget["total"], root)
    routers: dict[str, dict[str, Any]] = {}
    quality: dict[str, Any] = {}
    chosen: str | None = None  # the router behind the TRACE rows
    interference: list[dict[str, Any]] = []
    envs = inputs.synthetic_manifests(root)
    with ExitStack() as stack:
        boxes = open_sandboxes(stack, root, limits_from_config(params.synthesize.validation),
                               [n for n in names if n in envs], envs)
        routed = route_tasks(ev, boxes, routers, params.rollout, params.rollout.split, params.train.seed_offset,
                             params.synthesize.difficulty) if "trace" in specs.wanted and not no_caps else None
        chosen = routed[0] if routed else None
        specs.add_trace(cfg.route_mode, no_caps, ev.decisions, ev.budget["total"])
        decoded_together = run_specs(ev, specs)
        if routed:
            quality = router_quality(ev, routed, routers)
        if cfg.interference_seeds and boxes:
            envs_of = interference_envs(boxes, params.env, cfg.interference_seeds, params.synthesize.difficulty)
            interference = interference_matrix(policy, names, envs_of, ev.rcfg, cfg.seed, progress,
                                               together=cfg.decode_together)
    return _write_reports(ev.runs, ev.targets, ev.decisions, quality, interference, ev.budget, cfg, paths,
                          extra={"routers": routers, "router": chosen, "analysis_rollouts": ev.budget["discovery"],
                                 "policy_id": policy.policy_id, "adapters": names, "baselines": sorted(baselines),
                                 "numerics": numerics(policy.device),
                                 **({"gepa": gepa_record} if gepa_record else {}),
                                 "episodes_decoded": None if ev.memo is None else sum(map(len, ev.memo.values())),
                                 "episodes_decoded_together": decoded_together,
                                 "seconds": round(time.perf_counter() - t0, 1)})


def _add_gepa(specs: MethodSpecs, ev: Evaluation, params: Params) -> dict[str, Any] | None:
    """GEPA's row: its prompt optimized now (at TRACE's budget) when it can run; returns its record."""
    reason = gepa_status(params.analyst, params.evaluate, ev.budget["total"])
    if reason is None and "gepa" in specs.wanted:
        gepa = run_gepa(ev.policy, params.env, params.evaluate, params.rollout, params.analyst, params.seed, ev.root,
                        ev.budget["total"], make_env)
        specs.add("gepa", "gepa", "GEPA (system prompt)", routing_for=lambda e, ts: None, prompts=gepa.prompts,
                  budget_n=gepa.record["rollouts_used"], source=gepa.record["ledger"])
        return gepa.record
    specs.add("gepa", "gepa", "GEPA (system prompt)", reason)
    return None


def _clear(folder: Path) -> None:
    if folder.is_dir():
        for old in folder.glob("*.jsonl"):
            old.unlink()


def _write_reports(runs: list[MethodRun], targets: Sequence[tuple[Any, Sequence[Task]]], decisions: dict[str, list],
                   quality: dict[str, Any], interference: list[dict[str, Any]], budget: dict[str, Any],
                   cfg: EvaluateConfig, paths: Paths, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write every output of the stage but GEPA's; returns the metrics (also in evaluate.json)."""
    summarize_runs(runs, cfg.n_boot, cfg.ci_level, cfg.seed)
    tasks = [t for _, ts in targets for t in ts]
    env_names = [e.name for e, _ in targets]
    graded_envs = [name for name in env_names if graded_reward(name)]
    _clear(paths.eval_trajectories)
    _clear(paths.eval_routes)
    for r in runs:
        if r.ran:
            write_jsonl(paths.eval_episodes(r.key), r.trajectories)
    for key, ds in decisions.items():
        write_jsonl(paths.route_decisions(key), ds)
    write_jsonl(paths.eval_results, eval_results(runs, ",".join(env_names), cfg.split))
    extra = extra or {}
    for (name, suffix), text in evaluate_tables(runs, tasks, env_names, graded_envs, quality, extra.get("routers"),
                                                interference, extra.get("adapters", []), cfg,
                                                int(budget["total"])).items():
        atomic_write_text(paths.table(name, suffix), text)
    for name, figure in evaluate_figures(runs, interference, quality).items():
        save_figure(figure(), paths.figure(name))
    metrics = evaluate_metrics(runs, env_names, graded_envs, len(tasks), budget, quality, interference, cfg, extra)
    write_json(paths.metrics("evaluate"), metrics)
    return metrics
