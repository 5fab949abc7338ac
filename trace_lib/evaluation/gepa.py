"""The GEPA baseline: reflective evolution of the agent's system prompt (paper §4, Table 1's GEPA row).

Reads params (`analyst`, `evaluate`); writes, when the row runs,

    data/evaluate/gepa_prompt.md        the optimized system prompt (one section per target env)
    data/evaluate/gepa_rollouts.jsonl   rollout ledger of GEPA's metric calls (stage 'gepa')
    data/evaluate/gepa_llm.jsonl        tokens and cost of the reflection calls (trace_lib.llm ledger)

GEPA (the `gepa` package, PyPI 0.1.4) evolves named text components — here the system prompt of
each target environment — from the agent's own episodes: it scores a candidate prompt by rolling
the agent out on the target's *train* tasks (one metric call = one episode), shows a minibatch of
transcripts with their rewards to a reflection LLM, which writes a new prompt, and keeps the
candidates that do better (Pareto front over the train tasks). The reflection LLM is the analyst
backend (`anthropic` or `local`, through `trace_lib.llm`, cached and ledgered like every analyst
call). Metric calls are capped at min(TRACE's total rollouts, `evaluate.gepa_max_rollouts`) and
counted in a rollout ledger; the cap is hard: a batch that would pass it is not run and the
search stops. The best prompt then runs on the held-out tasks like every other method.

`gepa_status` says why the row cannot run: the analyst resolves to `rules` (nothing can reflect),
the `gepa` package is missing, or TRACE's budget is 0.
"""

from __future__ import annotations

import importlib.util
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trace_lib.analyst.render import render_trajectory
from trace_lib.config import AnalystConfig, EnvConfig, EvaluateConfig, RolloutConfig
from trace_lib.envs import load_tasks
from trace_lib.envs.base import Environment
from trace_lib.evaluation.runner import (
    eval_rollout_config,
    eval_targets,
    evaluate_policy,
)
from trace_lib.io import atomic_write_text
from trace_lib.paths import Paths
from trace_lib.records import Task, Trajectory
from trace_lib.budget import RolloutLedger

log = logging.getLogger(__name__)

RULES_REASON = ("GEPA needs an LLM reflection model (analyst.backend anthropic, openai or local); "
                "the rules analyst cannot reflect")
STAGE = "gepa"
"""Stage name of GEPA's rows in the rollout ledger and of its reflection calls in the LLM ledger."""
REFLECTION_SYSTEM = "You improve the system prompt of a tool-calling customer-service agent."
REFLECTION_MAX_TOKENS = 4096
TRANSCRIPT_CHARS = 400
"""Characters kept per message when a transcript is shown to the reflection model."""

Reflect = Callable[[str], str]
"""A reflection model: GEPA's prompt in, the model's reply out."""
Example = tuple[str, Task]
"""One GEPA data instance: (target env name, train task)."""


def gepa_status(analyst: AnalystConfig, cfg: EvaluateConfig, budget_total: int | None = None) -> str | None:
    """Why the GEPA row cannot run, or None when it can (LLM analyst, gepa installed, budget > 0)."""
    from trace_lib.llm import resolve_analyst

    backend = resolve_analyst(analyst, announce=False)
    if backend == "rules":
        return RULES_REASON
    if importlib.util.find_spec("gepa") is None:
        return (f"the analyst backend {backend!r} could reflect, but the gepa package is not installed "
                "(pip install gepa==0.1.4)")
    if budget_total is not None and gepa_budget(budget_total, cfg) < 1:
        return "TRACE's rollout budget is 0 (no adapter ledgers), so GEPA's equal budget is 0 metric calls"
    return None


def gepa_budget(trace_total: int, cfg: EvaluateConfig) -> int:
    """Metric calls GEPA may spend: TRACE's total, or `gepa_max_rollouts` when that is smaller."""
    return min(int(trace_total), cfg.gepa_max_rollouts) if cfg.gepa_max_rollouts else int(trace_total)


def with_prompt(factory: Callable[[], Environment], prompt: str) -> Callable[[], Environment]:
    """An environment factory whose episodes open with `prompt` as the system prompt."""
    def make() -> Environment:
        env = factory()
        # an instance attribute shadows the method: reset() opens the episode with this prompt, and the
        # environments themselves stay as they are
        env.system_prompt = lambda task: prompt
        return env
    return make


def component(env_name: str) -> str:
    """GEPA's name for the system prompt of one target environment."""
    return f"system_prompt:{env_name}"


