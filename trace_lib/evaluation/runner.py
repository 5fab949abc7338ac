"""Evaluate stage: the router + capability adapters on held-out target tasks, against baselines.

Reads params.yaml (sections `model`, `env`, `rollout`, `analyst`, `synthesize`, `train`, `evaluate`),
the prepared model and what `trace_lib.evaluation.inputs` lists (adapters, ledgers, synthetic envs, kept
capabilities); writes

    data/evaluate/trajectories/<method>.jsonl   every evaluation episode (Trajectory, no timings)
    data/evaluate/routes/<method>.jsonl         the router's decision per task (RouteDecision)
    data/evaluate/results.jsonl                 one EvalResult per method that ran
    reports/tables/{table1,routing,interference,capabilities}.md, table1.csv
    reports/metrics/evaluate.json               rates, CIs, paired tests vs base, budgets, routing quality
    reports/figures/evaluate_*.png              success per method, interference heatmap, routing confusion

Paper §4 (Table 1, the routing-vs-merging comparison, the interference analysis). Methods:

    base           the base model, no adapter
    grpo_target    GRPO on the target's train tasks (one adapter)           | baselines trained at
    merged_data    one adapter trained on the mixture of all synthetic envs | TRACE's rollout budget
    gepa           GEPA-optimized system prompt (`trace_lib.evaluation.gepa`)     |
    linear_merge   the per-capability adapters averaged (α = 1/n each), one fixed merge for every task
    single         each capability adapter alone on every task; the best one gets its own row
    oracle_route   each task routed by its known capability tags (built-in families only)
    trace          the base model routes each task: `argmax` (one adapter or none) and/or `top_p`
                   (α-weighted merge, `compose.apply_route`)

Evaluation decodes greedily by default (the paper: one trial, temperature 0), so two methods differ
only by their weights and the paired tests compare like with like.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from trace_lib.routing.compose import apply_route, merge_label
from trace_lib.config import EnvConfig, EvaluateConfig, RolloutConfig
from trace_lib.envs.base import Environment
from trace_lib.records import Task, Trajectory
from trace_lib.agent.rollout import collect_rollouts
from trace_lib.routing.route import RetrievalIndex, RouteCandidate, RouteDecision, oracle_route, random_route, route_argmax
from trace_lib.routing.route import route_tasks, route_top_p, task_opening

INTERFERENCE_SEED0 = 1_000_000
"""Synthetic-env seeds of the interference matrix start here: never a validation seed (0..n_seeds) nor
a training seed (train.seed_offset + group index)."""


def eval_rollout_config(rollout: RolloutConfig, cfg: EvaluateConfig) -> RolloutConfig:
    """The rollout section with the evaluate section's sampling (decoding mode and tool_choice kept)."""
    update: dict[str, Any] = {"split": cfg.split, "samples_per_task": cfg.samples_per_task,
                              "temperature": cfg.temperature, "max_tasks": cfg.max_tasks}
    if cfg.max_new_tokens is not None:
        update["max_new_tokens"] = cfg.max_new_tokens
    if cfg.batch_size is not None:
        update["batch_size"] = cfg.batch_size
    return rollout.model_copy(update=update)


def eval_targets(env: EnvConfig, cfg: EvaluateConfig) -> list[tuple[EnvConfig, list[Task]]]:
    """(env section, tasks) of each target environment evaluated."""
    from trace_lib.envs import make_tasks

    out = []
    for name in cfg.envs or [env.name]:
        ecfg = env.model_copy(update={"name": name})
        split = "base" if cfg.split == "all" and name.startswith("tau2") else cfg.split
        tasks = make_tasks(ecfg, split)
        out.append((ecfg, tasks[: cfg.max_tasks] if cfg.max_tasks else tasks))
    return out


# --- running a method -------------------------------------------------------------------------------
Routing = None | str | Mapping[str, Any] | Sequence[RouteDecision]


def _clean(weights: Mapping[str, float]) -> dict[str, float]:
    return {n: float(a) for n, a in sorted(weights.items()) if float(a) != 0.0}


