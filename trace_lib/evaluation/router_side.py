"""The router's side of the evaluation: what each router sees, how it is scored, and which one drives TRACE's rows.

Reads the run's records (kept capabilities, the rollout stage's episodes, the score stage's labels) and serves
synthesized environments from their sandboxes; writes only the labels oracle's labels (`LabelsOracle.route`, to
the path it is given). Called by the evaluate stage (`stages/evaluate.py`), which passes the sections it uses.

* `router_candidates`: each kept capability as a route (its description, and a solved example episode from its
  environment), and the retrieval index over its environment's openings (`evaluate.retrieval_k`).
* `train_side`: the rollout stage's train tasks, those the base agent solved, the kNN router over the score stage's
  labels, and each task's capability labelled lacking.
* `LabelsOracle`: the analyst labels the base model's episodes; each task goes to the capability labelled LACKING.
* `validation_routing`, `singles_on_validation`: the routers and the single adapters on the validation split.
* `chosen_router`: `evaluate.router`, or for 'auto' the best on validation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from trace_lib.analyst.score import label_trajectories
from trace_lib.config import AnalystConfig, EnvConfig, EvaluateConfig, RolloutConfig, ScoreConfig
from trace_lib.envs import load_tasks, make_env, make_tasks, task_split
from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks
from trace_lib.evaluation import inputs
from trace_lib.evaluation.runner import INTERFERENCE_SEED0, eval_rollout_config, evaluate_policy
from trace_lib.io import read_jsonl, write_jsonl
from trace_lib.llm import analyst_client
from trace_lib.paths import Paths
from trace_lib.records import Capability, Label, RouterName, Task, Trajectory
from trace_lib.routing.decide import route_by, routing_quality, task_openings
from trace_lib.routing.route import RetrievalIndex, RouteCandidate, make_candidate
from trace_lib.routing.routers import KnnRouter, lacking_labels
from trace_lib.sandbox import SandboxLimits, SandboxProcess

ROUTERS: tuple[RouterName, ...] = get_args(RouterName)
"""Every router is scored on the train and test splits; `evaluate.router` drives the TRACE rows."""


def open_sandboxes(stack: ExitStack, root: Path, limits: SandboxLimits, names: list[str],
                   envs: Mapping[str, Any]) -> dict:
    """A sandbox per capability in `names`, serving its synthesized environment (`envs`: its manifest), closed
    with `stack`."""
    if not names:
        return {}
    return {n: stack.enter_context(SandboxProcess(root / envs[n].path, limits)) for n in names}


def router_candidates(root: Path, names: list[str], boxes: Mapping[str, Any], cfg: EvaluateConfig,
                      env_cfg: EnvConfig, seed_offset: int, difficulty: int
                      ) -> tuple[list[RouteCandidate], RetrievalIndex | None]:
    """Each kept capability with an adapter as a route, with its environment's reference episode as the example
    when that episode succeeds (`train.seed_offset`, `synthesize.difficulty`), and the retrieval index over
    the environments' openings (None without `evaluate.retrieval_k` or environments)."""
    candidates = []
    for cap in inputs.kept_capabilities(root, names):
        example = None
        if cap.id in boxes:
            ref = inputs.reference_trajectory(boxes[cap.id], cap.id, env_cfg, seed_offset, difficulty)
            example = ref if ref.success else None
        candidates.append(make_candidate(cap, example))
    index = None
    if cfg.retrieval_k is not None and boxes:
        seeds = list(range(seed_offset, seed_offset + inputs.RETRIEVAL_EXAMPLES))
        items = [it for n, box in boxes.items() for it in inputs.retrieval_openings(box, n, seeds, difficulty)]
        index = RetrievalIndex.build(items)
    return candidates, index


def capability_order(root: Path, names: list[str]) -> list[str]:
    """The adapters' capabilities in the score stage's ranking (kept.jsonl; others after): who wins a tie."""
    paths = Paths(root)
    ranked = [c.id for c in read_jsonl(paths.kept, Capability)] if paths.kept.is_file() else []
    return sorted(names, key=lambda c: ranked.index(c) if c in ranked else len(ranked))


def train_side(root: Path, env_cfg: EnvConfig, rollout_split: str, names: list[str]
               ) -> tuple[list[Task], set[str], KnnRouter | None, dict[str, str | None] | None]:
    """The target's train tasks the rollout stage ran (`rollout.split`), the ids of those the base agent solved in
    some rollout, the kNN router over them and each task's capability labelled lacking (`lacking_labels`: the
    labels oracle on train); the last two None without score-stage labels."""
    paths = Paths(root)
    split = task_split(env_cfg.name, rollout_split)
    if not paths.rollouts(rollout_split).is_file():
        return [], set(), None, None
    trajs = read_jsonl(paths.rollouts(rollout_split), Trajectory)
    ran = {t.task_id for t in trajs}
    tasks = [t for t in load_tasks(env_cfg, split, root) if t.id in ran]
    solved = {t.task_id for t in trajs if t.success}
    if not paths.labels.is_file() or not tasks:
        return tasks, solved, None, None
    labels = lacking_labels(read_jsonl(paths.labels, Label), {t.id: t.task_id for t in trajs},
                            capability_order(root, names))
    openings = task_openings(tasks, lambda: make_env(env_cfg))
    return tasks, solved, KnnRouter([t.id for t in tasks], openings, [labels[t.id] for t in tasks]), labels


