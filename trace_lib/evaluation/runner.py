"""Running methods on target tasks: routed evaluation, router quality, adapter interference (paper §4).

Reads and writes nothing on disk; the evaluate stage (`stages/evaluate.py`) and the scaling stage
call it. A method is the base model under some `Routing` (see `route_groups`): no adapter, one adapter on
every task, one fixed merge, or per-task router decisions (`compose.apply_route` puts each weight state
in place and restores the base weights after). `evaluate_policy` runs it, sharing greedy episodes
between methods that send a task to the same weights; `route_all` / `with_top_p` make the router's
decisions, `routing_quality` scores them against the oracle (the capability labelled lacking, or the task
tags), a random router and what the base model and single adapters solved, and
`interference_matrix` runs every adapter on every capability's synthetic environment.

Evaluation decodes greedily by default (the paper: one trial, temperature 0), so two methods differ
only by their weights and the paired tests compare like with like.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from trace_lib.agent.rollout import collect_rollouts, collect_routed_rollouts
from trace_lib.config import EnvConfig, EvaluateConfig, RolloutConfig
from trace_lib.envs import load_tasks, task_split
from trace_lib.envs.base import Environment
from trace_lib.evaluation.tables import NONE_ROUTE as NONE
from trace_lib.records import RouterName, Task, Trajectory
from trace_lib.engine.adapters import canonical_weights, route_label
from trace_lib.engine.compose import apply_route
from trace_lib.routing.route import (
    RetrievalIndex,
    RouteCandidate,
    RouteDecision,
    candidates_per_task,
    oracle_route,
    random_route,
    route_argmax,
    route_tasks,
    route_top_p,
    task_opening,
)
from trace_lib.routing.routers import KnnRouter, calibrated_decisions, knn_decisions

log = logging.getLogger(__name__)

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


def eval_targets(env: EnvConfig, cfg: EvaluateConfig, root: Path) -> list[tuple[EnvConfig, list[Task]]]:
    """(env section, tasks) of each target environment evaluated (tasks as the rollout stage wrote them)."""
    out = []
    for name in cfg.envs or [env.name]:
        ecfg = env.model_copy(update={"name": name})
        tasks = load_tasks(ecfg, task_split(name, cfg.split), root)
        out.append((ecfg, tasks[: cfg.max_tasks] if cfg.max_tasks else tasks))
    return out


# --- running a method -------------------------------------------------------------------------------
Routing = None | str | Mapping[str, Any] | Sequence[RouteDecision]


def route_groups(tasks: Sequence[Task], routing: Routing) -> list[tuple[dict[str, float], list[Task]]]:
    """Tasks grouped by the weights they run under, groups in order of first appearance.

    `routing`: None (base model), an adapter name (alone, on every task), an {adapter: α} dict (one
    fixed merge), per-task RouteDecisions, or a {task id: RouteDecision | {adapter: α}} dict.
    """
    if routing is None or isinstance(routing, str):
        return [({} if routing is None else {routing: 1.0}, list(tasks))] if tasks else []
    if isinstance(routing, Mapping) and all(isinstance(v, int | float) for v in routing.values()):
        return [(canonical_weights(routing), list(tasks))] if tasks else []
    per_task = dict(routing) if isinstance(routing, Mapping) else {d.task_id: d for d in routing}
    groups: dict[tuple, tuple[dict[str, float], list[Task]]] = {}
    for task in tasks:
        if task.id not in per_task:
            raise ValueError(f"no routing decision for task {task.id!r}")
        w = per_task[task.id]
        w = canonical_weights(getattr(w, "weights", w))
        groups.setdefault(tuple(w.items()), (w, []))[1].append(task)
    return list(groups.values())


EpisodeMemo = dict[tuple, list[Trajectory]]
"""(env name, weights, task id) -> that task's trajectories: see `evaluate_policy`'s `memo`."""


def memo_key(env: str, weights: Mapping[str, float], task_id: str) -> tuple:
    """The `EpisodeMemo` key of a task under `weights`, normalised as `route_groups` normalises them
    (sorted by adapter, nonzero, float): the one key `evaluate_policy` and the scaling stage share."""
    return env, tuple(canonical_weights(weights).items()), task_id


def evaluate_policy(policy: Any, tasks: Sequence[Task], env_factory: Callable[[], Environment],
                    rollout_cfg: RolloutConfig, seed: int, routing: Routing = None,
                    progress: bool = False, memo: EpisodeMemo | None = None, env_name: str = "") -> list[Trajectory]:
    """Run `tasks` under `routing` (see `route_groups`); each group runs under one weight state
    (`compose.apply_route`, base weights restored after). Trajectories sorted by id; their
    `policy_id` and `adapter` name the adapter or merge each ran with.

    `memo` (greedy decoding only): an episode at temperature 0 is a function of its task and the
    weights it runs under, so methods that send a task to the same weights (TRACE routing a task to
    adapter A, `single` running A everywhere, the oracle, the base model for `none`) share one episode
    instead of decoding it again (keys: `memo_key`). `env_name` names the environment the tasks belong to."""
    if memo is not None and rollout_cfg.temperature != 0:
        raise ValueError("episodes can be shared between methods only at temperature 0")
    out: list[Trajectory] = []
    for weights, group in route_groups(tasks, routing):
        keys = {t.id: memo_key(env_name, weights, t.id) for t in group}
        todo = group if memo is None else [t for t in group if keys[t.id] not in memo]
        if todo:
            with apply_route(policy, weights):
                trajs, _ = collect_rollouts(policy, env_factory, todo, rollout_cfg, seed,
                                            adapter=route_label(weights), progress=progress)
            if memo is None:
                out.extend(trajs)
            else:
                for t in todo:
                    memo[keys[t.id]] = [x for x in trajs if x.task_id == t.id]
        if memo is not None:
            out.extend(x for t in group for x in memo[keys[t.id]])
    return sorted(out, key=lambda t: t.id)


def routes_in_one_batch(policy: Any) -> str | None:
    """None when `decode_into_memo` can decode episodes of different weights in one batch with this policy;
    else why it decodes them weight by weight."""
    if not getattr(policy, "plays_turns", False) or not hasattr(policy, "play_turns"):
        return "the policy does not play turns (a server, or a model without a buffered cache)"
    from trace_lib.engine.row_lora import supports_routes

    return supports_routes(policy.model)


def decode_into_memo(policy: Any, tasks: Sequence[Task], env_factory: Callable[[], Environment],
                     rollout_cfg: RolloutConfig, seed: int, routings: Sequence[Routing], memo: EpisodeMemo,
                     env_name: str = "", progress: bool = False) -> int:
    """Decode now every episode that `evaluate_policy(..., memo=memo)` will need for `tasks` under each of
    `routings`, all in one batch whose rows run under different weights (`collect_routed_rollouts`), and
    store them in `memo`; returns the number of (weights, task) pairs decoded. The batch is refilled as
    episodes end and turns start as others still decode (`Policy.play_turns`), whatever
    `rollout.continuous_batching` says (which only chooses how one method's episodes are decoded).

    A method's episodes are then the same computation as `evaluate_policy` decoding that method's tasks as a
    batch of their own, up to float rounding (a row's numbers depend on the batch's shape in bf16), at the
    cost of one batch: a decoding step on a CPU costs about the same for 16 rows as for 1. Nothing is
    decoded (0) where the policy cannot (`routes_in_one_batch`); `evaluate_policy` then decodes method by
    method."""
    if rollout_cfg.temperature != 0:
        raise ValueError("episodes can be shared between methods only at temperature 0")
    why = routes_in_one_batch(policy)
    if why is not None:
        log.info("methods decoded one by one, not in one batch: %s", why)
        return 0
    jobs: dict[tuple, tuple[Task, dict[str, float]]] = {}
    for routing in routings:
        for weights, group in route_groups(tasks, routing):
            for task in group:
                key = memo_key(env_name, weights, task.id)
                if key not in memo:
                    jobs.setdefault(key, (task, weights))
    if not jobs:
        return 0
    per_job, _ = collect_routed_rollouts(policy, env_factory, list(jobs.values()), rollout_cfg, seed, progress)
    for key, trajs in zip(jobs, per_job, strict=True):
        memo[key] = trajs
    return len(jobs)


# --- routing ----------------------------------------------------------------------------------------
def task_openings(tasks: Sequence[Task], env_factory: Callable[[], Environment]) -> list[str]:
    """The customer's first message of each task, as the environment opens the episode."""
    env = env_factory()
    return [task_opening(env.reset(task)) for task in tasks]


def route_all(policy: Any, tasks: Sequence[Task], candidates: Sequence[RouteCandidate], cfg: EvaluateConfig,
              env_factory: Callable[[], Environment], index: RetrievalIndex | None = None,
              knn: KnnRouter | None = None, router: RouterName | None = None) -> list[RouteDecision]:
    """Argmax decisions for every task by `router` (default `cfg.router`; the router scores each task
    once, `with_top_p` derives the top-p weights from the same probabilities). `knn` is the kNN router's
    labelled train tasks (needed for router 'knn')."""
    router = router or cfg.router
    return route_by(policy, tasks, candidates, cfg, env_factory, (router,), index, knn)[router]


def route_by(policy: Any, tasks: Sequence[Task], candidates: Sequence[RouteCandidate], cfg: EvaluateConfig,
             env_factory: Callable[[], Environment], routers: Sequence[RouterName],
             index: RetrievalIndex | None = None, knn: KnnRouter | None = None) -> dict[str, list[RouteDecision]]:
    """Each of `routers`' argmax decisions for every task (see `route_all`), from one pass over the
    openings: `calibrated` recalibrates the `logits` router's probabilities instead of scoring again."""
    if not tasks:
        return {r: [] for r in routers}
    openings, ids = task_openings(tasks, env_factory), [t.id for t in tasks]
    k = cfg.retrieval_k if index is not None else None
    batch = cfg.batch_size or 8
    out: dict[str, list[RouteDecision]] = {}
    if "knn" in routers:
        if knn is None:
            raise ValueError("evaluate.router 'knn' needs the score stage's labels of the train rollouts")
        per_task = [[c.capability_id for c in cs] for cs in candidates_per_task(openings, candidates, index, k)]
        out["knn"] = knn_decisions(knn, openings, per_task, cfg.knn_k, "argmax", cfg.top_p, ids)
    if {"logits", "calibrated"} & set(routers):
        out["logits"] = route_tasks(policy, openings, candidates, mode="argmax", top_p=cfg.top_p, index=index, k=k,
                                    task_ids=ids, batch_size=batch)
    if "calibrated" in routers:
        out["calibrated"] = calibrated_decisions(policy, out["logits"], candidates, "argmax", cfg.top_p, batch)
    return {r: out[r] for r in routers}


def with_top_p(decisions: Sequence[RouteDecision], p: float) -> list[RouteDecision]:
    """The same router probabilities read with top-p instead of argmax."""
    return [d.model_copy(update={"mode": "top_p", "weights": route_top_p(d.probs, d.candidates, p)})
            for d in decisions]


def oracle_decisions(tasks: Sequence[Task], adapters: Sequence[str],
                     routes: Mapping[str, str | None] | None = None) -> dict[str, dict[str, float]]:
    """Task id -> weights of the oracle router ({} = base): `routes` (task id -> adapter or None, e.g. the
    capability labelled lacking: `routers.lacking_labels`) where given, else the task's capability tags."""
    out = {}
    for t in tasks:
        best = routes.get(t.id) if routes is not None else oracle_route(t, adapters)
        out[t.id] = {} if best is None else {best: 1.0}
    return out


def routing_quality(decisions: Sequence[RouteDecision], tasks: Sequence[Task], adapters: Sequence[str],
                    seed: int = 0, solved: Collection[str] | None = None,
                    solvers: Mapping[str, Collection[str]] | None = None,
                    oracle: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """Router vs oracle: confusion counts (oracle row, router column; 'none' = base model), accuracy of
    the router, of a seeded uniform random router over the same candidates (plus that random router's
    expected accuracy) and of the best constant router (always the oracle's most common label). The
    oracle is `oracle` (task id -> adapter or None: the capability labelled lacking; tasks it does not
    list are not scored) where given, else the tasks' capability tags (untagged tasks, τ²'s, not scored).
    `solved`: ids of tasks the base model solves; `solved_on_none` is the share of them the router
    leaves on the base model.

    `solvers` (task id -> the routes that solved it, 'none' for the base model: `tables.route_solvers`):
    `solvable_tasks` counts the routed tasks some route solved, `router_solvable_hits` the share of them
    the router sent to a route that solved it, `oracle_solvable_hits` the same for the oracle (on the
    tasks it routes)."""
    wanted = ({t.id: oracle[t.id] if oracle[t.id] in adapters else NONE for t in tasks if t.id in oracle}
              if oracle is not None else
              {t.id: oracle_route(t, adapters) or NONE for t in tasks if t.capability_tags})
    by_id = {d.task_id: d for d in decisions}
    labels = [*sorted(adapters), NONE]
    confusion = {o: {r: 0 for r in labels} for o in labels}
    hits = rand_hits = 0
    expected = 0.0
    scored = 0
    for task in tasks:
        d = by_id.get(task.id)
        if d is None or task.id not in wanted:
            continue
        want = wanted[task.id]
        routed = route_argmax(d.probs, d.candidates) or NONE
        rand = random_route(task.id, d.candidates, seed) or NONE
        confusion[want][routed] += 1
        scored += 1
        hits += routed == want
        rand_hits += rand == want
        expected += (want in d.candidates or want == NONE) / (len(d.candidates) + 1)
    routed_none = {d.task_id for d in decisions if route_argmax(d.probs, d.candidates) is None}
    solvable = [d for d in decisions if solvers and solvers.get(d.task_id)]
    oracle_solvable = [d for d in solvable if d.task_id in wanted]
    masses = [d.label_mass for d in decisions if d.label_mass is not None]
    majority = max((sum(row.values()) for row in confusion.values()), default=0)
    solved_ids = sorted(set(solved or ()) & set(by_id))
    return {
        "router": decisions[0].router if decisions else None,
        "tasks": len(decisions), "scored": scored, "labels": labels, "confusion": confusion,
        "router_accuracy": hits / scored if scored else None,
        "random_accuracy": rand_hits / scored if scored else None,
        "random_expected": expected / scored if scored else None,
        "majority_accuracy": majority / scored if scored else None,
        "none_share": len(routed_none) / len(decisions) if decisions else None,
        "solved_tasks": len(solved_ids) if solved is not None else None,
        "solved_on_none": (sum(t in routed_none for t in solved_ids) / len(solved_ids)) if solved_ids else None,
        "mean_label_mass": sum(masses) / len(masses) if masses else None,
        "solvable_tasks": len(solvable) if solvers is not None else None,
        "router_solvable_hits": (sum((route_argmax(d.probs, d.candidates) or NONE) in solvers[d.task_id]
                                     for d in solvable) / len(solvable)) if solvable else None,
        "oracle_solvable_hits": (sum(wanted[d.task_id] in solvers[d.task_id] for d in oracle_solvable)
                                 / len(oracle_solvable)) if oracle_solvable else None,
        "oracle": "tags" if oracle is None else "labels",
        "note": "" if scored else ("no task carries capability tags (τ² tasks): router accuracy is undefined"
                                   if oracle is None else "the oracle routes none of these tasks: router accuracy "
                                                          "is undefined"),
    }


# --- interference -----------------------------------------------------------------------------------
def interference_matrix(policy: Any, adapters: Sequence[str],
                        envs: Mapping[str, tuple[Callable[[], Environment], Sequence[Task]]],
                        rollout_cfg: RolloutConfig, seed: int, progress: bool = False,
                        together: bool = False) -> list[dict[str, Any]]:
    """Success of the base model and of each adapter on each capability's environment (long form:
    one dict per adapter x env with n, successes, success_rate; adapters outer, envs inner).

    `together` (greedy decoding and a policy that can, `routes_in_one_batch`): an environment's episodes of the
    base model and of every adapter are decoded in one batch whose rows run under different weights
    (`decode_into_memo`), as the methods' are: weight by weight, each batch would hold one environment's few
    seeds (docs/LOG.md, "the evaluate stage"). Rows meet other rows, so in bf16 an episode may round
    differently from the one decoded weight by weight; in fp32 it is the same."""
    memo: EpisodeMemo | None = {} if together and rollout_cfg.temperature == 0 else None
    if memo is not None:  # decodes nothing where the policy cannot mix weights: then weight by weight below
        for env_name, (factory, tasks) in envs.items():
            decode_into_memo(policy, tasks, factory, rollout_cfg, seed, [None, *adapters], memo, env_name, progress)
    rows = []
    for name in [None, *adapters]:
        for env_name, (factory, tasks) in envs.items():
            trajs = evaluate_policy(policy, tasks, factory, rollout_cfg, seed, name, progress, memo=memo,
                                    env_name=env_name)
            k = sum(t.success for t in trajs)
            rows.append({"adapter": name or "base", "env": env_name, "n": len(trajs), "successes": k,
                         "success_rate": k / len(trajs) if trajs else None})
    return rows