def route_groups(tasks: Sequence[Task], routing: Routing) -> list[tuple[dict[str, float], list[Task]]]:
    """Tasks grouped by the weights they run under, groups in order of first appearance.

    `routing`: None (base model), an adapter name (alone, on every task), an {adapter: α} dict (one
    fixed merge), per-task RouteDecisions, or a {task id: RouteDecision | {adapter: α}} dict.
    """
    if routing is None or isinstance(routing, str):
        return [({} if routing is None else {routing: 1.0}, list(tasks))] if tasks else []
    if isinstance(routing, Mapping) and all(isinstance(v, int | float) for v in routing.values()):
        return [(_clean(routing), list(tasks))] if tasks else []
    per_task = dict(routing) if isinstance(routing, Mapping) else {d.task_id: d for d in routing}
    groups: dict[tuple, tuple[dict[str, float], list[Task]]] = {}
    for task in tasks:
        if task.id not in per_task:
            raise ValueError(f"no routing decision for task {task.id!r}")
        w = per_task[task.id]
        w = _clean(getattr(w, "weights", w))
        groups.setdefault(tuple(w.items()), (w, []))[1].append(task)
    return list(groups.values())


def weights_label(weights: Mapping[str, float]) -> str | None:
    """The `adapter` a trajectory records: None (base), the adapter's name, or `merge_label`."""
    if not weights:
        return None
    if len(weights) == 1 and next(iter(weights.values())) == 1.0:
        return next(iter(weights))
    return merge_label(weights)


EpisodeMemo = dict[tuple, list[Trajectory]]
"""(env name, weights, task id) -> that task's trajectories: see `evaluate_policy`'s `memo`."""


def evaluate_policy(policy: Any, tasks: Sequence[Task], env_factory: Callable[[], Environment],
                    rollout_cfg: RolloutConfig, seed: int, routing: Routing = None,
                    progress: bool = False, memo: EpisodeMemo | None = None, memo_key: str = "") -> list[Trajectory]:
    """Run `tasks` under `routing` (see `route_groups`); each group runs under one weight state
    (`compose.apply_route`, base weights restored after). Trajectories sorted by id; their
    `policy_id` and `adapter` name the adapter or merge each ran with.

    `memo` (greedy decoding only): an episode at temperature 0 is a function of its task and the
    weights it runs under, so methods that send a task to the same weights (TRACE routing a task to
    adapter A, `single` running A everywhere, the oracle, the base model for `none`) share one episode
    instead of decoding it again. `memo_key` names the environment the tasks belong to."""
    if memo is not None and rollout_cfg.temperature != 0:
        raise ValueError("episodes can be shared between methods only at temperature 0")
    out: list[Trajectory] = []
    for weights, group in route_groups(tasks, routing):
        key = (memo_key, tuple(weights.items()))
        todo = group if memo is None else [t for t in group if (*key, t.id) not in memo]
        if todo:
            with apply_route(policy, weights):
                trajs, _ = collect_rollouts(policy, env_factory, todo, rollout_cfg, seed,
                                            adapter=weights_label(weights), progress=progress)
            if memo is None:
                out.extend(trajs)
            else:
                for t in todo:
                    memo[(*key, t.id)] = [x for x in trajs if x.task_id == t.id]
        if memo is not None:
            out.extend(x for t in group for x in memo[(*key, t.id)])
    return sorted(out, key=lambda t: t.id)


# --- routing ----------------------------------------------------------------------------------------
def task_openings(tasks: Sequence[Task], env_factory: Callable[[], Environment]) -> list[str]:
    """The customer's first message of each task, as the environment opens the episode."""
    env = env_factory()
    return [task_opening(env.reset(task)) for task in tasks]