def llm_reflection(client: Any, max_tokens: int = REFLECTION_MAX_TOKENS) -> Reflect:
    """The analyst's LLMClient as GEPA's reflection model (cached, ledgered under stage 'gepa')."""
    def reflect(prompt: str | list[dict[str, Any]]) -> str:
        messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                    else [{"role": m["role"], "content": str(m["content"])} for m in prompt])
        return client.complete(REFLECTION_SYSTEM, messages, max_tokens=max_tokens, stage=STAGE).text
    return reflect


class BudgetSpent(RuntimeError):
    """A batch of metric calls would pass GEPA's rollout budget; it was not run."""


@dataclass
class _Batch:
    """gepa.core.adapter.EvaluationBatch's fields (built into that class by `_as_gepa`)."""

    outputs: list[Trajectory]
    scores: list[float]
    trajectories: list[Trajectory] | None


class PromptAdapter:
    """GEPA's adapter over trace episodes: a candidate is {component(env): system prompt}; one
    metric call is one greedy episode of the base model, scored by its reward, counted in `ledger`."""

    propose_new_texts = None

    def __init__(self, policy: Any, factories: Mapping[str, Callable[[], Environment]], rollout_cfg: RolloutConfig,
                 seed: int, ledger: RolloutLedger, budget: int, key: str = "", min_batch: int = 1) -> None:
        self.policy = policy
        self.factories = dict(factories)
        self.rollout_cfg = rollout_cfg.model_copy(update={"samples_per_task": 1})
        self.seed = seed
        self.ledger = ledger
        self.budget = int(budget)
        self.key = key
        self.min_batch = min_batch
        self.used = 0
        self.exhausted = False
        self.error: BaseException | None = None
        """First unexpected error (model, LLM): recorded so the search stops and it is re-raised."""

    def stop(self, _state: Any = None) -> bool:
        """GEPA stop condition: budget spent (or too little left for one parent + child minibatch), or an error."""
        return self.exhausted or self.error is not None or self.budget - self.used < 2 * self.min_batch

    def evaluate(self, batch: list[Example], candidate: dict[str, str], capture_traces: bool = False) -> Any:
        if self.used + len(batch) > self.budget:
            self.exhausted = True
            raise BudgetSpent(f"{len(batch)} more episodes would pass GEPA's budget ({self.used}/{self.budget} used)")
        try:
            by_id: dict[tuple[str, str], Trajectory] = {}
            for env_name, factory in self.factories.items():
                tasks = [t for e, t in batch if e == env_name]
                if tasks:
                    run = with_prompt(factory, candidate[component(env_name)])
                    for traj in evaluate_policy(self.policy, tasks, run, self.rollout_cfg, self.seed):
                        by_id[(env_name, traj.task_id)] = traj
        except Exception as err:
            self.error = self.error or err
            raise
        self.used += len(batch)
        self.ledger.add(STAGE, len(batch), self.key)
        trajs = [by_id[(e, t.id)] for e, t in batch]
        return _as_gepa(_Batch(trajs, [float(t.reward) for t in trajs], trajs if capture_traces else None))

    def make_reflective_dataset(self, candidate: dict[str, str], eval_batch: Any,
                                components_to_update: list[str]) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {c: [] for c in components_to_update}
        for traj in eval_batch.trajectories or []:
            name = next((c for c in components_to_update if c == component(_env_of(traj, self.factories))), None)
            if name is None:
                continue
            opening = next((m.content for m in traj.messages if m.role == "user"), "")
            out[name].append({
                "Inputs": {"customer opening": opening},
                "Generated Outputs": render_trajectory(traj, limit=TRANSCRIPT_CHARS),
                "Feedback": _feedback(traj),
            })
        return out


def _env_of(traj: Trajectory, factories: Mapping[str, Any]) -> str:
    return traj.env if traj.env in factories else next(iter(factories))


def _feedback(traj: Trajectory) -> str:
    outcome = "succeeded" if traj.success else "failed"
    info = ", ".join(f"{k}={v}" for k, v in sorted(traj.reward_info.items()) if not isinstance(v, dict | list))
    return (f"The episode {outcome} (reward {traj.reward:g}, ended by {traj.termination or 'unknown'}; "
            f"{traj.tool_calls} tool calls, {traj.invalid_actions} invalid actions, {traj.tool_errors} tool errors)"
            + (f". Checks: {info}." if info else "."))


def _as_gepa(b: _Batch) -> Any:
    from gepa.core.adapter import EvaluationBatch

    return EvaluationBatch(outputs=b.outputs, scores=b.scores, trajectories=b.trajectories)


class _Log:
    """GEPA's logger, sent to this module's logging (debug) instead of stdout."""

    def log(self, message: str, *args: Any, **kwargs: Any) -> None:
        log.debug("%s", message)


@dataclass
class GepaRun:
    """The best prompt per target env and what the search cost."""

    prompts: dict[str, str]
    record: dict[str, Any] = field(default_factory=dict)


