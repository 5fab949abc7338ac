"""The evaluate stage's tables as markdown and its metrics record, from the methods' runs.

Reads and writes nothing: pure functions from `MethodRun`s (`evaluation.tables`) and the stage's settings to the
text of reports/tables/{table1,routing,interference,capabilities}.md and the record of reports/metrics/evaluate.json,
which the evaluate stage (`stages/evaluate.py`) writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trace_lib.config import EvaluateConfig
from trace_lib.evaluation.tables import (
    TABLE1_ORDER,
    MethodRun,
    capability_table,
    groups_of,
    interference_table,
    markdown,
    ordered_rows,
    paired_table,
    router_quality_table,
    routing_table,
    table1,
    table1_long,
    trace_run,
)
from trace_lib.records import Task


def table1_markdown(runs: list[MethodRun], groups: Mapping[str, Any], env_names: Sequence[str],
                    graded_envs: Sequence[str], n_tasks: int, cfg: EvaluateConfig, trace_total: int) -> str:
    """reports/tables/table1.md: Table 1 with its caption, the per-family table and the paired tests."""
    t1 = table1(runs, groups, trace_total, mean_reward=bool(graded_envs))
    caption = (f"Success rate (%) on {', '.join(env_names)} ({cfg.split} split, {n_tasks} tasks, "
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
    return ("# Table 1\n\n" + caption + markdown(t1[[c for c in t1.columns if c not in detail]]) + per_group
            + paired)


def routing_markdown(runs: list[MethodRun], quality: Mapping[str, Any], routers: Mapping[str, Any] | None,
                     cfg: EvaluateConfig, trace_total: int) -> str:
    """reports/tables/routing.md: routing vs merging, then every router against the oracle and random routing."""
    return ("# Routing vs merging\n\n" + markdown(routing_table(runs, trace_total))
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
            + markdown(router_quality_table(quality, routers))
            + (f"\n{quality['note']}\n" if quality.get("note") else ""))


def interference_markdown(interference: list[dict[str, Any]]) -> str:
    """reports/tables/interference.md: each adapter on each capability's synthetic environment."""
    return ("# Adapter interference\n\nSuccess of each adapter (rows) on each capability's synthetic environment "
            "(columns), held-out seeds.\n\n" + (markdown(interference_table(interference)) if interference
                                                 else "not run\n"))


def capabilities_markdown(tasks: Sequence[Task], runs: list[MethodRun], interference: list[dict[str, Any]],
                          adapters: Sequence[str]) -> str:
    """reports/tables/capabilities.md: per-capability success before and after."""
    return ("# Per-capability success before / after\n\n"
            + markdown(capability_table(tasks, runs, interference, adapters)))


def evaluate_metrics(runs: list[MethodRun], env_names: Sequence[str], graded_envs: Sequence[str], n_tasks: int,
                     budget: Mapping[str, Any], quality: Mapping[str, Any], interference: list[dict[str, Any]],
                     cfg: EvaluateConfig, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The record of reports/metrics/evaluate.json: each method's rates and tests, routing quality, interference,
    and `extra` (routers, timing, the policy, ...)."""
    return {
        "split": cfg.split, "envs": list(env_names), "graded_envs": list(graded_envs), "tasks": n_tasks,
        "trace_budget": budget,
        "methods": {r.key: {"label": r.label, "status": "run" if r.ran else "not run", "reason": r.reason,
                            "rollouts": r.budget, "budget_source": r.budget_source, "note": r.note,
                            **({"validation": list(r.validation)} if r.validation else {}),
                            **({"overall": r.summary["overall"], "vs_base": r.summary.get("vs_base"),
                                 "trace_vs": r.summary.get("trace_vs")} if r.ran else {})}
                    for r in ordered_rows(runs, (*TABLE1_ORDER, "oracle_route", "hindsight_route"))},
        "routing": quality, "interference": interference, **(extra or {}),
    }


def evaluate_tables(runs: list[MethodRun], tasks: Sequence[Task], env_names: Sequence[str],
                    graded_envs: Sequence[str], quality: Mapping[str, Any], routers: Mapping[str, Any] | None,
                    interference: list[dict[str, Any]], adapters: Sequence[str], cfg: EvaluateConfig,
                    trace_total: int) -> dict[tuple[str, str], str]:
    """Every table the evaluate stage writes, by (name, suffix) under reports/tables/, in the order it writes them."""
    groups = groups_of(tasks)
    return {("table1", ".md"): table1_markdown(runs, groups, env_names, graded_envs, len(tasks), cfg, trace_total),
            ("table1", ".csv"): table1_long(runs, groups).to_csv(index=False),
            ("routing", ".md"): routing_markdown(runs, quality, routers, cfg, trace_total),
            ("interference", ".md"): interference_markdown(interference),
            ("capabilities", ".md"): capabilities_markdown(tasks, runs, interference, adapters)}
