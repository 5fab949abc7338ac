"""The evaluation's methods as rows, and running them: each method's weights per task, its rollout budget, or why
it cannot run; the router's decisions; the rows' episodes.

Reads the adapters' budgets (`trace_lib.budget.adapter_budget`) and, through `router_side`, the run's records;
writes only the labels oracle's labels. The evaluate stage (`stages/evaluate.py`) collects a `MethodSpec` per row
with `MethodSpecs.add`, in Table 1's order, has the routers route the tasks (`route_tasks`), then runs the rows
(`run_specs`): every method's greedy episodes can then be decoded together before the rows are assembled;
`router_quality` scores the routers against the oracle and random routing.

The methods (`evaluate.methods`; paper §4):

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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_lib.budget import DISTILLED, adapter_budget
from trace_lib.config import EnvConfig, EvaluateConfig, RolloutConfig
from trace_lib.envs import make_env
from trace_lib.envs.base import Environment
from trace_lib.evaluation.gepa import with_prompt
from trace_lib.evaluation.router_side import (
    ROUTERS,
    LabelsOracle,
    chosen_router,
    router_candidates,
    singles_on_validation,
    train_side,
    validation_routing,
)
from trace_lib.evaluation.runner import EpisodeMemo, decode_into_memo, evaluate_policy
from trace_lib.evaluation.tables import MethodRun, hindsight_route, route_solvers
from trace_lib.paths import Paths
from trace_lib.records import Task, Trajectory
from trace_lib.routing.decide import oracle_decisions, route_by, routing_quality, with_top_p
from trace_lib.routing.route import RouteDecision

RoutingFor = Callable[[EnvConfig, list[Task]], Any]
"""A method's weights for one environment's tasks (`evaluation.runner.Routing`): None, an adapter, {adapter: α},
or a decision per task."""

TRAINED_BY = {"grpo_target": "train.baselines", "grpo_target_late": "train.baselines",
              "merged_data": "train.baselines", "distilled": "train.distill.iterations"}
"""The params that train a method's adapter, named when the profile leaves the method out."""

BASELINES = (("grpo_target", "GRPO on target"), ("grpo_target_late", "GRPO on target (reads played)"),
             ("merged_data", "merged data (one adapter)"))
"""The baselines trained at TRACE's rollout budget, with their row labels."""


@dataclass(frozen=True)
class MethodSpec:
    """One row of the evaluation: run under `routing_for` when `reason` is None, else kept with its reason."""

    method: str
    """The `evaluate.methods` name it belongs to."""
    key: str
    label: str
    reason: str | None = None
    routing_for: RoutingFor | None = None
    budget_n: int | None = None
    """The training episodes behind the method."""
    source: str = ""
    """Where `budget_n` comes from."""
    prompts: Mapping[str, str] | None = None
    """Another system prompt per environment (GEPA's); its episodes are never shared with the other rows'."""


