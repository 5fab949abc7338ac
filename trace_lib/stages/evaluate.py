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
from typing import Any, get_args

from trace_lib.engine.backends import open_policy
from trace_lib.engine.model import numerics
from trace_lib.llm import analyst_client
from trace_lib.analyst.score import label_trajectories
from trace_lib.config import EnvConfig, EvaluateConfig, Params, RolloutConfig
from trace_lib.envs import graded_reward, load_tasks, make_env, make_tasks, task_split
from trace_lib.envs.base import Environment
from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks
from trace_lib.budget import DISTILLED, adapter_budget, find_adapters, trace_budget
from trace_lib.evaluation import inputs
from trace_lib.evaluation.gepa import gepa_status, run_gepa, with_prompt
from trace_lib.evaluation.runner import (
    INTERFERENCE_SEED0,
    EpisodeMemo,
    Routing,
    decode_into_memo,
    eval_rollout_config,
    eval_targets,
    evaluate_policy,
    interference_matrix,
)
from trace_lib.evaluation.tables import (
    TABLE1_ORDER,
    MethodRun,
    capability_table,
    eval_results,
    groups_of,
    hindsight_route,
    interference_frame,
    interference_table,
    markdown,
    ordered_rows,
    paired_table,
    route_solvers,
    router_quality_table,
    routing_table,
    summarize_runs,
    table1,
    table1_long,
    trace_run,
)
from trace_lib.io import atomic_write_text, read_jsonl, write_json, write_jsonl
from trace_lib.paths import Paths
from trace_lib.plots import save_figure
from trace_lib.plots.evaluate import (
    interference_heatmap,
    routing_confusion,
    success_by_method,
)
from trace_lib.records import Capability, Label, RouterName, Task, Trajectory
from trace_lib.routing.decide import oracle_decisions, route_by, routing_quality, task_openings, with_top_p
from trace_lib.routing.route import (
    RetrievalIndex,
    RouteCandidate,
    RouteDecision,
    make_candidate,
)
from trace_lib.routing.routers import KnnRouter, lacking_labels
from trace_lib.sandbox import SandboxProcess, limits_from_config

