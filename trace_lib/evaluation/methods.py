"""The evaluation's methods as rows to run: each method's weights per task, its rollout budget, or why it cannot run.

Reads the adapters' budgets (`trace_lib.budget.adapter_budget`) and nothing else; writes nothing. The evaluate stage
(`stages/evaluate.py`) collects a `MethodSpec` per row with `MethodSpecs.add`, in Table 1's order, then runs them
(`run_specs`): every method's greedy episodes can then be decoded together before the rows are assembled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_lib.budget import DISTILLED, adapter_budget
from trace_lib.config import EnvConfig
from trace_lib.paths import Paths
from trace_lib.records import Task
from trace_lib.routing.decide import oracle_decisions

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
        trace = {"budget_n": budget["total"], "source": "TRACE adapters"}
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
        trace = {"budget_n": budget_total, "source": "TRACE adapters"}
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
                     lambda e, ts, k=key: decisions[k], budget_n=budget_total, source="TRACE adapters")

    def plans(self, oracle: str) -> list[RoutingFor]:
        """The rows whose greedy episodes can be decoded together up front: those that run on the shared memo (no
        other system prompt), less the labels oracle's, which needs the base model's episodes first."""
        return [s.routing_for for s in self if s.reason is None and s.prompts is None
                and not (s.method == "oracle_route" and oracle == "labels")]
