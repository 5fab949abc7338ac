"""Statistics shared by the stages: success rates with intervals and paired comparisons.

Reads nothing and writes nothing: pure functions over 0/1 outcomes or `Trajectory` records. Written
here rather than pulled from scipy/statsmodels, which the pipeline does not otherwise need.

* `wilson_interval`: the binomial score interval of a success rate (rollout, training logs).
Reads nothing and writes nothing: pure functions over 0/1 outcomes or `Trajectory` records. The
paper reports one pass rate per method (one trial, temperature 0); the evaluate stage adds what a reader needs to
judge a difference on a test split of tens of tasks:

* `bootstrap_ci`: percentile bootstrap of a mean (tasks resampled with replacement).
* `paired_bootstrap`: the difference of two methods on the SAME tasks, resampling tasks jointly, so
  the task-to-task spread (most of the variance) cancels.
* `mcnemar`: exact McNemar test, i.e. a two-sided binomial test on the discordant pairs (tasks one
  method solves and the other does not). Written with `math.comb` because scipy is not in the
  environment (nothing else needs it); the exact test needs only binomial coefficients, and it is the
  right variant for the small discordant counts of a test split of this size (the χ² approximation
  is poor below ~25 discordant pairs).
* `rate_row` / `group_rows`: the numbers of one table cell (n, successes, rate, CI, mean tool calls,
  invalid-action rate).

Unit of resampling: the task. With several samples per task, a task's outcome is the mean of its
samples (so the interval does not pretend that samples of one task are independent); with one
sample, as in the paper, that is the episode's 0/1.

A degenerate split (all 0 or all 1) gives a zero-width bootstrap interval: the bootstrap cannot see
variance that the sample does not show. `rate_row` also carries the Wilson interval for that case.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from trace_lib.records import Trajectory


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion; (0, 1) when n == 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _as_array(values: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=float).reshape(-1)


def bootstrap_ci(successes: Sequence[float] | np.ndarray, n_boot: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `successes` (0/1 or per-task rates).

    Empty input: (0, 1), nothing is known. `n_boot` = 0: the point estimate twice.
    """
    x = _as_array(successes)
    if x.size == 0:
        return 0.0, 1.0
    if n_boot <= 0:
        return float(x.mean()), float(x.mean())
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    alpha = (1.0 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def paired_bootstrap(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, n_boot: int = 2000,
                     level: float = 0.95, seed: int = 0) -> dict[str, float]:
    """mean(a) − mean(b) on aligned outcomes, with a percentile interval from resampling pairs.

    `p_le_zero` is the share of resamples whose difference is ≤ 0 (a one-sided bootstrap p-value
    for "a is better than b").
    """
    x, y = _as_array(a), _as_array(b)
    if x.size != y.size:
        raise ValueError(f"paired outcomes must align: {x.size} vs {y.size}")
    if x.size == 0:
        return {"n": 0, "diff": 0.0, "ci_low": -1.0, "ci_high": 1.0, "p_le_zero": 1.0}
    d = x - y
    diff = float(d.mean())
    if n_boot <= 0:
        return {"n": int(d.size), "diff": diff, "ci_low": diff, "ci_high": diff, "p_le_zero": float(diff <= 0)}
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(axis=1)
    alpha = (1.0 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return {"n": int(d.size), "diff": diff, "ci_low": float(lo), "ci_high": float(hi),
            "p_le_zero": float((means <= 0).mean())}


def mcnemar(a: Sequence[bool | int] | np.ndarray, b: Sequence[bool | int] | np.ndarray) -> dict[str, float]:
    """Exact two-sided McNemar test on paired 0/1 outcomes.

    `only_a`: pairs a solved and b did not; `only_b`: the reverse. Under H0 the discordant pairs
    split 50/50, so p = min(1, 2·P[Binomial(n, ½) ≤ min(only_a, only_b)]) with n = only_a + only_b;
    p = 1 without discordant pairs.
    """
    x, y = _as_array(a), _as_array(b)
    if x.size != y.size:
        raise ValueError(f"paired outcomes must align: {x.size} vs {y.size}")
    if not np.isin(x, (0, 1)).all() or not np.isin(y, (0, 1)).all():
        raise ValueError("McNemar needs 0/1 outcomes (one sample per task, or align by sample)")
    only_a = int(((x == 1) & (y == 0)).sum())
    only_b = int(((x == 0) & (y == 1)).sum())
    n = only_a + only_b
    k = min(only_a, only_b)
    p = 1.0 if n == 0 else min(1.0, 2.0 * sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n)
    return {"only_a": only_a, "only_b": only_b, "discordant": n, "p_value": p}


# --- trajectories ------------------------------------------------------------------------------------
def task_outcomes(trajs: Sequence[Trajectory],
                  value: Callable[[Trajectory], float] = lambda t: float(t.success)) -> dict[str, float]:
    """Task id -> mean `value` (default: success, 0/1 with one sample per task) over its samples."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        by_task[t.task_id].append(value(t))
    return {k: sum(v) / len(v) for k, v in sorted(by_task.items())}


def align(a: Sequence[Trajectory], b: Sequence[Trajectory], by: str = "task") -> tuple[np.ndarray, np.ndarray, list]:
    """Outcomes of two methods on their common keys: 'task' (per-task mean) or 'sample' ((task, sample) 0/1)."""
    if by == "task":
        oa, ob = task_outcomes(a), task_outcomes(b)
    elif by == "sample":
        oa = {(t.task_id, t.sample): float(t.success) for t in a}
        ob = {(t.task_id, t.sample): float(t.success) for t in b}
    else:
        raise ValueError(f"align by 'task' or 'sample', got {by!r}")
    keys = sorted(set(oa) & set(ob))
    return np.array([oa[k] for k in keys]), np.array([ob[k] for k in keys]), keys


def compare(method: Sequence[Trajectory], base: Sequence[Trajectory], n_boot: int = 2000, level: float = 0.95,
            seed: int = 0) -> dict[str, Any]:
    """A method against the base model on the tasks both ran: paired bootstrap of the difference
    (per task) and exact McNemar (per (task, sample) pair)."""
    x, y, keys = align(method, base, "task")
    out: dict[str, Any] = {"tasks": len(keys), **paired_bootstrap(x, y, n_boot, level, seed)}
    xs, ys, _ = align(method, base, "sample")
    out["mcnemar"] = mcnemar(xs, ys)
    return out


def rate_row(trajs: Sequence[Trajectory], n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """One cell's numbers: episodes, tasks, successes, rate, bootstrap CI (over tasks), Wilson CI
    (over episodes), mean reward with its bootstrap CI (over tasks; the phone's mean milestone
    similarity), mean tool calls, invalid-action rate (invalid turns / agent turns)."""
    outcomes = list(task_outcomes(trajs).values())
    k, n = sum(t.success for t in trajs), len(trajs)
    lo, hi = bootstrap_ci(outcomes, n_boot, level, seed)
    rewards = list(task_outcomes(trajs, lambda t: t.reward).values())
    r_lo, r_hi = bootstrap_ci(rewards, n_boot, level, seed)
    w_lo, w_hi = wilson_interval(k, n)
    turns = sum(t.turns for t in trajs)
    return {
        "n": n, "tasks": len(outcomes), "successes": int(k), "success_rate": k / n if n else 0.0,
        "ci_low": lo, "ci_high": hi, "wilson_low": w_lo, "wilson_high": w_hi,
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0, "reward_ci_low": r_lo, "reward_ci_high": r_hi,
        "mean_tool_calls": sum(t.tool_calls for t in trajs) / n if n else None,
        "invalid_action_rate": sum(t.invalid_actions for t in trajs) / turns if turns else None,
    }


def group_rows(trajs: Sequence[Trajectory], key: Callable[[Trajectory], str] | str = "family", n_boot: int = 2000,
               level: float = 0.95, seed: int = 0) -> dict[str, dict[str, Any]]:
    """`rate_row` per group (a Trajectory attribute name or a function), groups sorted by name."""
    get = (lambda t: str(getattr(t, key))) if isinstance(key, str) else key
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[get(t)].append(t)
    return {g: rate_row(ts, n_boot, level, seed) for g, ts in sorted(groups.items())}