ROUTERS: tuple[RouterName, ...] = get_args(RouterName)
"""Every router is scored on the train and test splits; `evaluate.router` drives the TRACE rows."""


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
    rcfg = eval_rollout_config(params.rollout, cfg)
    targets = eval_targets(params.env, cfg, root)
    tasks = [t for _, ts in targets for t in ts]
    budget = trace_budget(root, names, params.rollout.split)
    wanted = set(cfg.methods)
    runs: list[MethodRun] = []
    decisions: dict[str, list[RouteDecision]] = {}
    memo: EpisodeMemo | None = {} if rcfg.temperature == 0 else None

    def run(routing_for: Callable[[EnvConfig, list[Task]], Routing],
            prompts: Mapping[str, str] | None = None) -> list[Trajectory]:
        out: list[Trajectory] = []
        for ecfg, ts in targets:
            factory: Callable[[], Environment] = lambda e=ecfg: make_env(e)  # noqa: E731
            if prompts is not None:  # another system prompt: never share episodes with the memo
                factory = with_prompt(factory, prompts[ecfg.name])
            out += evaluate_policy(policy, ts, factory, rcfg, cfg.seed, routing_for(ecfg, ts),
                                   progress, memo if prompts is None else None, ecfg.name)
        return out

    specs: list[tuple] = []  # every method's row, run once all are known (their episodes decoded together)

    def add(method: str, key: str, label: str, reason: str | None = None, routing_for=None,
            budget_n: int | None = None, source: str = "", prompts: Mapping[str, str] | None = None) -> None:
        if method not in wanted:  # what runs it beats why it could not have run
            trained = {"grpo_target": "train.baselines", "grpo_target_late": "train.baselines",
                       "merged_data": "train.baselines", "distilled": "train.distill.iterations"}.get(method)
            reason = (f"left out of the {params.profile} profile: add {method!r} to evaluate.methods"
                      + (f" (and set {trained})" if trained else "") + (f"; {reason}" if reason else ""))
        specs.append((method, key, label, reason, routing_for, budget_n, source, prompts))

    add("base", "base", "base", routing_for=lambda e, ts: None, budget_n=0, source="no training")
    for name, label in (("grpo_target", "GRPO on target"), ("grpo_target_late", "GRPO on target (reads played)"),
                        ("merged_data", "merged data (one adapter)")):
        if name in baselines:
            n, src = adapter_budget(root, name, baseline=True)
            add(name, name, label, routing_for=lambda e, ts, a=name: a, budget_n=n, source=src)
        else:
            add(name, name, label, f"no adapter at {paths.adapter(name, True).relative_to(root)} "
                                   "(train it at TRACE's budget: trace_lib.budget.trace_budget)")
    gepa_reason, gepa_record = gepa_status(params.analyst, params.evaluate, budget["total"]), None
    if gepa_reason is None and "gepa" in wanted:
        gepa = run_gepa(policy, params.env, params.evaluate, params.rollout, params.analyst, params.seed, root,
                        budget["total"], make_env)
        add("gepa", "gepa", "GEPA (system prompt)", routing_for=lambda e, ts: None, prompts=gepa.prompts,
            budget_n=gepa.record["rollouts_used"], source=gepa.record["ledger"])
        gepa_record = gepa.record
    else:
        add("gepa", "gepa", "GEPA (system prompt)", gepa_reason)
    trace = {"budget_n": budget["total"], "source": "TRACE adapters"}
    no_caps = inputs.why_no_adapters(root) if not names else None
    add("linear_merge", "linear_merge", "linear merge (α = 1/n)",
        no_caps or ("one capability adapter: its merge is the single adapter" if len(names) < 2 else None),
        lambda e, ts: {n: 1 / len(names) for n in names}, **trace)
    if no_caps or "single" not in wanted:
        add("single", "single", "single-capability", no_caps)
    else:
        for name in names:
            add("single", f"single_{name}", f"single: {name}", None, lambda e, ts, a=name: a,
                budget["by_adapter"][name], "its own training")
    oracle_routes: dict[str, str | None] | None = None  # the labels oracle: task id -> adapter or None

    def labelled_oracle() -> dict[str, str | None]:  # once the base model's episodes are there
        nonlocal oracle_routes
        if oracle_routes is None:
            base_run = next(r for r in runs if r.key == "base" and r.ran)
            oracle_routes = _lacking_on_base(params, root, names, base_run.trajectories or [], targets)
        return oracle_routes

    if cfg.oracle == "tags":
        add("oracle_route", "oracle_route", "oracle routing (task tags)",
            no_caps or (None if any(t.capability_tags for t in tasks) else "the tasks carry no capability tags"),
            lambda e, ts: oracle_decisions(ts, names), **trace)
    else:
        add("oracle_route", "oracle_route", "oracle routing (lacking capability)",
            no_caps or (None if "base" in wanted else "evaluate.oracle 'labels' reads the base model's episodes: "
                                                      "add base to evaluate.methods"),
            lambda e, ts: oracle_decisions(ts, names, labelled_oracle()), **trace)
    if DISTILLED in baselines:  # TRACE's budget and the student's own episodes
        n, src = adapter_budget(root, DISTILLED, baseline=True)
        add("distilled", "distilled", "TRACE distilled (one adapter)", routing_for=lambda e, ts: DISTILLED,
            budget_n=budget["total"] + n, source=f"TRACE adapters + {src}")
    else:
        add("distilled", "distilled", "TRACE distilled (one adapter)",
            no_caps or f"no adapter at {paths.adapter(DISTILLED, True).relative_to(root)} (train.distill)")
    quality: dict[str, Any] = {}
    routers: dict[str, dict[str, Any]] = {}
    chosen: str | None = None  # the router behind the TRACE rows
    interference: list[dict[str, Any]] = []
    envs = inputs.synthetic_manifests(root)
    with ExitStack() as stack:
        boxes = _open_sandboxes(stack, root, params, [n for n in names if n in envs], envs)
        if "trace" in wanted and not no_caps:
            candidates, index = _router_inputs(root, params, names, boxes, cfg)
            rc = cfg.model_copy(update={"batch_size": rcfg.batch_size})
            train_tasks, train_solved, knn, train_lacking = _train_side(root, params, names)
            scored = [r for r in ROUTERS if r != "knn" or knn is not None]
            if knn is None:
                routers["knn"] = {"note": "no score-stage labels of the train rollouts"}
            test = {r: [] for r in scored}
            for ecfg, ts in targets:
                for r, ds in route_by(policy, ts, candidates, rc, lambda e=ecfg: make_env(e), scored, index,
                                      knn).items():
                    test[r] += ds
            train = route_by(policy, train_tasks, candidates, rc, lambda: make_env(params.env), scored, index, knn)
            if params.env.validation_fraction:
                for r, q in _validation_routing(policy, params, root, names, candidates, rc, scored, index,
                                                knn).items():
                    routers.setdefault(r, {})["validation"] = q
            chosen = _chosen_router(cfg.router, routers, scored)
            for r in scored:
                decisions[f"router_{r}"] = test[r]
            decisions["trace_argmax"] = decisions.pop(f"router_{chosen}")
            decisions["trace_top_p"] = with_top_p(decisions["trace_argmax"], cfg.top_p)
        for mode in ("argmax", "top_p"):
            key = f"trace_{mode}"
            off = None if cfg.route_mode in (mode, "both") else f"evaluate.route_mode is {cfg.route_mode!r}"
            add("trace", key, f"TRACE ({mode.replace('_', '-')})", no_caps or off,
                lambda e, ts, k=key: decisions[k], **trace)
        decoded_together = 0
        if memo is not None and cfg.decode_together:  # every method's greedy episodes in one batch
            plans = [routing_for for method, _, _, reason, routing_for, _, _, prompts in specs  # the labels
                     if reason is None and prompts is None  # oracle needs the base model's episodes first
                     and not (method == "oracle_route" and cfg.oracle == "labels")]
            for ecfg, ts in targets:
                decoded_together += decode_into_memo(policy, ts, lambda e=ecfg: make_env(e), rcfg, cfg.seed,
                                                     [f(ecfg, ts) for f in plans], memo, ecfg.name, progress)
        for method, key, label, reason, routing_for, budget_n, source, prompts in specs:
            trajs = run(routing_for, prompts) if reason is None else None
            runs.append(MethodRun(method, key, label, trajs, reason or "", budget_n, source))
        singles = [r for r in runs if r.method == "single" and r.ran]
        if len(singles) > 1 and params.env.validation_fraction:  # the best single adapter, chosen on validation
            played = _singles_on_validation(policy, params, [r.key.removeprefix("single_") for r in singles], rcfg)
            for r in singles:
                r.validation = played[r.key.removeprefix("single_")]
        bound = hindsight_route(runs, budget["total"])  # what a perfect argmax router could solve
        runs += [bound] if bound is not None else []
        solvers = route_solvers(runs) if bound is not None else None
        if "trace" in wanted and not no_caps:
            base_solved = {t.task_id for t in runs[0].trajectories or [] if t.success}
            test_oracle, train_oracle = None, None  # None: the task tags
            if cfg.oracle == "labels":  # without the base model's episodes the oracle routes no test task
                test_oracle = labelled_oracle() if runs[0].ran else {}
                train_oracle = train_lacking or {}
            for r in scored:
                routers[r] = {"train": routing_quality(train[r], train_tasks, names, cfg.seed, train_solved,
                                                       oracle=train_oracle),
                              **routers.get(r, {}),
                              "test": routing_quality(test[r], tasks, names, cfg.seed, base_solved, solvers,
                                                      oracle=test_oracle)}
            quality = routers[chosen]["test"]
        if cfg.interference_seeds and boxes:
            interference = interference_matrix(policy, names, _interference_envs(boxes, params, cfg), rcfg, cfg.seed,
                                               progress, together=cfg.decode_together)
    metrics = _write_reports(runs, targets, decisions, quality, interference, budget, cfg, paths,
                             extra={"routers": routers, "router": chosen, "analysis_rollouts": budget["discovery"],
                                    "policy_id": policy.policy_id, "adapters": names, "baselines": sorted(baselines),
                                    "numerics": numerics(policy.device),
                                    **({"gepa": gepa_record} if gepa_record else {}),
                                    "episodes_decoded": None if memo is None else sum(map(len, memo.values())),
                                    "episodes_decoded_together": decoded_together,
                                    "seconds": round(time.perf_counter() - t0, 1)})
    return metrics


