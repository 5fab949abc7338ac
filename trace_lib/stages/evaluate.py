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

Paper §4 (Table 1, the routing-vs-merging comparison, the interference analysis). Methods:

    base           the base model, no adapter
    grpo_target    GRPO on the target's train tasks (one adapter)           | baselines trained at
    grpo_target_late  the same, started with the reference's reads played  | TRACE's rollout budget
    merged_data    one adapter trained on the mixture of all synthetic envs |
    gepa           GEPA-optimized system prompt (`trace_lib.evaluation.gepa`) |
    linear_merge   the per-capability adapters averaged (α = 1/n each), one fixed merge for every task
    single         each capability adapter alone on every task; the best one gets its own row
    oracle_route   each task routed to the capability the analyst labels lacking in the base model's
                   episode of it, none where none is (`evaluate.oracle: labels`; the labels in
                   data/evaluate/oracle_labels.jsonl), or by its capability tags (`tags`; built-in families)
    hindsight_route  not a method: each task's episode from a route that solved it (base first, then the
                   single adapters), the most a perfect argmax router could solve; needs `single`
    trace          the base model routes each task: `argmax` (one adapter or none) and/or `top_p`
                   (α-weighted merge, `compose.apply_route`)
    distilled      one student adapter distilled on-policy from the capability adapters (`train.distill`,
                   the paper's unified adapter) on every task; its budget is TRACE's plus its own

Running a method is `trace_lib.evaluation.runner`; the tables are `trace_lib.evaluation.tables`. Greedy
episodes are shared between methods that send a task to the same weights; with `evaluate.decode_together`
(on in the cpu profile) every method's are decoded in one batch whose rows run under different weights
(`runner.decode_into_memo`, `engine.row_lora`) before the rows are assembled (GEPA's, under another system
prompt, apart); the interference matrix then decodes each synthetic environment's episodes of the base model
and of every adapter in one such batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from trace_lib.engine.backends import open_policy
from trace_lib.engine.model import numerics
from trace_lib.config import EnvConfig, EvaluateConfig, Params, RolloutConfig
from trace_lib.envs import graded_reward, make_env
from trace_lib.envs.base import Environment
from trace_lib.budget import find_adapters, trace_budget
from trace_lib.evaluation import inputs
from trace_lib.evaluation.router_side import (
    ROUTERS,
    LabelsOracle,
    chosen_router,
    interference_envs,
    open_sandboxes,
    router_candidates,
    singles_on_validation,
    train_side,
    validation_routing,
)
from trace_lib.evaluation.methods import MethodSpecs
from trace_lib.evaluation.gepa import gepa_status, run_gepa, with_prompt
from trace_lib.evaluation.runner import (
    EpisodeMemo,
    decode_into_memo,
    eval_rollout_config,
    eval_targets,
    evaluate_policy,
    interference_matrix,
)
from trace_lib.evaluation.outputs import (
    capabilities_markdown,
    evaluate_metrics,
    interference_markdown,
    routing_markdown,
    table1_markdown,
)
from trace_lib.evaluation.tables import (
    MethodRun,
    eval_results,
    groups_of,
    hindsight_route,
    interference_frame,
    ordered_rows,
    route_solvers,
    summarize_runs,
    table1_long,
)
from trace_lib.io import atomic_write_text, write_json, write_jsonl
from trace_lib.paths import Paths
from trace_lib.plots import save_figure
from trace_lib.plots.evaluate import (
    interference_heatmap,
    routing_confusion,
    success_by_method,
)
from trace_lib.records import Task, Trajectory
from trace_lib.routing.decide import route_by, routing_quality, with_top_p
from trace_lib.routing.route import RouteDecision
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
    ev = _Evaluation(params, root, policy, names, eval_rollout_config(params.rollout, cfg),
                     eval_targets(params.env, cfg, root), trace_budget(root, names, params.rollout.split), progress)
    no_caps = inputs.why_no_adapters(root) if not names else None
    specs = MethodSpecs(cfg.methods, params.profile)
    specs.add("base", "base", "base", routing_for=lambda e, ts: None, budget_n=0, source="no training")
    specs.add_baselines(baselines, root)
    gepa_record = _add_gepa(specs, ev)
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
        routed = _route_tasks(ev, boxes, routers) if "trace" in specs.wanted and not no_caps else None
        chosen = routed[0] if routed else None
        specs.add_trace(cfg.route_mode, no_caps, ev.decisions, ev.budget["total"])
        decoded_together = _run_specs(ev, specs)
        if routed:
            quality = _router_quality(ev, routed, routers)
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


class _Evaluation:
    """What the stage's steps share: the policy, the tasks, the methods' runs and the router's decisions."""

    def __init__(self, params: Params, root: Path, policy: Any, names: list[str], rcfg: RolloutConfig,
                 targets: list[tuple[EnvConfig, list[Task]]], budget: dict[str, Any], progress: bool) -> None:
        self.params, self.cfg, self.root, self.policy, self.names = params, params.evaluate, root, policy, names
        self.rcfg, self.targets, self.budget, self.progress = rcfg, targets, budget, progress
        self.tasks = [t for _, ts in targets for t in ts]
        self.runs: list[MethodRun] = []
        self.decisions: dict[str, list[RouteDecision]] = {}
        self.memo: EpisodeMemo | None = {} if rcfg.temperature == 0 else None
        self.oracle = LabelsOracle(params.analyst, params.score, params.seed, root, names)
        self._oracle_routes: dict[str, str | None] | None = None

    def labelled_oracle(self) -> dict[str, str | None]:
        """The labels oracle on the evaluation split (task id -> adapter or None), once the base model's episodes
        are there."""
        if self._oracle_routes is None:
            base_run = next(r for r in self.runs if r.key == "base" and r.ran)
            self._oracle_routes = self.oracle.route(base_run.trajectories or [], self.targets)
        return self._oracle_routes

    def play(self, routing_for: Any, prompts: Mapping[str, str] | None = None) -> list[Trajectory]:
        """One method's episodes on every target, through the shared memo unless it has its own prompts."""
        out: list[Trajectory] = []
        for ecfg, ts in self.targets:
            factory: Callable[[], Environment] = lambda e=ecfg: make_env(e)  # noqa: E731
            if prompts is not None:  # another system prompt: never share episodes with the memo
                factory = with_prompt(factory, prompts[ecfg.name])
            out += evaluate_policy(self.policy, ts, factory, self.rcfg, self.cfg.seed, routing_for(ecfg, ts),
                                   self.progress, self.memo if prompts is None else None, ecfg.name)
        return out


def _add_gepa(specs: MethodSpecs, ev: _Evaluation) -> dict[str, Any] | None:
    """GEPA's row: its prompt optimized now (at TRACE's budget) when it can run; returns its record."""
    params = ev.params
    reason = gepa_status(params.analyst, params.evaluate, ev.budget["total"])
    if reason is None and "gepa" in specs.wanted:
        gepa = run_gepa(ev.policy, params.env, params.evaluate, params.rollout, params.analyst, params.seed, ev.root,
                        ev.budget["total"], make_env)
        specs.add("gepa", "gepa", "GEPA (system prompt)", routing_for=lambda e, ts: None, prompts=gepa.prompts,
                  budget_n=gepa.record["rollouts_used"], source=gepa.record["ledger"])
        return gepa.record
    specs.add("gepa", "gepa", "GEPA (system prompt)", reason)
    return None


def _route_tasks(ev: _Evaluation, boxes: Mapping[str, Any], routers: dict[str, dict[str, Any]]) -> tuple:
    """Every router on the test and train tasks (and validation, where `evaluate.router: auto` chooses); fills in
    TRACE's decisions. Returns (the chosen router, the routers scored, test decisions, train decisions, train tasks,
    those the base agent solved, the train labels oracle)."""
    params, cfg = ev.params, ev.cfg
    candidates, index = router_candidates(ev.root, ev.names, boxes, cfg, params.env, params.train.seed_offset,
                                          params.synthesize.difficulty)
    rc = cfg.model_copy(update={"batch_size": ev.rcfg.batch_size})
    train_tasks, train_solved, knn, train_lacking = train_side(ev.root, params.env, params.rollout.split, ev.names)
    scored = [r for r in ROUTERS if r != "knn" or knn is not None]
    if knn is None:
        routers["knn"] = {"note": "no score-stage labels of the train rollouts"}
    test = {r: [] for r in scored}
    for ecfg, ts in ev.targets:
        for r, ds in route_by(ev.policy, ts, candidates, rc, lambda e=ecfg: make_env(e), scored, index, knn).items():
            test[r] += ds
    train = route_by(ev.policy, train_tasks, candidates, rc, lambda: make_env(params.env), scored, index, knn)
    if params.env.validation_fraction:
        for r, q in validation_routing(ev.policy, ev.oracle, params.env, params.rollout, candidates, rc, scored,
                                       index, knn).items():
            routers.setdefault(r, {})["validation"] = q
    chosen = chosen_router(cfg.router, routers, scored)
    for r in scored:
        ev.decisions[f"router_{r}"] = test[r]
    ev.decisions["trace_argmax"] = ev.decisions.pop(f"router_{chosen}")
    ev.decisions["trace_top_p"] = with_top_p(ev.decisions["trace_argmax"], cfg.top_p)
    return chosen, scored, test, train, train_tasks, train_solved, train_lacking


def _run_specs(ev: _Evaluation, specs: MethodSpecs) -> int:
    """Every row's episodes (decoded together first with `evaluate.decode_together`), the best single adapter's
    validation record and the hindsight bound; returns how many episodes were decoded together."""
    cfg = ev.cfg
    decoded_together = 0
    if ev.memo is not None and cfg.decode_together:  # every method's greedy episodes in one batch
        plans = specs.plans(cfg.oracle)
        for ecfg, ts in ev.targets:
            decoded_together += decode_into_memo(ev.policy, ts, lambda e=ecfg: make_env(e), ev.rcfg, cfg.seed,
                                                 [f(ecfg, ts) for f in plans], ev.memo, ecfg.name, ev.progress)
    for s in specs:
        trajs = ev.play(s.routing_for, s.prompts) if s.reason is None else None
        ev.runs.append(MethodRun(s.method, s.key, s.label, trajs, s.reason or "", s.budget_n, s.source))
    singles = [r for r in ev.runs if r.method == "single" and r.ran]
    if len(singles) > 1 and ev.params.env.validation_fraction:  # the best single adapter, chosen on validation
        played = singles_on_validation(ev.policy, ev.params.env, [r.key.removeprefix("single_") for r in singles],
                                       ev.rcfg, cfg.seed)
        for r in singles:
            r.validation = played[r.key.removeprefix("single_")]
    bound = hindsight_route(ev.runs, ev.budget["total"])  # what a perfect argmax router could solve
    ev.runs += [bound] if bound is not None else []
    return decoded_together


def _router_quality(ev: _Evaluation, routed: tuple, routers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each scored router on train and test against the oracle and random routing; returns the chosen one's test
    record."""
    chosen, scored, test, train, train_tasks, train_solved, train_lacking = routed
    cfg, runs = ev.cfg, ev.runs
    solvers = route_solvers(runs) if any(r.key == "hindsight_route" for r in runs) else None
    base_solved = {t.task_id for t in runs[0].trajectories or [] if t.success}
    test_oracle, train_oracle = None, None  # None: the task tags
    if cfg.oracle == "labels":  # without the base model's episodes the oracle routes no test task
        test_oracle = ev.labelled_oracle() if runs[0].ran else {}
        train_oracle = train_lacking or {}
    for r in scored:
        routers[r] = {"train": routing_quality(train[r], train_tasks, ev.names, cfg.seed, train_solved,
                                               oracle=train_oracle),
                      **routers.get(r, {}),
                      "test": routing_quality(test[r], ev.tasks, ev.names, cfg.seed, base_solved, solvers,
                                              oracle=test_oracle)}
    return routers[chosen]["test"]


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
    groups = groups_of(tasks)
    trace_total = int(budget["total"])
    _clear(paths.eval_trajectories)
    _clear(paths.eval_routes)
    for r in runs:
        if r.ran:
            write_jsonl(paths.eval_episodes(r.key), r.trajectories)
    for key, ds in decisions.items():
        write_jsonl(paths.route_decisions(key), ds)
    write_jsonl(paths.eval_results, eval_results(runs, ",".join(env_names), cfg.split))
    atomic_write_text(paths.table("table1"),
                      table1_markdown(runs, groups, env_names, graded_envs, len(tasks), cfg, trace_total))
    atomic_write_text(paths.table("table1", ".csv"), table1_long(runs, groups).to_csv(index=False))
    atomic_write_text(paths.table("routing"),
                      routing_markdown(runs, quality, (extra or {}).get("routers"), cfg, trace_total))
    atomic_write_text(paths.table("interference"), interference_markdown(interference))
    adapters = extra.get("adapters", []) if extra else []
    atomic_write_text(paths.table("capabilities"), capabilities_markdown(tasks, runs, interference, adapters))
    save_figure(success_by_method(ordered_rows(runs)), paths.figure("evaluate_success"))
    save_figure(interference_heatmap(interference_frame(interference)), paths.figure("evaluate_interference"))
    save_figure(routing_confusion(quality), paths.figure("evaluate_routing_confusion"))
    metrics = evaluate_metrics(runs, env_names, graded_envs, len(tasks), budget, quality, interference, cfg, extra)
    write_json(paths.metrics("evaluate"), metrics)
    return metrics
