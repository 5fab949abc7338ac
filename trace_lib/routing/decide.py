"""A router's decisions on target tasks and how good they are (paper §3.4, §4).

`route_by` scores each task's opening with the routers asked for (the base model's label logits,
their calibrated form, the kNN vote over labelled train tasks) and returns argmax decisions; `with_top_p`
reads the same probabilities with top-p; `oracle_decisions` is the oracle router (the capability labelled
lacking, or the task tags); `routing_quality` scores decisions against that oracle, a seeded random
router and the best constant router. Reads and writes nothing on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from trace_lib.config import EvaluateConfig
from trace_lib.envs.base import Environment
from trace_lib.records import NONE_ROUTE, RouterName, Task
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
    wanted = ({t.id: oracle[t.id] if oracle[t.id] in adapters else NONE_ROUTE for t in tasks if t.id in oracle}
              if oracle is not None else
              {t.id: oracle_route(t, adapters) or NONE_ROUTE for t in tasks if t.capability_tags})
    by_id = {d.task_id: d for d in decisions}
    labels = [*sorted(adapters), NONE_ROUTE]
    confusion = {o: {r: 0 for r in labels} for o in labels}
    hits = rand_hits = 0
    expected = 0.0
    scored = 0
    for task in tasks:
        d = by_id.get(task.id)
        if d is None or task.id not in wanted:
            continue
        want = wanted[task.id]
        routed = route_argmax(d.probs, d.candidates) or NONE_ROUTE
        rand = random_route(task.id, d.candidates, seed) or NONE_ROUTE
        confusion[want][routed] += 1
        scored += 1
        hits += routed == want
        rand_hits += rand == want
        expected += (want in d.candidates or want == NONE_ROUTE) / (len(d.candidates) + 1)
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
        "router_solvable_hits": (sum((route_argmax(d.probs, d.candidates) or NONE_ROUTE) in solvers[d.task_id]
                                     for d in solvable) / len(solvable)) if solvable else None,
        "oracle_solvable_hits": (sum(wanted[d.task_id] in solvers[d.task_id] for d in oracle_solvable)
                                 / len(oracle_solvable)) if oracle_solvable else None,
        "oracle": "tags" if oracle is None else "labels",
        "note": "" if scored else ("no task carries capability tags (τ² tasks): router accuracy is undefined"
                                   if oracle is None else "the oracle routes none of these tasks: router accuracy "
                                                          "is undefined"),
    }