def _open_sandboxes(stack: ExitStack, root: Path, params: Params, names: list[str], envs: Mapping[str, Any]) -> dict:
    if not names:
        return {}
    limits = limits_from_config(params.synthesize.validation)
    return {n: stack.enter_context(SandboxProcess(root / envs[n].path, limits)) for n in names}


def _router_inputs(root: Path, params: Params, names: list[str], boxes: Mapping[str, Any], cfg: EvaluateConfig
                   ) -> tuple[list[RouteCandidate], RetrievalIndex | None]:
    seed0, difficulty = params.train.seed_offset, params.synthesize.difficulty
    candidates = []
    for cap in inputs.kept_capabilities(root, names):
        example = None
        if cap.id in boxes:
            ref = inputs.reference_trajectory(boxes[cap.id], cap.id, params.env, seed0, difficulty)
            example = ref if ref.success else None
        candidates.append(make_candidate(cap, example))
    index = None
    if cfg.retrieval_k is not None and boxes:
        seeds = list(range(seed0, seed0 + inputs.RETRIEVAL_EXAMPLES))
        items = [it for n, box in boxes.items() for it in inputs.retrieval_openings(box, n, seeds, difficulty)]
        index = RetrievalIndex.build(items)
    return candidates, index


def _capability_order(root: Path, names: list[str]) -> list[str]:
    """The adapters' capabilities in the score stage's ranking (kept.jsonl; others after): who wins a tie."""
    paths = Paths(root)
    ranked = [c.id for c in read_jsonl(paths.kept, Capability)] if paths.kept.is_file() else []
    return sorted(names, key=lambda c: ranked.index(c) if c in ranked else len(ranked))