class MethodSpecs(list):
    """The rows in the order they are added; a method the profile leaves out keeps its row with the reason."""

    def __init__(self, wanted: Sequence[str], profile: str) -> None:
        super().__init__()
        self.wanted = set(wanted)
        self.profile = profile

    def add(self, method: str, key: str, label: str, reason: str | None = None, routing_for: RoutingFor | None = None,
            budget_n: int | None = None, source: str = "", prompts: Mapping[str, str] | None = None) -> None:
        if method not in self.wanted:  # what runs it beats why it could not have run
            trained = TRAINED_BY.get(method)
            reason = (f"left out of the {self.profile} profile: add {method!r} to evaluate.methods"
                      + (f" (and set {trained})" if trained else "") + (f"; {reason}" if reason else ""))
        self.append(MethodSpec(method, key, label, reason, routing_for, budget_n, source, prompts))

    @staticmethod
    def trace_budget(total: int) -> dict[str, Any]:
        """The budget of a row that runs on TRACE's adapters: TRACE's whole total."""
        return {"budget_n": total, "source": "TRACE adapters"}

    def add_baselines(self, baselines: Mapping[str, Path], root: Path) -> None:
        """The baselines trained at TRACE's budget, each with its adapter's budget or where its adapter is missing."""
        paths = Paths(root)
        for name, label in BASELINES:
            if name in baselines:
                n, src = adapter_budget(root, name, baseline=True)
                self.add(name, name, label, routing_for=lambda e, ts, a=name: a, budget_n=n, source=src)
            else:
                self.add(name, name, label, f"no adapter at {paths.adapter(name, True).relative_to(root)} "
                                            "(train it at TRACE's budget: trace_lib.budget.trace_budget)")

    def add_merges_and_singles(self, names: Sequence[str], no_caps: str | None, budget: Mapping[str, Any]) -> None:
        """The linear merge of the capability adapters, and each adapter alone on every task."""
        trace = self.trace_budget(budget["total"])
        self.add("linear_merge", "linear_merge", "linear merge (α = 1/n)",
                 no_caps or ("one capability adapter: its merge is the single adapter" if len(names) < 2 else None),
                 lambda e, ts: {n: 1 / len(names) for n in names}, **trace)
        if no_caps or "single" not in self.wanted:
            self.add("single", "single", "single-capability", no_caps)
        else:
            for name in names:
                self.add("single", f"single_{name}", f"single: {name}", None, lambda e, ts, a=name: a,
                         budget["by_adapter"][name], "its own training")

    def add_oracle(self, oracle: str, names: Sequence[str], no_caps: str | None, tasks: Sequence[Task],
                   budget_total: int, labelled: Callable[[], Mapping[str, str | None]]) -> None:
        """Oracle routing (`evaluate.oracle`): by the tasks' capability tags, or by the labels oracle (`labelled`,
        called once the base model's episodes are there)."""
        trace = self.trace_budget(budget_total)
        if oracle == "tags":
            self.add("oracle_route", "oracle_route", "oracle routing (task tags)",
                     no_caps or (None if any(t.capability_tags for t in tasks) else "the tasks carry no capability tags"),
                     lambda e, ts: oracle_decisions(ts, list(names)), **trace)
        else:
            self.add("oracle_route", "oracle_route", "oracle routing (lacking capability)",
                     no_caps or (None if "base" in self.wanted else "evaluate.oracle 'labels' reads the base model's "
                                                                    "episodes: add base to evaluate.methods"),
                     lambda e, ts: oracle_decisions(ts, list(names), labelled()), **trace)

    def add_distilled(self, baselines: Mapping[str, Path], no_caps: str | None, budget_total: int, root: Path) -> None:
        """The student distilled from the capability adapters: TRACE's budget and its own episodes."""
        if DISTILLED in baselines:
            n, src = adapter_budget(root, DISTILLED, baseline=True)
            self.add("distilled", "distilled", "TRACE distilled (one adapter)", routing_for=lambda e, ts: DISTILLED,
                     budget_n=budget_total + n, source=f"TRACE adapters + {src}")
        else:
            self.add("distilled", "distilled", "TRACE distilled (one adapter)",
                     no_caps or f"no adapter at {Paths(root).adapter(DISTILLED, True).relative_to(root)} "
                                "(train.distill)")

    def add_trace(self, route_mode: str, no_caps: str | None, decisions: Mapping[str, Any],
                  budget_total: int) -> None:
        """TRACE's rows (`evaluate.route_mode`): the router's argmax decisions and their top-p merges (`decisions`,
        filled in by the router before the rows run)."""
        for mode in ("argmax", "top_p"):
            key = f"trace_{mode}"
            off = None if route_mode in (mode, "both") else f"evaluate.route_mode is {route_mode!r}"
            self.add("trace", key, f"TRACE ({mode.replace('_', '-')})", no_caps or off,
                     lambda e, ts, k=key: decisions[k], **self.trace_budget(budget_total))

    def plans(self, oracle: str) -> list[RoutingFor]:
        """The rows whose greedy episodes can be decoded together up front: those that run on the shared memo (no
        other system prompt), less the labels oracle's, which needs the base model's episodes first."""
        return [s.routing_for for s in self if s.reason is None and s.prompts is None
                and not (s.method == "oracle_route" and oracle == "labels")]


