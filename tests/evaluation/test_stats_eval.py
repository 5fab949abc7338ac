"""Evaluation statistics on constructed outcomes and records: bootstrap CI, paired bootstrap, McNemar, rows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trace_lib.records import Message, Trajectory
from trace_lib.stats import (
    align,
    bootstrap_ci,
    compare,
    group_rows,
    mcnemar,
    paired_bootstrap,
    rate_row,
    task_outcomes,
)


def traj(task: str, success: bool, sample: int = 0, family: str = "f", tool_calls: int = 2, invalid: int = 0,
         turns: int = 4) -> Trajectory:
    return Trajectory(id=f"{task}#{sample}", task_id=task, env="toy", family=family, split="test", policy_id="p",
                      seed=0, sample=sample, messages=[Message(role="user", content="hi")], reward=float(success),
                      success=success, termination="user_stop", tool_calls=tool_calls, invalid_actions=invalid,
                      tool_errors=0, turns=turns, prompt_tokens=0, completion_tokens=0)


def test_bootstrap_ci_contains_rate_and_shrinks_with_n():
    rng = np.random.default_rng(0)
    widths = []
    for n in (20, 80, 320):
        x = (rng.random(n) < 0.4).astype(float)
        lo, hi = bootstrap_ci(x, n_boot=2000, level=0.95, seed=1)
        assert lo <= x.mean() <= hi and 0 <= lo < hi <= 1
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2]
    # about 2 * 1.96 * sqrt(p(1-p)/n) for n = 320
    assert widths[2] == pytest.approx(2 * 1.96 * math.sqrt(0.24 / 320), rel=0.25)
    assert bootstrap_ci(x, seed=3) == bootstrap_ci(x, seed=3)  # seeded
    assert bootstrap_ci([], seed=0) == (0.0, 1.0)
    assert bootstrap_ci([1, 1, 1]) == (1.0, 1.0)  # degenerate sample: zero width (Wilson is in rate_row)
    assert bootstrap_ci([0, 1], n_boot=0) == (0.5, 0.5)
    lo90, hi90 = bootstrap_ci(x, level=0.90, seed=1)
    lo95, hi95 = bootstrap_ci(x, level=0.95, seed=1)
    assert lo95 <= lo90 and hi90 <= hi95


@pytest.mark.parametrize(("only_a", "only_b", "p"), [
    (10, 0, 2 / 2**10),                      # 0.001953...
    (0, 10, 2 / 2**10),
    (5, 5, 1.0),
    (0, 0, 1.0),                              # no discordant pairs
    (1, 0, 1.0),                              # min(1, 2 * 0.5)
    (6, 1, 2 * (1 + 7) / 2**7),               # 0.125
    (12, 3, 2 * sum(math.comb(15, i) for i in range(4)) / 2**15),  # 0.03516
])
def test_mcnemar_exact_p_values(only_a, only_b, p):
    concordant = [(1, 1)] * 4 + [(0, 0)] * 3
    pairs = [(1, 0)] * only_a + [(0, 1)] * only_b + concordant
    a, b = zip(*pairs, strict=True)
    out = mcnemar(a, b)
    assert out["only_a"] == only_a and out["only_b"] == only_b and out["discordant"] == only_a + only_b
    assert out["p_value"] == pytest.approx(p, rel=1e-12)
    assert mcnemar(b, a)["p_value"] == out["p_value"]  # two-sided: symmetric
    assert mcnemar([1] * 10, [0] * 10)["p_value"] == pytest.approx(0.001953125)


def test_mcnemar_rejects_misaligned_or_fractional():
    with pytest.raises(ValueError, match="align"):
        mcnemar([1, 0], [1])
    with pytest.raises(ValueError, match="0/1"):
        mcnemar([0.5, 1], [1, 0])


def test_paired_bootstrap_sign_and_interval():
    base = np.array([0] * 20 + [1] * 10)
    better = base.copy()
    better[:8] = 1  # 8 more tasks solved, none lost
    up = paired_bootstrap(better, base, n_boot=2000, seed=0)
    assert up["diff"] == pytest.approx(8 / 30) and 0 < up["ci_low"] <= up["diff"] <= up["ci_high"]
    assert up["p_le_zero"] == 0.0
    down = paired_bootstrap(base, better, n_boot=2000, seed=0)
    assert down["diff"] == pytest.approx(-8 / 30) and down["ci_high"] < 0 and down["p_le_zero"] == 1.0
    same = paired_bootstrap(base, base)
    assert same["diff"] == 0 and same["ci_low"] == same["ci_high"] == 0
    with pytest.raises(ValueError, match="align"):
        paired_bootstrap([1, 0], [1])


def test_rate_row_and_groups_from_records():
    trajs = [traj("a", True, family="x", tool_calls=3), traj("b", False, family="x", invalid=2),
             traj("c", True, family="y", tool_calls=1), traj("d", True, family="y")]
    row = rate_row(trajs, n_boot=500, seed=0)
    assert row["n"] == 4 and row["tasks"] == 4 and row["successes"] == 3 and row["success_rate"] == 0.75
    assert row["ci_low"] <= 0.75 <= row["ci_high"] and row["wilson_low"] < 0.75 < row["wilson_high"]
    assert row["mean_tool_calls"] == pytest.approx((3 + 2 + 1 + 2) / 4)
    assert row["invalid_action_rate"] == pytest.approx(2 / 16)
    groups = group_rows(trajs, "family", n_boot=200)
    assert list(groups) == ["x", "y"] and groups["x"]["success_rate"] == 0.5 and groups["y"]["success_rate"] == 1.0
    assert group_rows(trajs, lambda t: "all", n_boot=0)["all"]["n"] == 4
    empty = rate_row([])
    assert empty["n"] == 0 and empty["mean_tool_calls"] is None and (empty["ci_low"], empty["ci_high"]) == (0, 1)


def test_graded_rewards_get_a_mean_reward_with_an_interval_and_a_table1_column():
    from trace_lib.evaluation.tables import MethodRun, summarize_runs, table1

    graded = [traj("a", True), traj("b", False).model_copy(update={"reward": 0.5}),
              traj("b", False, sample=1).model_copy(update={"reward": 0.25}), traj("c", False)]
    row = rate_row(graded, n_boot=500)
    assert row["mean_reward"] == pytest.approx((1 + 0.375 + 0) / 3)  # per task first, samples averaged
    assert row["reward_ci_low"] <= row["mean_reward"] <= row["reward_ci_high"]
    binary = [MethodRun("base", "base", "base", [traj("a", True), traj("b", False)])]
    summarize_runs(binary, n_boot=100)
    assert "mean reward" not in table1(binary, ["f"], 0).columns
    runs = [MethodRun("base", "base", "base", graded)]
    summarize_runs(runs, n_boot=100)
    cell = table1(runs, ["f"], 0).loc[0, "mean reward"]
    assert cell.startswith(f"{row['mean_reward']:.3f} [")


def test_samples_are_averaged_per_task_and_aligned():
    a = [traj("t1", True, 0), traj("t1", False, 1), traj("t2", True, 0), traj("t2", True, 1), traj("t3", False, 0)]
    b = [traj("t1", False, 0), traj("t1", False, 1), traj("t2", True, 0), traj("t2", False, 1)]
    assert task_outcomes(a) == {"t1": 0.5, "t2": 1.0, "t3": 0.0}
    x, y, keys = align(a, b, "task")
    assert keys == ["t1", "t2"] and list(x) == [0.5, 1.0] and list(y) == [0.0, 0.5]
    xs, ys, skeys = align(a, b, "sample")
    assert skeys == [("t1", 0), ("t1", 1), ("t2", 0), ("t2", 1)] and list(xs) == [1, 0, 1, 1]
    row = rate_row(a, n_boot=0)
    assert row["tasks"] == 3 and row["n"] == 5 and row["ci_low"] == row["ci_high"] == pytest.approx(0.5)
    c = compare(a, b, n_boot=500)
    assert c["tasks"] == 2 and c["diff"] == pytest.approx(0.5)
    assert c["mcnemar"]["only_a"] == 2 and c["mcnemar"]["only_b"] == 0
    with pytest.raises(ValueError, match="align by"):
        align(a, b, "episode")
