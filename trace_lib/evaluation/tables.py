"""Tables of the evaluate stage (paper Table 1, routing vs merging, interference, per-capability success).

Reads and writes nothing: the evaluate stage (`stages/evaluate.py`) hands the methods' trajectories
to these builders and writes what they return. They are pure functions from `MethodRun`s (a method's
trajectories, or why it did not run, and the rollouts it cost) to DataFrames, so tests can build them
from constructed records; `eval_results` turns the runs into the stage's EvalResult records.

Cells read `rate [lo, hi] k/n` in percent (success rate, 95% Wilson interval over episodes); a method
that did not run keeps its row and says why, so the table shape never depends on what was available.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from trace_lib.records import NONE_ROUTE, EvalResult, Task, Trajectory
from trace_lib.stats import compare, group_rows, rate_row, task_outcomes

TABLE1_ORDER = ("base", "grpo_target", "grpo_target_late", "gepa", "merged_data", "linear_merge", "single_best",
                "single", "trace_argmax", "trace_top_p", "distilled")
"""Row order of Table 1; 'single' stands for every single-capability row after the best one."""
ROUTING_ROWS = ("trace_argmax", "trace_top_p", "oracle_route", "hindsight_route", "linear_merge", "merged_data",
                "distilled", "single_best")
EMPTY = "—"


@dataclass
class MethodRun:
    """One method's evaluation: its trajectories, or the reason it was not run; its rollout budget."""

    method: str
    """The `evaluate.methods` name it belongs to (base, single, trace, ...)."""
    key: str
    """Unique, file-safe row id (e.g. 'single_tool_call_precision', 'trace_top_p')."""
    label: str
    trajectories: list[Trajectory] | None = None
    reason: str = ""
    """Why it did not run (empty when it ran)."""
    budget: int | None = None
    """Training rollouts behind it (None: unknown / not applicable)."""
    budget_source: str = ""
    note: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    """Filled by `summarize_runs`: overall, groups, vs_base."""
    validation: tuple[int, int] | None = None
    """(successes, episodes) on the validation split, where it was played: how `best_single` chooses."""

    @property
    def ran(self) -> bool:
        return self.trajectories is not None


# --- summaries ---------------------------------------------------------------------------------------
TRACE_ROWS = ("trace_argmax", "trace_top_p")
"""TRACE's rows; the first that ran is the one every other method is compared with (`trace_vs`)."""


def trace_run(runs: Sequence[MethodRun]) -> MethodRun | None:
    """The first of TRACE's rows (`TRACE_ROWS` order) that ran: the one other methods are compared with."""
    return next((r for key in TRACE_ROWS for r in runs if r.key == key and r.ran), None)