class Evaluation:
    """An evaluation in progress: the policy, the targets' tasks (`eval_targets`), the evaluation's rollout settings
    (`eval_rollout_config`), TRACE's budget, the methods' runs and the router's decisions."""

    def __init__(self, policy: Any, root: Path, names: list[str], cfg: EvaluateConfig, env: EnvConfig,
                 rcfg: RolloutConfig, targets: list[tuple[EnvConfig, list[Task]]], budget: dict[str, Any],
                 oracle: LabelsOracle, progress: bool) -> None:
        self.policy, self.root, self.names, self.cfg, self.env = policy, root, names, cfg, env
        self.rcfg, self.targets, self.budget, self.progress, self.oracle = rcfg, targets, budget, progress, oracle
        self.tasks = [t for _, ts in targets for t in ts]
        self.runs: list[MethodRun] = []
        self.decisions: dict[str, list[RouteDecision]] = {}
        self.memo: EpisodeMemo | None = {} if rcfg.temperature == 0 else None
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


def route_tasks(ev: Evaluation, boxes: Mapping[str, Any], routers: dict[str, dict[str, Any]], rollout_cfg: RolloutConfig,
                rollout_split: str, seed_offset: int, difficulty: int) -> tuple:
    """Every router on the test and train tasks (`rollout.split`'s rollouts), and on validation where there is a
    validation split; fills in TRACE's decisions (`ev.decisions`) and the routers' validation records. Returns (the
    chosen router, the routers scored, test decisions, train decisions, train tasks, those the base agent solved,
    the train labels oracle)."""
    cfg = ev.cfg
    candidates, index = router_candidates(ev.root, ev.names, boxes, cfg, ev.env, seed_offset, difficulty)
    rc = cfg.model_copy(update={"batch_size": ev.rcfg.batch_size})
    train_tasks, train_solved, knn, train_lacking = train_side(ev.root, ev.env, rollout_split, ev.names)
    scored = [r for r in ROUTERS if r != "knn" or knn is not None]
    if knn is None:
        routers["knn"] = {"note": "no score-stage labels of the train rollouts"}
    test = {r: [] for r in scored}
    for ecfg, ts in ev.targets:
        for r, ds in route_by(ev.policy, ts, candidates, rc, lambda e=ecfg: make_env(e), scored, index, knn).items():
            test[r] += ds
    train = route_by(ev.policy, train_tasks, candidates, rc, lambda: make_env(ev.env), scored, index, knn)
    if ev.env.validation_fraction:
        for r, q in validation_routing(ev.policy, ev.oracle, ev.env, rollout_cfg, candidates, rc, scored,
                                       index, knn).items():
            routers.setdefault(r, {})["validation"] = q
    chosen = chosen_router(cfg.router, routers, scored)
    for r in scored:
        ev.decisions[f"router_{r}"] = test[r]
    ev.decisions["trace_argmax"] = ev.decisions.pop(f"router_{chosen}")
    ev.decisions["trace_top_p"] = with_top_p(ev.decisions["trace_argmax"], cfg.top_p)
    return chosen, scored, test, train, train_tasks, train_solved, train_lacking


def run_specs(ev: Evaluation, specs: MethodSpecs) -> int:
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
    if len(singles) > 1 and ev.env.validation_fraction:  # the best single adapter, chosen on validation
        played = singles_on_validation(ev.policy, ev.env, [r.key.removeprefix("single_") for r in singles],
                                       ev.rcfg, cfg.seed)
        for r in singles:
            r.validation = played[r.key.removeprefix("single_")]
    bound = hindsight_route(ev.runs, ev.budget["total"])  # what a perfect argmax router could solve
    ev.runs += [bound] if bound is not None else []
    return decoded_together


def router_quality(ev: Evaluation, routed: tuple, routers: dict[str, dict[str, Any]]) -> dict[str, Any]:
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