def _train_side(root: Path, params: Params, names: list[str]
                ) -> tuple[list[Task], set[str], KnnRouter | None, dict[str, str | None] | None]:
    """The target's train tasks the rollout stage ran, the ids of those the base agent solved in some
    rollout, the kNN router over them and each task's capability labelled lacking (`lacking_labels`: the
    labels oracle on train); the last two None without score-stage labels."""
    paths = Paths(root)
    split = task_split(params.env.name, params.rollout.split)
    if not paths.rollouts(params.rollout.split).is_file():
        return [], set(), None, None
    trajs = read_jsonl(paths.rollouts(params.rollout.split), Trajectory)
    ran = {t.task_id for t in trajs}
    tasks = [t for t in load_tasks(params.env, split, root) if t.id in ran]
    solved = {t.task_id for t in trajs if t.success}
    if not paths.labels.is_file() or not tasks:
        return tasks, solved, None, None
    labels = lacking_labels(read_jsonl(paths.labels, Label), {t.id: t.task_id for t in trajs},
                            _capability_order(root, names))
    openings = task_openings(tasks, lambda: make_env(params.env))
    return tasks, solved, KnnRouter([t.id for t in tasks], openings, [labels[t.id] for t in tasks]), labels


def _lacking_on_base(params: Params, root: Path, names: list[str], base: Sequence[Trajectory],
                     targets: Sequence[tuple[EnvConfig, Sequence[Task]]], out: Path | None = None
                     ) -> dict[str, str | None]:
    """The labels oracle on a split: the analyst (`analyst`, `score.n_runs` for an LLM) labels the base model's
    episodes for the capabilities with an adapter, and each task goes to the one labelled LACKING (most often;
    ties to the score stage's ranking), none where none is. The labels are written to `out` (None: the
    evaluation split's, data/evaluate/oracle_labels.jsonl)."""
    paths = Paths(root)
    caps = inputs.kept_capabilities(root, names)
    client = analyst_client(params.analyst, paths.oracle_llm, root, params.seed)
    labels: list[Label] = []
    for ecfg, ts in targets:
        ids = {t.id for t in ts}
        labels += label_trajectories([t for t in base if t.task_id in ids], caps, ts, make_env(ecfg).tool_kinds(),
                                     params.score, client, params.seed)
    write_jsonl(out or paths.oracle_labels, labels)
    return lacking_labels(labels, {t.id: t.task_id for t in base}, _capability_order(root, names))