@dataclass(frozen=True)
class LabelsOracle:
    """The labels oracle: the analyst (`analyst`, `score.n_runs` for an LLM; its ledger data/evaluate/oracle_llm.jsonl)
    labels the base model's episodes for the capabilities with an adapter (`names`), and each task goes to the one
    labelled LACKING (most often; ties to the score stage's ranking), none where none is."""

    analyst: AnalystConfig
    score: ScoreConfig
    seed: int
    root: Path
    names: list[str]

    def route(self, base: Sequence[Trajectory], targets: Sequence[tuple[EnvConfig, Sequence[Task]]],
              out: Path | None = None) -> dict[str, str | None]:
        """Task id -> adapter or None, from the base model's episodes `base` of `targets`' tasks. The labels are
        written to `out` (None: the evaluation split's, data/evaluate/oracle_labels.jsonl)."""
        paths = Paths(self.root)
        caps = inputs.kept_capabilities(self.root, self.names)
        client = analyst_client(self.analyst, paths.oracle_llm, self.root, self.seed)
        labels: list[Label] = []
        for ecfg, ts in targets:
            ids = {t.id for t in ts}
            labels += label_trajectories([t for t in base if t.task_id in ids], caps, ts, make_env(ecfg).tool_kinds(),
                                         self.score, client, self.seed)
        write_jsonl(out or paths.oracle_labels, labels)
        return lacking_labels(labels, {t.id: t.task_id for t in base}, capability_order(self.root, self.names))


def validation_routing(policy: Any, oracle: LabelsOracle, env_cfg: EnvConfig, rollout_cfg: RolloutConfig,
                       candidates: list[RouteCandidate], rc: EvaluateConfig, scored: list[str],
                       index: RetrievalIndex | None, knn: KnnRouter | None) -> dict[str, dict[str, Any]]:
    """Each router's agreement with the labels oracle on the validation split: the base model plays each
    validation task once (the evaluation's settings), the analyst labels its episodes
    (data/evaluate/validation_labels.jsonl) and every router routes the tasks."""
    paths = Paths(oracle.root)
    tasks = make_tasks(env_cfg, "validation")
    factory = lambda: make_env(env_cfg)  # noqa: E731
    base = evaluate_policy(policy, tasks, factory, eval_rollout_config(rollout_cfg, rc), rc.seed, None, False)
    routes = oracle.route(base, [(env_cfg, tasks)], paths.validation_labels)
    solved = {t.task_id for t in base if t.success}
    routed = route_by(policy, tasks, candidates, rc, factory, scored, index, knn)
    return {r: routing_quality(routed[r], tasks, oracle.names, rc.seed, solved, oracle=routes) for r in scored}


def singles_on_validation(policy: Any, env_cfg: EnvConfig, names: Sequence[str], rcfg: RolloutConfig,
                          seed: int) -> dict[str, tuple[int, int]]:
    """Each adapter alone on every validation task (the evaluation's settings, `evaluate.seed`): (successes,
    episodes)."""
    tasks = make_tasks(env_cfg, "validation")
    out = {}
    for name in names:
        trajs = evaluate_policy(policy, tasks, lambda: make_env(env_cfg), rcfg, seed, name)
        out[name] = (sum(t.success for t in trajs), len(trajs))
    return out


def chosen_router(router: str, routers: Mapping[str, Mapping[str, Any]], scored: Sequence[str]) -> str:
    """`router`, or for 'auto' the scored router with the highest validation accuracy (ties: `ROUTERS`' order)."""
    if router != "auto":
        return router
    accuracy = {r: routers.get(r, {}).get("validation", {}).get("router_accuracy") for r in scored}
    return max(scored, key=lambda r: (-1.0 if accuracy[r] is None else accuracy[r], -list(ROUTERS).index(r)))


def interference_envs(boxes: Mapping[str, Any], env_cfg: EnvConfig, n_seeds: int, difficulty: int) -> dict:
    """Each capability's synthetic environment and its held-out tasks (`evaluate.interference_seeds` of them, at
    `synthesize.difficulty`), for the interference matrix."""
    seeds = list(range(INTERFERENCE_SEED0, INTERFERENCE_SEED0 + n_seeds))
    return {n: (lambda b=box: SyntheticEnv(b, env_cfg),
                synthetic_tasks(box, n, seeds, difficulty, "test")) for n, box in boxes.items()}