def optimize_system_prompt(policy: Any, train: Mapping[str, tuple[Callable[[], Environment], Sequence[Task]]],
                           reflect: Reflect, rollout_cfg: RolloutConfig, budget: int, ledger: RolloutLedger, *,
                           seed: int = 0, minibatch: int = 3, key: str = "") -> GepaRun:
    """GEPA on the system prompt of each env in `train` (env name -> (factory, train tasks)).

    The seed candidate is each env's own system prompt; the search stops when less than two minibatches
    of `budget` are left, and never runs an episode past it. Every episode is added to `ledger`
    (stage 'gepa', `key`). At most half the budget goes to scoring the seed on the Pareto tasks."""
    import gepa

    if budget < 1:
        raise ValueError(f"GEPA needs a rollout budget of at least 1 episode, got {budget}")
    factories = {name: f for name, (f, _) in train.items()}
    examples: list[Example] = [(name, t) for name, (_, tasks) in train.items() for t in tasks]
    if not examples:
        raise ValueError("GEPA has no train tasks to score prompts on")
    n_val = min(len(examples), max(1, budget // 2))
    valset = sorted(random.Random(seed).sample(range(len(examples)), n_val))
    seed_candidate = {}
    for name, (factory, tasks) in train.items():
        if tasks:
            seed_candidate[component(name)] = factory().system_prompt(tasks[0])
    adapter = PromptAdapter(policy, factories, rollout_cfg, seed, ledger, budget, key, min(minibatch, len(examples)))
    used_before = ledger.used(STAGE, key)
    reflections = 0

    def reflection(prompt: str | list[dict[str, Any]]) -> str:
        nonlocal reflections
        try:
            reply = reflect(prompt)  # type: ignore[arg-type]
        except Exception as err:
            adapter.error = adapter.error or err
            raise
        reflections += 1
        return reply

    result = gepa.optimize(
        seed_candidate=seed_candidate, trainset=examples, valset=[examples[i] for i in valset], adapter=adapter,
        reflection_lm=reflection, reflection_minibatch_size=min(minibatch, len(examples)),
        max_metric_calls=budget, stop_callbacks=[adapter.stop], logger=_Log(), seed=seed,
        raise_on_exception=False, display_progress_bar=False)
    if adapter.error is not None:
        raise adapter.error
    best = result.best_candidate
    scores = list(result.val_aggregate_scores)
    return GepaRun(
        prompts={name: best[component(name)] for name in train if component(name) in best},
        record={"budget": budget, "rollouts_used": ledger.used(STAGE, key) - used_before,
                "reflections": reflections, "candidates": len(result.candidates), "best_idx": result.best_idx,
                "best_train_score": scores[result.best_idx], "seed_train_score": scores[0],
                "train_tasks": len(examples), "pareto_tasks": n_val,
                "stopped_by": "budget" if adapter.exhausted or adapter.stop() else "gepa"})


def prompt_markdown(prompts: Mapping[str, str]) -> str:
    """The optimized prompt(s) as the file the stage writes: the prompt alone for one env, else a section each."""
    if len(prompts) == 1:
        return next(iter(prompts.values())).rstrip() + "\n"
    return "".join(f"## {name}\n\n{text.rstrip()}\n\n" for name, text in prompts.items())


def run_gepa(policy: Any, env_cfg: EnvConfig, cfg: EvaluateConfig, rollout: RolloutConfig, analyst: AnalystConfig,
             seed: int, root: Path, trace_total: int, make_env: Callable[[Any], Environment]) -> GepaRun:
    """The evaluate stage's GEPA row: optimize on each target's train split (`env_cfg` and `evaluate.targets`), with
    `analyst` reflecting, write the prompt and ledger."""
    from trace_lib.llm import analyst_client

    paths = Paths(root)
    ledger = RolloutLedger(paths.gepa_rollouts)
    ledger.reset(STAGE, "", [])  # a rerun starts from an empty count
    train = {}
    for ecfg, _ in eval_targets(env_cfg, cfg, root):
        tasks = load_tasks(ecfg, "train", root)
        train[ecfg.name] = (lambda e=ecfg: make_env(e), tasks[: cfg.gepa_tasks] if cfg.gepa_tasks else tasks)
    client = analyst_client(analyst, paths.gepa_llm, root, seed)
    if client is None:
        raise ValueError(RULES_REASON)
    out = optimize_system_prompt(policy, train, llm_reflection(client), eval_rollout_config(rollout, cfg),
                                 gepa_budget(trace_total, cfg), ledger, seed=cfg.seed, minibatch=cfg.gepa_minibatch)
    atomic_write_text(paths.gepa_prompt, prompt_markdown(out.prompts))
    out.record["ledger"] = paths.gepa_rollouts.relative_to(root).as_posix()
    return out