def route_all(policy: Any, tasks: Sequence[Task], candidates: Sequence[RouteCandidate], cfg: EvaluateConfig,
              env_factory: Callable[[], Environment], index: RetrievalIndex | None = None) -> list[RouteDecision]:
    """Argmax decisions for every task (the router scores each task once; `with_top_p` derives the
    top-p weights from the same probabilities)."""
    if not tasks:
        return []
    return route_tasks(policy, task_openings(tasks, env_factory), candidates, mode="argmax", top_p=cfg.top_p,
                       index=index, k=cfg.retrieval_k if index is not None else None,
                       task_ids=[t.id for t in tasks], batch_size=cfg.batch_size or 8)


def with_top_p(decisions: Sequence[RouteDecision], p: float) -> list[RouteDecision]:
    """The same router probabilities read with top-p instead of argmax."""
    return [d.model_copy(update={"mode": "top_p", "weights": route_top_p(d.probs, d.candidates, p)})
            for d in decisions]


def oracle_decisions(tasks: Sequence[Task], adapters: Sequence[str]) -> dict[str, dict[str, float]]:
    """Task id -> weights of the oracle router (the task's capability tags; {} = base)."""
    out = {}
    for t in tasks:
        best = oracle_route(t, adapters)
        out[t.id] = {} if best is None else {best: 1.0}
    return out


NONE = "none"


def routing_quality(decisions: Sequence[RouteDecision], tasks: Sequence[Task], adapters: Sequence[str],
                    seed: int = 0) -> dict[str, Any]:
    """Router vs oracle on tasks with capability tags: confusion counts (oracle row, router column;
    'none' = base model), accuracy of the router and of a seeded uniform random router over the same
    candidates (plus that random router's expected accuracy). Untagged tasks (τ²) are not scored."""
    by_id = {d.task_id: d for d in decisions}
    labels = [*sorted(adapters), NONE]
    confusion = {o: {r: 0 for r in labels} for o in labels}
    hits = rand_hits = 0
    expected = 0.0
    scored = 0
    for task in tasks:
        d = by_id.get(task.id)
        if d is None or not task.capability_tags:
            continue
        oracle = oracle_route(task, adapters) or NONE
        routed = route_argmax(d.probs, d.candidates) or NONE
        rand = random_route(task.id, d.candidates, seed) or NONE
        confusion[oracle][routed] += 1
        scored += 1
        hits += routed == oracle
        rand_hits += rand == oracle
        expected += (oracle in d.candidates or oracle == NONE) / (len(d.candidates) + 1)
    routed_none = sum(route_argmax(d.probs, d.candidates) is None for d in decisions)
    masses = [d.label_mass for d in decisions if d.label_mass is not None]
    return {
        "tasks": len(decisions), "scored": scored, "labels": labels, "confusion": confusion,
        "router_accuracy": hits / scored if scored else None,
        "random_accuracy": rand_hits / scored if scored else None,
        "random_expected": expected / scored if scored else None,
        "none_share": routed_none / len(decisions) if decisions else None,
        "mean_label_mass": sum(masses) / len(masses) if masses else None,
        "note": "" if scored else "no task carries capability tags (τ² tasks): router accuracy is undefined",
    }


# --- interference -----------------------------------------------------------------------------------
def interference_matrix(policy: Any, adapters: Sequence[str],
                        envs: Mapping[str, tuple[Callable[[], Environment], Sequence[Task]]],
                        rollout_cfg: RolloutConfig, seed: int, progress: bool = False) -> list[dict[str, Any]]:
    """Success of the base model and of each adapter on each capability's environment (long form:
    one dict per adapter x env with n, successes, success_rate)."""
    rows = []
    for name in [None, *adapters]:
        for env_name, (factory, tasks) in envs.items():
            trajs = evaluate_policy(policy, tasks, factory, rollout_cfg, seed, name, progress)
            k = sum(t.success for t in trajs)
            rows.append({"adapter": name or "base", "env": env_name, "n": len(trajs), "successes": k,
                         "success_rate": k / len(trajs) if trajs else None})
    return rows


