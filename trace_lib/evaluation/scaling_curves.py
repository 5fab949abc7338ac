"""The scaling stage's curves: success at each budget point for TRACE and GRPO on the target, and GEPA's point.

Reads nothing itself: the stage (`stages/scaling.py`) passes the evaluate stage's episodes and decisions, the budget
points (`evaluation.scaling.budget_points`) and a `PointDecoder`, which plays the episodes of the intermediate points
(the snapshots of the adapters; greedy episodes reused where a point's weights equal those of episodes already
played). Writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trace_lib.config import EnvConfig, EvaluateConfig, RolloutConfig
from trace_lib.engine.adapters import adapter_is_identity
from trace_lib.envs import make_env
from trace_lib.evaluation.runner import decode_into_memo, evaluate_policy, memo_key
from trace_lib.evaluation.scaling import point_routing, point_row, routed_adapters, snapshot_name
from trace_lib.records import RouteDecision, Task, Trajectory

Points = list[dict[str, Any]]


@dataclass
class PointDecoder:
    """Plays the episodes of intermediate budget points: each task under its chosen adapters' snapshots.

    `open_policy(adapters)` loads the model with those adapters ({name: folder}); `folders`: each adapter's final
    folder. A snapshot that is the base model (`adapter_is_identity`) is left out of a task's weights (its delta is
    zero) and never loaded; its name is added to `same_as_base`. The iteration of each point with a task still to
    decode is added to `decoded`."""

    open_policy: Callable[[dict[str, str]], Any]
    folders: Mapping[str, Path]
    rcfg: RolloutConfig
    """The evaluation's rollout settings (`eval_rollout_config`)."""
    make_targets: Callable[[], list[tuple[EnvConfig, list[Task]]]]
    """The evaluation's targets (`eval_targets`), made when a point is decoded."""
    cfg: EvaluateConfig
    progress: bool = False
    same_as_base: list[str] = field(default_factory=list)
    decoded: list[int | str] = field(default_factory=list)

    def known_memo(self, targets: list[tuple[EnvConfig, list[Task]]], choices: dict[str, list[str]],
                   known: Sequence[tuple[Sequence[Trajectory], dict[str, Any]]]) -> dict | None:
        """At temperature 0, the episodes already played as the memo (`known`: each with the point it was played
        at, `{}` the base model); the first source that played a task under some weights is its entry."""
        if self.rcfg.temperature != 0:
            return None
        memo: dict = {}
        for trajs, point in known:
            played = point_routing(choices, point) if point else {}
            these: dict[tuple, list[Trajectory]] = {}
            for env_cfg, tasks in targets:
                ids = {t.id for t in tasks}
                for t in trajs:
                    if t.task_id in ids:
                        these.setdefault(memo_key(env_cfg.name, played.get(t.task_id, {}), t.task_id), []).append(t)
            for key, episodes in these.items():
                memo.setdefault(key, episodes)
        return memo

    def __call__(self, todo: Points, choices: dict[str, list[str]],
                 known: Sequence[tuple[Sequence[Trajectory], dict[str, Any]]]) -> dict[int, list[Trajectory]]:
        """Episodes at each point of `todo` (keyed by its total). A final adapter is kept in the weights whatever
        its delta, as the evaluate stage keeps it. At temperature 0 a task under the weights of a `known` point
        reuses its episode, and only the adapters of the other tasks are loaded (none: the model is not loaded)."""
        staged = {snapshot_name(p, c): s.path for p in todo for c, s in p["adapters"].items()
                  if s not in (None, "final")}
        snapshots = {**staged, **{snapshot_name(p, c): self.folders[c] for p in todo for c, s in p["adapters"].items()
                                  if s == "final"}}
        identity = {name for name, path in staged.items() if adapter_is_identity(path)}  # each snapshot read once
        self.same_as_base += sorted(identity)
        targets = self.make_targets()
        memo = self.known_memo(targets, choices, known)
        routings = {p["total"]: {task: {a: x for a, x in w.items() if a not in identity}
                                 for task, w in point_routing(choices, p).items()} for p in todo}

        def task_routing(p: dict, tasks: Sequence[Task]) -> dict[str, dict[str, float]]:
            """Point `p`'s weights for each of `tasks` ({} for a task its routing leaves on the base model)."""
            return {t.id: routings[p["total"]].get(t.id, {}) for t in tasks}

        needed = self._still_to_decode(targets, todo, memo, task_routing)
        policy = None if needed is None else self.open_policy({n: str(snapshots[n]) for n in sorted(needed)})
        if memo is not None and policy is not None and self.cfg.decode_together:  # every point's new episodes at once
            for env_cfg, tasks in targets:
                decode_into_memo(policy, tasks, lambda e=env_cfg: make_env(e), self.rcfg, self.cfg.seed,
                                 [task_routing(p, tasks) for p in todo], memo, env_cfg.name, self.progress)
        out = {}
        for p in todo:
            trajs: list[Trajectory] = []
            for env_cfg, tasks in targets:
                trajs += evaluate_policy(policy, tasks, lambda e=env_cfg: make_env(e), self.rcfg, self.cfg.seed,
                                         task_routing(p, tasks), self.progress, memo, env_cfg.name)
            out[p["total"]] = trajs
        return out

    def _still_to_decode(self, targets: list[tuple[EnvConfig, list[Task]]], todo: Points, memo: dict | None,
                         task_routing: Callable) -> set[str] | None:
        """The adapters the episodes still to decode need, or None when every episode is reused; records the
        points with episodes to decode in `decoded`."""
        needed: set[str] = set()
        seen = set(memo or ())
        before = len(self.decoded)
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
                self.decoded.append(p["iteration"])
        return None if len(self.decoded) == before else needed