def summarize_runs(runs: Sequence[MethodRun], n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> None:
    """Fill each run's `summary`: overall row, per-family rows, the paired comparison with base
    (`vs_base`: the method − base) and, for every method but TRACE's rows, with TRACE (`trace_vs`:
    TRACE − the method, and which TRACE row)."""
    base = next((r for r in runs if r.key == "base" and r.ran), None)
    trace = trace_run(runs)
    for r in runs:
        if not r.ran:
            continue
        r.summary = {"overall": rate_row(r.trajectories, n_boot, level, seed),
                     "groups": group_rows(r.trajectories, "family", n_boot, level, seed)}
        if base is not None and r is not base:
            r.summary["vs_base"] = compare(r.trajectories, base.trajectories, n_boot, level, seed)
        if trace is not None and r.key not in TRACE_ROWS:
            r.summary["trace_vs"] = {"trace": trace.key,
                                     **compare(trace.trajectories, r.trajectories, n_boot, level, seed)}


def best_single(runs: Sequence[MethodRun]) -> MethodRun | None:
    """The single-capability run chosen as the best, as a new row: the only one; else the most successes on
    the validation split (ties: name order) when every single run played it; else, without a validation
    split, the highest success on the evaluation split itself (an optimistic choice, and the note says so)."""
    singles = sorted((r for r in runs if r.method == "single" and r.ran and r.summary), key=lambda r: r.key)
    if not singles:
        return None
    if len(singles) == 1:
        best, note = singles[0], "the only single adapter: no choice made"
    elif all(r.validation is not None for r in singles):
        best = max(singles, key=lambda r: r.validation[0] / max(r.validation[1], 1))  # type: ignore[index]
        note = (f"best of {len(singles)} single adapters on the validation split ("
                + ", ".join(f"{r.key.removeprefix('single_')} {r.validation[0]}/{r.validation[1]}"  # type: ignore[index]
                            for r in singles) + ")")
    else:
        best = max(singles, key=lambda r: r.summary["overall"]["success_rate"])
        note = (f"best of {len(singles)} single adapters, chosen on this split (no validation split: an "
                "optimistic choice)")
    return MethodRun("single", "single_best", f"single-capability (best: {best.key.removeprefix('single_')})",
                     best.trajectories, budget=best.budget, budget_source=best.budget_source, note=note,
                     summary=best.summary)


def _route_runs(runs: Sequence[MethodRun]) -> list[tuple[str, MethodRun]]:
    """(route, run) of every route an argmax router can take whose episodes ran: the base model first
    ('none'), then each single adapter in name order."""
    base = [(NONE_ROUTE, r) for r in runs if r.key == "base" and r.ran]
    singles = sorted((r.key.removeprefix("single_"), r) for r in runs
                     if r.method == "single" and r.key != "single_best" and r.ran)
    return base + singles


def route_solvers(runs: Sequence[MethodRun]) -> dict[str, list[str]]:
    """Task id -> the routes ('none' or an adapter) with the highest success on it, when that is above 0
    (with one greedy episode per task: the routes that solved it), in `_route_runs` order. Read from the
    base and single-adapter episodes, so an argmax router's choice can be scored by what it solves."""
    rates: dict[str, dict[str, float]] = {}
    for route, run in _route_runs(runs):
        for task, rate in task_outcomes(run.trajectories or []).items():
            rates.setdefault(task, {})[route] = rate
    out = {}
    for task, by_route in sorted(rates.items()):
        best = max(by_route.values())
        if best > 0:
            out[task] = [route for route, rate in by_route.items() if rate == best]
    return out


def hindsight_route(runs: Sequence[MethodRun], budget: int | None = None) -> MethodRun | None:
    """Every task sent, after the fact, to a route that solved it: the episode of the base model when it
    succeeded, else of the first single adapter (name order) that did, else the base model's failure;
    per (task, sample). The most an argmax router over these adapters can solve on this split, chosen
    with its outcomes, so a bound and not a method. None unless the base model and a single adapter ran."""
    routes = _route_runs(runs)
    if len(routes) < 2 or routes[0][0] != NONE_ROUTE:
        return None
    episodes = [{(t.task_id, t.sample): t for t in run.trajectories or []} for _, run in routes]
    picked = []
    for key, base_episode in episodes[0].items():
        found = [e[key] for e in episodes if key in e and e[key].success]
        picked.append(found[0] if found else base_episode)
    return MethodRun("hindsight_route", "hindsight_route", "best route per task, in hindsight (bound)",
                     sorted(picked, key=lambda t: t.id), budget=budget, budget_source="TRACE adapters",
                     note=f"the base model or one of {len(routes) - 1} single adapters, chosen with this split's "
                          "outcomes: what a perfect argmax router could solve")


def ordered_rows(runs: Sequence[MethodRun], order: Sequence[str] = TABLE1_ORDER) -> list[MethodRun]:
    """Runs in table order, the best single row included (made from the single runs)."""
    by_key = {r.key: r for r in runs}
    best = best_single(runs)
    if best is not None:
        by_key["single_best"] = best
    out = []
    for key in order:
        if key == "single":
            out += [r for r in runs if r.method == "single" and r.key != "single_best"]
        elif key in by_key:
            out.append(by_key[key])
    return out


# --- cells -------------------------------------------------------------------------------------------
def success_interval(row: Mapping[str, Any]) -> tuple[float, float]:
    """A success rate's interval as every table and figure shows it: the 95% Wilson interval over episodes, which
    keeps a width at 0 or n successes where the bootstrap's collapses (rows written without it: the bootstrap's)."""
    if row.get("wilson_low") is not None and row.get("wilson_high") is not None:
        return float(row["wilson_low"]), float(row["wilson_high"])
    return float(row["ci_low"]), float(row["ci_high"])


def pct_cell(row: dict[str, Any] | None) -> str:
    """Success %, its interval (`success_interval`) and successes/episodes ('25.0 [8.9, 53.2] 3/12')."""
    if not row or not row.get("n"):
        return EMPTY
    lo, hi = success_interval(row)
    count = f" {row['successes']}/{row['n']}" if "successes" in row else ""
    return f"{100 * row['success_rate']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]{count}"


def diff_cell(vs: dict[str, Any] | None) -> str:
    if not vs or not vs.get("n"):
        return EMPTY
    return f"{100 * vs['diff']:+.1f} [{100 * vs['ci_low']:+.1f}, {100 * vs['ci_high']:+.1f}]"


def mcnemar_cell(vs: dict[str, Any] | None) -> str:
    """The exact McNemar p of a paired comparison (`stats.compare`), or a dash."""
    return f"{vs['mcnemar']['p_value']:.3g}" if vs else EMPTY


def budget_cells(r: MethodRun, trace_total: int) -> tuple[str, str]:
    if r.budget is None:
        return EMPTY, EMPTY
    ratio = f"{r.budget / trace_total:.2f}×" if trace_total > 0 else EMPTY
    return str(r.budget), ratio


def groups_of(tasks: Sequence[Task]) -> list[str]:
    """Table 1's columns: the task families in task order (τ² tasks: the domain)."""
    return list(dict.fromkeys(t.family for t in tasks))


# --- tables ------------------------------------------------------------------------------------------
def graded(runs: Sequence[MethodRun]) -> bool:
    """Whether any episode scored between 0 and 1 (the phone's milestone similarity): Table 1 then also
    shows the mean reward, as ToolSandbox reports mean similarity beside the perfect count."""
    return any(0.0 < t.reward < 1.0 for r in runs if r.ran for t in r.trajectories or [])


def reward_cell(row: dict[str, Any] | None) -> str:
    if not row or not row.get("n") or "mean_reward" not in row:
        return EMPTY
    return f"{row['mean_reward']:.3f} [{row['reward_ci_low']:.3f}, {row['reward_ci_high']:.3f}]"


def table1(runs: Sequence[MethodRun], groups: Sequence[str], trace_total: int,
           mean_reward: bool | None = None) -> pd.DataFrame:
    """Paper Table 1's content, the columns a reader needs first: one row per method, overall success (%, 95% CI),
    the mean reward with its 95% CI when `mean_reward` (None: when some episode's reward is graded, `graded`),
    rollouts spent, that budget relative to TRACE's and a note ('not run: why'); then one column per
    family/domain."""
    rows = []
    extra = ["mean reward"] if (graded(runs) if mean_reward is None else mean_reward) else []
    for r in ordered_rows(runs):
        cells: dict[str, Any] = {"method": r.label}
        for g in [*groups, "overall"]:
            if not r.ran:
                cells[g] = "not run"
            else:
                cells[g] = pct_cell(r.summary["overall"] if g == "overall" else r.summary["groups"].get(g))
        if extra:
            cells["mean reward"] = reward_cell(r.summary["overall"]) if r.ran else "not run"
        cells["rollouts"], cells["budget vs TRACE"] = budget_cells(r, trace_total)
        cells["note"] = f"not run: {r.reason}" if not r.ran else r.note or (
            "rollouts from the adapter manifest (no ledger found)" if r.budget_source == "manifest" else "")
        rows.append(cells)
    return pd.DataFrame(rows, columns=["method", "overall", *extra, "rollouts", "budget vs TRACE", "note", *groups])


TABLE1_COLUMNS = ("method", "key", "column", "status", "n", "successes", "success_rate", "ci_low", "ci_high",
                  "wilson_low", "wilson_high", "mean_reward", "reward_ci_low", "reward_ci_high", "rollouts", "reason")
"""The columns of table1.csv."""


def table1_long(runs: Sequence[MethodRun], groups: Sequence[str]) -> pd.DataFrame:
    """Table 1 as numbers (the CSV): one row per method x column."""
    cols = list(TABLE1_COLUMNS)
    rows = []
    for r in ordered_rows(runs):
        for g in [*groups, "overall"]:
            cell = (r.summary["overall"] if g == "overall" else r.summary["groups"].get(g)) if r.ran else None
            rows.append({"method": r.label, "key": r.key, "column": g, "status": "run" if r.ran else "not run",
                         **{k: (cell or {}).get(k) for k in ("n", "successes", "success_rate", "ci_low", "ci_high",
                                                             "wilson_low", "wilson_high", "mean_reward", "reward_ci_low", "reward_ci_high")},
                         "rollouts": r.budget, "reason": r.reason})
    return pd.DataFrame(rows, columns=cols)


def routing_table(runs: Sequence[MethodRun], trace_total: int) -> pd.DataFrame:
    """Routing vs merging: per-task routing (argmax, top-p, oracle) against one merge or one adapter for
    every task, with the paired difference to base and the exact McNemar p-value."""
    rows = []
    for r in ordered_rows(runs, ROUTING_ROWS):
        vs = r.summary.get("vs_base") if r.ran else None
        rows.append({"method": r.label, "overall": pct_cell(r.summary["overall"]) if r.ran else "not run",
                     "Δ vs base (pp)": diff_cell(vs),
                     "McNemar p": mcnemar_cell(vs),
                     "rollouts": budget_cells(r, trace_total)[0],
                     "note": f"not run: {r.reason}" if not r.ran else r.note})
    return pd.DataFrame(rows, columns=["method", "overall", "Δ vs base (pp)", "McNemar p", "rollouts", "note"])


def paired_table(runs: Sequence[MethodRun]) -> pd.DataFrame:
    """Table 1's paired tests, one row per method that ran but base: the method against base and TRACE
    against the method, each on the same tasks (difference in points with its bootstrap interval over
    tasks, exact McNemar p over (task, sample) pairs; `summarize_runs` fills both)."""
    rows = []
    for r in ordered_rows(runs):
        if not r.ran or r.key == "base":
            continue
        vs, tv = r.summary.get("vs_base"), r.summary.get("trace_vs")
        rows.append({"method": r.label, "method − base (pp)": diff_cell(vs),
                     "McNemar p (vs base)": mcnemar_cell(vs),
                     "TRACE − method (pp)": diff_cell(tv),
                     "McNemar p (TRACE vs method)": mcnemar_cell(tv),
                     "rollouts": EMPTY if r.budget is None else str(r.budget)})
    return pd.DataFrame(rows, columns=["method", "method − base (pp)", "McNemar p (vs base)", "TRACE − method (pp)",
                                       "McNemar p (TRACE vs method)", "rollouts"])


ROUTER_METRICS = ("tasks", "scored", "router_accuracy", "random_accuracy", "random_expected", "majority_accuracy",
                  "none_share", "solved_tasks", "solved_on_none", "mean_label_mass", "solvable_tasks",
                  "router_solvable_hits", "oracle_solvable_hits")


def router_quality_table(quality: dict[str, Any], routers: dict[str, dict[str, Any]] | None = None) -> pd.DataFrame:
    """Router accuracy against the oracle (capability tags), a random and a constant router's: one
    `value` column for `quality`, or one column per router and split when `routers`
    ({router: {"train": quality, "validation": quality, "test": quality} or {"note": why not run}}; validation
    where any router has it) is given."""
    def fmt(v: Any) -> str:
        return EMPTY if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    if not routers:
        return pd.DataFrame([{"metric": k, "value": fmt(quality.get(k))} for k in ROUTER_METRICS],
                            columns=["metric", "value"])
    splits = [s for s in ("train", "validation", "test") if s != "validation"
              or any("validation" in res for res in routers.values())]
    columns = {f"{name} ({split})": res.get(split, {}) for name, res in routers.items() for split in splits}
    rows = [{"metric": k, **{col: fmt(q.get(k)) if q else "not run" for col, q in columns.items()}}
            for k in ROUTER_METRICS]
    return pd.DataFrame(rows, columns=["metric", *columns])


def interference_frame(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Adapter (rows, base first) x capability environment (columns): success rate."""
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows)
    order = list(dict.fromkeys(df["adapter"]))
    return df.pivot(index="adapter", columns="env", values="success_rate").reindex(order)


def interference_table(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """The interference matrix as text cells 'rate% (k/n)'."""
    if not rows:
        return pd.DataFrame(columns=["adapter"])
    cells = {(r["adapter"], r["env"]): f"{100 * r['success_rate']:.0f}% ({r['successes']}/{r['n']})"
             if r["n"] else EMPTY for r in rows}
    adapters = list(dict.fromkeys(r["adapter"] for r in rows))
    envs = list(dict.fromkeys(r["env"] for r in rows))
    return pd.DataFrame([{"adapter": a, **{e: cells.get((a, e), EMPTY) for e in envs}} for a in adapters],
                        columns=["adapter", *envs])


def capability_table(tasks: Sequence[Task], runs: Sequence[MethodRun], interference: Sequence[dict[str, Any]],
                     adapters: Sequence[str]) -> pd.DataFrame:
    """Per capability, before (base) and after: on the target tasks tagged with it (base vs TRACE argmax)
    and on its own synthetic environment (base vs its adapter)."""
    by_key = {r.key: r for r in runs if r.ran}
    base, trace = by_key.get("base"), by_key.get("trace_argmax")
    synth = {(r["adapter"], r["env"]): r for r in interference}

    def rate(run: MethodRun | None, ids: set[str]) -> str:
        if run is None or not ids:
            return EMPTY
        ts = [t for t in run.trajectories if t.task_id in ids]
        return f"{100 * sum(t.success for t in ts) / len(ts):.1f}" if ts else EMPTY

    def synth_rate(adapter: str, env: str) -> str:
        r = synth.get((adapter, env))
        return f"{100 * r['success_rate']:.1f}" if r and r["n"] else EMPTY

    rows = []
    for cap in adapters:
        ids = {t.id for t in tasks if cap in t.capability_tags}
        rows.append({"capability": cap, "tagged tasks": len(ids), "target: base": rate(base, ids),
                     "target: TRACE": rate(trace, ids), "synthetic: base": synth_rate("base", cap),
                     "synthetic: own adapter": synth_rate(cap, cap)})
    return pd.DataFrame(rows, columns=["capability", "tagged tasks", "target: base", "target: TRACE",
                                       "synthetic: base", "synthetic: own adapter"])


def vs_base_frame(metrics: dict[str, Any]) -> pd.DataFrame:
    """From evaluate.json: each method that ran against base (paired difference, McNemar), in table order."""
    rows = []
    for key, m in metrics.get("methods", {}).items():
        vs = m.get("vs_base")
        if m.get("status") != "run" or not vs:
            continue
        rows.append({"method": m["label"], "tasks": vs["tasks"], "success": m["overall"]["success_rate"],
                     "diff": vs["diff"], "ci_low": vs["ci_low"], "ci_high": vs["ci_high"],
                     "only method": vs["mcnemar"]["only_a"], "only base": vs["mcnemar"]["only_b"],
                     "McNemar p": vs["mcnemar"]["p_value"], "rollouts": m.get("rollouts")})
    return pd.DataFrame(rows, columns=["method", "tasks", "success", "diff", "ci_low", "ci_high", "only method",
                                       "only base", "McNemar p", "rollouts"])


def _pp(x: float) -> str:
    return f"{100 * x:+.1f} pp"


def _difference(label: str, other: str, cmp: dict[str, Any]) -> str:
    mc = cmp["mcnemar"]
    return (f"{label} − {other}: {_pp(cmp['diff'])} [{_pp(cmp['ci_low'])}, {_pp(cmp['ci_high'])}] over "
            f"{cmp['tasks']} tasks; exact McNemar p = {mc['p_value']:.3g} ({mc['only_a']} solved only by "
            f"{label}, {mc['only_b']} only by {other})")


def findings(metrics: dict[str, Any]) -> list[str]:
    """The evaluation's findings as sentences computed from evaluate.json: TRACE against the base model, GRPO on the
    target and its reads-played ablation against the base model and against TRACE, the methods that differ from the
    base model, the router the TRACE rows used, where it sent the tasks and what that changed against the best
    single adapter."""
    methods = metrics.get("methods", {})
    trace_key = next((k for k in ("trace_argmax", "trace_top_p") if methods.get(k, {}).get("status") == "run"), None)
    trace = methods.get(trace_key or "", {})
    label = trace.get("label", "TRACE")
    if trace_key is None:
        why = methods.get("trace_argmax", {}).get("reason", "no TRACE row in the metrics")
        out = [f"TRACE did not run: {why}."]
    else:
        out = [_difference(label, "base", trace["vs_base"]) + "."] if trace.get("vs_base") else []
    for key in ("grpo_target", "grpo_target_late"):
        m = methods.get(key)
        if m is None:
            continue
        if m.get("status") != "run":
            out.append(f"{m.get('label', key)} did not run: {m.get('reason', '')}.")
            continue
        if m.get("vs_base"):
            out.append(_difference(m["label"], "base", m["vs_base"]) + f", at {m.get('rollouts')} rollouts.")
        if m.get("trace_vs"):
            out.append(_difference(label, m["label"], m["trace_vs"])
                       + f", at {trace.get('rollouts')} rollouts against {m.get('rollouts')}.")
    significant = [m["label"] for m in methods.values() if m.get("status") == "run" and m.get("vs_base")
                   and m["vs_base"]["mcnemar"]["p_value"] < 0.05]
    out.append("Methods that differ from the base model at p < 0.05: " + (", ".join(significant) or "none") + ".")
    router = metrics.get("router")
    if router:
        held = metrics.get("routers", {}).get(router, {}).get("validation", {}).get("router_accuracy")
        test = metrics.get("routing", {}).get("router_accuracy")
        fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
        out.append(f"Router: {router}; agreement with the oracle {fmt(held)} on validation, {fmt(test)} on test.")
    routing = metrics.get("routing", {})
    if routing.get("tasks") and routing.get("none_share") is not None:
        sent = round((1 - routing["none_share"]) * routing["tasks"])
        out.append(f"The router sent {sent} of {routing['tasks']} test tasks to an adapter and "
                   f"{routing['tasks'] - sent} to none.")
    best = methods.get("single_best", {})
    if trace_key and best.get("status") == "run" and best.get("trace_vs"):
        out.append("What routing changed: " + _difference(label, best["label"], best["trace_vs"])
                   + " (the best single adapter on every task).")
    return out


def not_run_table(metrics: dict[str, Any]) -> pd.DataFrame:
    """From evaluate.json: each method that did not run and why, in table order."""
    return pd.DataFrame([{"method": m["label"], "reason": m["reason"]} for m in metrics.get("methods", {}).values()
                         if m["status"] != "run"], columns=["method", "reason"])


LLM_COST_COLUMNS = ["stage", "backend", "model", "calls", "sent", "cache hits", "errors", "retries", "input tokens",
                    "output tokens", "cost (USD)"]


def llm_cost_frame(ledgers: Sequence[Sequence[Mapping[str, Any]]]) -> pd.DataFrame:
    """Every LLM call of a run, from its ledgers' rows (`trace_lib.llm` writes them): one row per stage, backend and
    model, then a total. Tokens and cost count the requests sent (a cache hit is free); the cost is 'no price'
    where a sent request's model has none (`analyst.prices`)."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for rows in ledgers:
        for r in rows:
            g = groups.setdefault((r.get("stage") or "-", r.get("backend", "-"), r.get("model", "-")),
                                  dict.fromkeys(LLM_COST_COLUMNS[3:10], 0) | {"cost": 0.0})
            g["calls"] += 1
            g["retries"] += int(r.get("retries", 0))
            g["errors"] += bool(r.get("error"))
            if r.get("cached"):
                g["cache hits"] += 1
                continue
            g["sent"] += not r.get("error")
            g["input tokens"] += int(r.get("input_tokens", 0))
            g["output tokens"] += int(r.get("output_tokens", 0))
            cost = r.get("cost_usd")
            g["cost"] = None if g["cost"] is None or (cost is None and not r.get("error")) else g["cost"] + (cost or 0.0)
    def money(c: float | None) -> str:
        return "no price" if c is None else f"{c:.4f}"

    out = [{"stage": s, "backend": b, "model": m, **{k: g[k] for k in LLM_COST_COLUMNS[3:10]},
            "cost (USD)": money(g["cost"])} for (s, b, m), g in groups.items()]
    if out:
        total = {k: sum(g[k] for g in groups.values()) for k in LLM_COST_COLUMNS[3:10]}
        costs = [g["cost"] for g in groups.values()]
        out.append({"stage": "total", "backend": "", "model": "", **total,
                    "cost (USD)": money(None if any(c is None for c in costs) else sum(costs))})
    return pd.DataFrame(out, columns=LLM_COST_COLUMNS)


def markdown(df: pd.DataFrame) -> str:
    """A GitHub markdown table (no tabulate dependency); '|' in cells escaped."""
    if df.empty and not len(df.columns):
        return "(empty)\n"
    def cell(v: Any) -> str:
        return EMPTY if v is None or (isinstance(v, float) and pd.isna(v)) else str(v).replace("|", "\\|")

    head = "| " + " | ".join(cell(c) for c in df.columns) + " |"
    rule = "| " + " | ".join("---" for _ in df.columns) + " |"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, rule, *body]) + "\n"


# --- records -----------------------------------------------------------------------------------------
def eval_results(runs: Sequence[MethodRun], env: str, split: str) -> list[EvalResult]:
    """One EvalResult per method that ran (per-family numbers in `by_group`)."""
    out = []
    for r in runs:
        if not r.ran:
            continue
        o = r.summary["overall"]
        groups = {g: {k: float(v[k]) for k in ("n", "successes", "success_rate", "ci_low", "ci_high")}
                  for g, v in r.summary["groups"].items()}
        out.append(EvalResult(method=r.key, env=env, split=split, n=o["n"], successes=o["successes"],
                              success_rate=o["success_rate"], ci_low=o["ci_low"], ci_high=o["ci_high"],
                              rollouts_budget=r.budget or 0, mean_tool_calls=o["mean_tool_calls"],
                              invalid_action_rate=o["invalid_action_rate"], by_group=groups))
    return out