# --- the stage --------------------------------------------------------------------------------------
def evaluate_paths(root: Path = Path(".")) -> dict[str, Path]:
    return {
        "out": root / "data" / "evaluate",
        "trajectories": root / "data" / "evaluate" / "trajectories",
        "routes": root / "data" / "evaluate" / "routes",
        "results": root / "data" / "evaluate" / "results.jsonl",
        "tables": root / "reports" / "tables",
        "figures": root / "reports" / "figures",
        "metrics": root / "reports" / "metrics" / "evaluate.json",
    }


def run_evaluate(params: Any, root: Path = Path("."), progress: bool = True) -> dict[str, Any]:
    """The whole stage (see the module docstring); returns the metrics written to evaluate.json."""
    from trace_lib.evaluation import inputs
    from trace_lib.evaluation.gepa import gepa_status, run_gepa, with_prompt
    from trace_lib.evaluation.tables import MethodRun, write_reports
    from trace_lib.agent.policy import load_policy

    cfg: EvaluateConfig = params.evaluate
    t0 = time.perf_counter()
    model_dir = root / params.model.out_dir
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {model_dir} not found: run the prepare_model stage first")
    caps, baselines = inputs.find_adapters(root)
    names = sorted(caps)
    policy = load_policy(model_dir, dtype=params.model.dtype, threads=params.rollout.threads,
                         adapters={n: str(p) for n, p in {**caps, **baselines}.items()} or None)
    for folder in [*caps.values(), *baselines.values()]:
        inputs.check_base_model(folder, policy.base_id)
    rcfg = eval_rollout_config(params.rollout, cfg)
    targets = eval_targets(params.env, cfg)
    tasks = [t for _, ts in targets for t in ts]
    budget = inputs.trace_budget(root, names)
    wanted = set(cfg.methods)
    runs: list[MethodRun] = []
    decisions: dict[str, list[RouteDecision]] = {}
    memo: EpisodeMemo | None = {} if rcfg.temperature == 0 else None

    def run(routing_for: Callable[[EnvConfig, list[Task]], Routing],
            prompts: Mapping[str, str] | None = None) -> list[Trajectory]:
        out: list[Trajectory] = []
        for ecfg, ts in targets:
            factory: Callable[[], Environment] = lambda e=ecfg: _make_env(e)  # noqa: E731
            if prompts is not None:  # another system prompt: never share episodes with the memo
                factory = with_prompt(factory, prompts[ecfg.name])
            out += evaluate_policy(policy, ts, factory, rcfg, cfg.seed, routing_for(ecfg, ts),
                                   progress, memo if prompts is None else None, ecfg.name)
        return out

    def add(method: str, key: str, label: str, reason: str | None = None, routing_for=None,
            budget_n: int | None = None, source: str = "", prompts: Mapping[str, str] | None = None) -> None:
        if reason is None and method not in wanted:
            reason = "not in evaluate.methods"
        trajs = run(routing_for, prompts) if reason is None else None
        runs.append(MethodRun(method, key, label, trajs, reason or "", budget_n, source))

    add("base", "base", "base", routing_for=lambda e, ts: None, budget_n=0, source="no training")
    for name, label in (("grpo_target", "GRPO on target"), ("merged_data", "merged data (one adapter)")):
        if name in baselines:
            n, src = inputs.adapter_budget(root, name, baseline=True)
            add(name, name, label, routing_for=lambda e, ts, a=name: a, budget_n=n, source=src)
        else:
            add(name, name, label, f"no adapter at {inputs.adapter_dir(root, name, True).relative_to(root)} "
                                   "(train it at TRACE's budget: eval_inputs.trace_budget)")
    gepa_reason, gepa_record = gepa_status(params, budget["total"]), None
    if gepa_reason is None and "gepa" in wanted:
        gepa = run_gepa(policy, params, root, budget["total"], _make_env)
        add("gepa", "gepa", "GEPA (system prompt)", routing_for=lambda e, ts: None, prompts=gepa.prompts,
            budget_n=gepa.record["rollouts_used"], source=gepa.record["ledger"])
        gepa_record = gepa.record
    else:
        add("gepa", "gepa", "GEPA (system prompt)", gepa_reason)
    trace = {"budget_n": budget["total"], "source": "TRACE adapters"}
    no_caps = "no capability adapters under data/adapters/" if not names else None
    add("linear_merge", "linear_merge", "linear merge (α = 1/n)",
        no_caps or ("one capability adapter: its merge is the single adapter" if len(names) < 2 else None),
        lambda e, ts: {n: 1 / len(names) for n in names}, **trace)
    if no_caps or "single" not in wanted:
        add("single", "single", "single-capability", no_caps)
    else:
        for name in names:
            add("single", f"single_{name}", f"single: {name}", None, lambda e, ts, a=name: a,
                budget["by_adapter"][name], "its own training")
    add("oracle_route", "oracle_route", "oracle routing (task tags)",
        no_caps or (None if any(t.capability_tags for t in tasks) else "the tasks carry no capability tags"),
        lambda e, ts: oracle_decisions(ts, names), **trace)
    quality: dict[str, Any] = {}
    interference: list[dict[str, Any]] = []
    envs = inputs.synthetic_manifests(root)
    with ExitStack() as stack:
        boxes = _open_sandboxes(stack, root, params, [n for n in names if n in envs], envs)
        if "trace" in wanted and not no_caps:
            candidates, index = _router_inputs(root, params, names, boxes, cfg)
            rc = cfg.model_copy(update={"batch_size": rcfg.batch_size})
            decisions["trace_argmax"] = [d for ecfg, ts in targets for d in route_all(
                policy, ts, candidates, rc, lambda e=ecfg: _make_env(e), index)]
            decisions["trace_top_p"] = with_top_p(decisions["trace_argmax"], cfg.top_p)
            quality = routing_quality(decisions["trace_argmax"], tasks, names, cfg.seed)
        for mode in ("argmax", "top_p"):
            key = f"trace_{mode}"
            off = None if cfg.route_mode in (mode, "both") else f"evaluate.route_mode is {cfg.route_mode!r}"
            add("trace", key, f"TRACE ({mode.replace('_', '-')})", no_caps or off,
                lambda e, ts, k=key: decisions[k], **trace)
        if cfg.interference_seeds and boxes:
            interference = interference_matrix(policy, names, _interference_envs(boxes, params, cfg), rcfg, cfg.seed,
                                               progress)
    metrics = write_reports(runs, targets, decisions, quality, interference, budget, cfg, evaluate_paths(root),
                            extra={"analysis_rollouts": inputs.analysis_rollouts(root, params.rollout.split),
                                   "policy_id": policy.policy_id, "adapters": names, "baselines": sorted(baselines),
                                   **({"gepa": gepa_record} if gepa_record else {}),
                                   "episodes_decoded": None if memo is None else sum(map(len, memo.values())),
                                   "seconds": round(time.perf_counter() - t0, 1)})
    return metrics


def _make_env(ecfg: EnvConfig) -> Environment:
    from trace_lib.envs import make_env

    return make_env(ecfg)


def _open_sandboxes(stack: ExitStack, root: Path, params: Any, names: list[str], envs: Mapping[str, Any]) -> dict:
    if not names:
        return {}
    from trace_lib.synth.sandbox import SandboxProcess, limits_from_config

    limits = limits_from_config(params.synthesize.validation)
    return {n: stack.enter_context(SandboxProcess(root / envs[n].path, limits)) for n in names}


def _router_inputs(root: Path, params: Any, names: list[str], boxes: Mapping[str, Any], cfg: EvaluateConfig
                   ) -> tuple[list[RouteCandidate], RetrievalIndex | None]:
    from trace_lib.evaluation import inputs
    from trace_lib.routing.route import make_candidate

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


def _interference_envs(boxes: Mapping[str, Any], params: Any, cfg: EvaluateConfig) -> dict:
    from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks

    seeds = list(range(INTERFERENCE_SEED0, INTERFERENCE_SEED0 + cfg.interference_seeds))
    return {n: (lambda b=box: SyntheticEnv(b, params.env),
                synthetic_tasks(box, n, seeds, params.synthesize.difficulty, "test")) for n, box in boxes.items()}