def _validation_routing(policy: Any, params: Params, root: Path, names: list[str],
                        candidates: list[RouteCandidate], rc: EvaluateConfig, scored: list[str],
                        index: RetrievalIndex | None, knn: KnnRouter | None) -> dict[str, dict[str, Any]]:
    """Each router's agreement with the labels oracle on the validation split: the base model plays each
    validation task once (the evaluation's settings), the analyst labels its episodes
    (data/evaluate/validation_labels.jsonl) and every router routes the tasks."""
    paths = Paths(root)
    tasks = make_tasks(params.env, "validation")
    factory = lambda: make_env(params.env)  # noqa: E731
    base = evaluate_policy(policy, tasks, factory, eval_rollout_config(params.rollout, rc), rc.seed, None, False)
    oracle = _lacking_on_base(params, root, names, base, [(params.env, tasks)], paths.validation_labels)
    solved = {t.task_id for t in base if t.success}
    routed = route_by(policy, tasks, candidates, rc, factory, scored, index, knn)
    return {r: routing_quality(routed[r], tasks, names, rc.seed, solved, oracle=oracle) for r in scored}


def _singles_on_validation(policy: Any, params: Params, names: Sequence[str],
                           rcfg: RolloutConfig) -> dict[str, tuple[int, int]]:
    """Each adapter alone on every validation task (the evaluation's settings): (successes, episodes)."""
    tasks = make_tasks(params.env, "validation")
    out = {}
    for name in names:
        trajs = evaluate_policy(policy, tasks, lambda: make_env(params.env), rcfg, params.evaluate.seed, name)
        out[name] = (sum(t.success for t in trajs), len(trajs))
    return out


def _chosen_router(router: str, routers: Mapping[str, Mapping[str, Any]], scored: Sequence[str]) -> str:
    """`router`, or for 'auto' the scored router with the highest validation accuracy (ties: `ROUTERS`' order)."""
    if router != "auto":
        return router
    accuracy = {r: routers.get(r, {}).get("validation", {}).get("router_accuracy") for r in scored}
    return max(scored, key=lambda r: (-1.0 if accuracy[r] is None else accuracy[r], -list(ROUTERS).index(r)))


