"""Running methods on target tasks: routed evaluation, router quality, adapter interference (paper §4).

Reads and writes nothing on disk; the evaluate stage (`stages/evaluate.py`) and the scaling stage
call it. A method is the base model under some `Routing` (see `route_groups`): no adapter, one adapter on
every task, one fixed merge, or per-task router decisions (`compose.apply_route` puts each weight state
in place and restores the base weights after). `evaluate_policy` runs it, sharing greedy episodes
between methods that send a task to the same weights (the router's own decisions are made and scored in
`trace_lib.routing.decide`), and `interference_matrix` runs every adapter on every capability's synthetic
environment.

Evaluation decodes greedily by default (the paper: one trial, temperature 0), so two methods differ
only by their weights and the paired tests compare like with like.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trace_lib.agent.rollout import collect_rollouts, collect_routed_rollouts
from trace_lib.config import EnvConfig, EvaluateConfig, RolloutConfig
from trace_lib.envs import load_tasks, task_split
from trace_lib.envs.base import Environment
from trace_lib.records import Task, Trajectory
from trace_lib.engine.adapters import canonical_weights, route_label
from trace_lib.engine.compose import apply_route
from trace_lib.routing.route import RouteDecision

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