def _intermediate(points: Points) -> Points:
    return [p for p in points if p["iteration"] not in (0, None)]


def trace_curve(points: Points, base: list[Trajectory] | None, final: list[Trajectory] | None,
                decisions: list[RouteDecision] | None, evaluated: Mapping[str, Any], cfg: EvaluateConfig,
                decode: PointDecoder) -> tuple[list[dict[str, Any]], dict[str, list[Trajectory]]]:
    """TRACE's rows, one per budget point, and the episodes of its intermediate points by 'trace@<total>'. Budget 0
    is the base model's episodes and the last point the evaluate stage's TRACE row; a task on a final adapter at a
    staggered point runs as in that row."""
    methods = evaluated["methods"]
    if base is None:
        reason = methods.get("base", {}).get("reason") or "the base model was not evaluated"
        return [point_row("TRACE", p["total"], p["iteration"], None, reason) for p in points], {}
    if decisions is None or final is None:
        reason = "TRACE (argmax) was not evaluated: " + methods.get("trace_argmax", {}).get("reason", "")
        return ([point_row("TRACE", 0, 0, base, "", cfg.n_boot, cfg.ci_level, cfg.seed)]
                + [point_row("TRACE", p["total"], p["iteration"], None, reason) for p in points[1:]]), {}
    choices = routed_adapters(decisions)
    by_point = {points[-1]["total"]: final, 0: base}
    todo = _intermediate(points)
    if todo:
        by_point.update(decode(todo, choices, [(base, {}), (final, points[-1])]))
    rows, written = [], {}
    for p in points:
        trajs = by_point[p["total"]]
        rows.append(point_row("TRACE", p["total"], p["iteration"], trajs, "", cfg.n_boot, cfg.ci_level, cfg.seed))
        if p["iteration"] not in (0, None):
            written[f"trace@{p['total']}"] = trajs
    return rows, written


def grpo_curve(points: Points | None, base: list[Trajectory] | None, final: list[Trajectory] | None,
               evaluated: Mapping[str, Any], budget_total: int, cfg: EvaluateConfig, decode: PointDecoder
               ) -> tuple[list[dict[str, Any]], dict[str, list[Trajectory]]]:
    """GRPO on the target's rows: one adapter on every task, at each of its snapshots (`points`, None where it was
    not trained) too; or one row saying why there is no curve."""
    if points is None or final is None or base is None:
        reason = evaluated["methods"].get("grpo_target", {}).get("reason") or "not evaluated"
        return [point_row("GRPO on target", budget_total, None, None, reason)], {}
    everyone = {t.task_id: ["grpo_target"] for t in base}
    by_point = {points[-1]["total"]: final, 0: base}
    todo = _intermediate(points)
    if todo:
        by_point.update(decode(todo, everyone, [(base, {})]))
    rows, written = [], {}
    for p in points:
        rows.append(point_row("GRPO on target", p["total"], p["iteration"], by_point[p["total"]], "",
                              cfg.n_boot, cfg.ci_level, cfg.seed))
        if p["iteration"] not in (0, None):
            written[f"grpo_target@{p['total']}"] = by_point[p["total"]]
    return rows, written


def gepa_point(trajs: list[Trajectory] | None, evaluated: Mapping[str, Any], budget_total: int,
               cfg: EvaluateConfig) -> dict[str, Any]:
    """GEPA's row: its final prompt at the rollouts it spent, or why it did not run."""
    gepa = evaluated["methods"].get("gepa", {})
    if gepa.get("status") == "run" and trajs is not None:
        return point_row("GEPA", int(gepa.get("rollouts") or 0), None, trajs, "", cfg.n_boot, cfg.ci_level, cfg.seed)
    return point_row("GEPA", budget_total, None, None, gepa.get("reason") or "not evaluated")