def _interference_envs(boxes: Mapping[str, Any], params: Params, cfg: EvaluateConfig) -> dict:
    seeds = list(range(INTERFERENCE_SEED0, INTERFERENCE_SEED0 + cfg.interference_seeds))
    return {n: (lambda b=box: SyntheticEnv(b, params.env),
                synthetic_tasks(box, n, seeds, params.synthesize.difficulty, "test")) for n, box in boxes.items()}


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

    graded_envs = [name for name in env_names if graded_reward(name)]
    t1 = table1(runs, groups, trace_total, mean_reward=bool(graded_envs))
    caption = (f"Success rate (%) on {', '.join(env_names)} ({cfg.split} split, {len(tasks)} tasks, "
               f"{cfg.samples_per_task} episode(s) per task, temperature {cfg.temperature:g}) with 95% Wilson "
               f"intervals and successes/episodes; rollouts = training episodes behind the method (TRACE: "
               f"{trace_total}). The paired tests below use {cfg.ci_level:.0%} bootstrap intervals over tasks.")
    if graded_envs:
        caption += (f" On {', '.join(graded_envs)} an episode succeeds when its score is perfect (1); the mean "
                    "reward is the mean score (the milestone similarity), also over tasks.")
    caption += "\n\n"
    paired = ("\n## Paired tests\n\nEach method against the base model, and "
              + getattr(trace_run(runs), "label", "TRACE (not run)")
              + " against each method, on the same tasks: difference in points with its "
              f"{cfg.ci_level:.0%} bootstrap interval over tasks, exact McNemar p over (task, sample) pairs.\n\n"
              + markdown(paired_table(runs)))
    detail = [c for c in t1.columns if c in groups]  # per family in a second table, so the first fits a screen
    per_group = ("\n## Per family\n\nThe same episodes per task family (success %, 95% Wilson interval, "
                 "successes/episodes).\n\n" + markdown(t1[["method", *detail]])) if detail else ""
    atomic_write_text(paths.table("table1"), "# Table 1\n\n" + caption
                      + markdown(t1[[c for c in t1.columns if c not in detail]]) + per_group + paired)
    atomic_write_text(paths.table("table1", ".csv"), table1_long(runs, groups).to_csv(index=False))
    atomic_write_text(paths.table("routing"), "# Routing vs merging\n\n" + markdown(routing_table(runs, trace_total))
                      + "\n## Router vs oracle and random routing\n\n"
                      + f"TRACE routes with `evaluate.router: {cfg.router}`; every router is scored on both splits "
                      "(train: the rollout stage's tasks, a kNN task never votes for itself). Accuracy is agreement "
                      + ("with the oracle (task tags) on tagged tasks" if cfg.oracle == "tags" else
                         "with the oracle (the capability the analyst labels lacking in the base model's episodes: "
                         "the score stage's labels on train, the evaluation's own on test; none where none is)")
                      + "; `majority` is the best constant router; "
                      "`solved_on_none` the share of base-solved tasks left on the base model; on the test split, "
                      "`router_solvable_hits` (`oracle_solvable_hits`) the share of the tasks that the base model "
                      "or some single adapter solved (`solvable_tasks`) which the router (the oracle) sent to a "
                      "route that solved it.\n\n"
                      + markdown(router_quality_table(quality, (extra or {}).get("routers")))
                      + (f"\n{quality['note']}\n" if quality.get("note") else ""))
    adapters = extra.get("adapters", []) if extra else []
    atomic_write_text(paths.table("interference"), "# Adapter interference\n\nSuccess of each adapter (rows) on "
                      "each capability's synthetic environment (columns), held-out seeds.\n\n"
                      + (markdown(interference_table(interference)) if interference else "not run\n"))
    atomic_write_text(paths.table("capabilities"), "# Per-capability success before / after\n\n"
                      + markdown(capability_table(tasks, runs, interference, adapters)))

    save_figure(success_by_method(ordered_rows(runs)), paths.figure("evaluate_success"))
    save_figure(interference_heatmap(interference_frame(interference)), paths.figure("evaluate_interference"))
    save_figure(routing_confusion(quality), paths.figure("evaluate_routing_confusion"))

    metrics: dict[str, Any] = {
        "split": cfg.split, "envs": env_names, "graded_envs": graded_envs, "tasks": len(tasks), "trace_budget": budget,
        "methods": {r.key: {"label": r.label, "status": "run" if r.ran else "not run", "reason": r.reason,
                            "rollouts": r.budget, "budget_source": r.budget_source, "note": r.note,
                            **({"validation": list(r.validation)} if r.validation else {}),
                            **({"overall": r.summary["overall"], "vs_base": r.summary.get("vs_base"),
                                 "trace_vs": r.summary.get("trace_vs")} if r.ran else {})}
                    for r in ordered_rows(runs, (*TABLE1_ORDER, "oracle_route", "hindsight_route"))},
        "routing": quality, "interference": interference, **(extra or {}),
    }
    write_json(paths.metrics("evaluate"), metrics)
    return metrics
