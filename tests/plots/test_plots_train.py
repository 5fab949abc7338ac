"""Training curves: the figures and tables drawn from train-log rows (the DVCLive files: tests/training/test_tracking.py)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
from tiny_training import log_row

from trace_lib.plots.train import (
    ADAPTER_COLUMNS,
    adapter_table,
    base_pass_rate,
    curves_against_base,
    last_iterations,
    rubric_curves,
    training_curves,
)
from trace_lib.records import AdapterManifest


def dashed(ax) -> list:
    return [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]


def test_each_adapter_is_drawn_against_its_base_pass_rate():
    logs = {"tool_call_precision": [log_row(1, 0.75), log_row(2, 0.875)],
            "communicate_result": [log_row(1, 0.25), log_row(2, 0.375)]}
    assert base_pass_rate(logs["communicate_result"]) == 0.25 and base_pass_rate([log_row(2, 0.5)]) is None
    fig = curves_against_base(logs, temperature=0.8)
    axes = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    assert [ax.get_title() for ax in axes] == ["communicate_result", "tool_call_precision"]
    for ax, base in zip(axes, (0.25, 0.75), strict=True):
        (line,) = dashed(ax)
        assert list(line.get_ydata()) == [base, base] and line.get_label() == "base pass rate (T=0.8)"
        assert "base pass rate (T=0.8)" in [t.get_text() for t in ax.get_legend().get_texts()]
        labels = [ln.get_label() for ln in ax.get_lines()]
        assert "success rate" in labels and "reward" not in labels  # reward == success: drawn once


def test_reward_is_drawn_too_when_the_efficiency_reward_changes_it():
    logs = {"cap": [log_row(1, 0.5, reward=0.45, l_t=3), log_row(2, 0.75, reward=0.7, l_t=2)]}
    ax = curves_against_base(logs).axes[0]
    assert {ln.get_label() for ln in ax.get_lines()} == {"success rate", "reward", "base pass rate"}
    assert list(dashed(ax)[0].get_ydata()) == [0.5, 0.5]


def test_with_the_hint_swap_the_curve_and_the_base_line_are_the_unguided_rollouts():
    logs = {"cap": [log_row(1, 0.5, hinted=4, success_rate_unhinted=0.25, success_rate_hinted=0.75),
                    log_row(2, 0.75, hinted=4, success_rate_unhinted=0.5, success_rate_hinted=1.0)]}
    assert base_pass_rate(logs["cap"]) == 0.25
    assert base_pass_rate([log_row(1, 0.5, hinted=0, success_rate_unhinted=0.5)]) == 0.5
    ax = curves_against_base(logs).axes[0]
    (curve,) = [ln for ln in ax.get_lines() if ln.get_label() == "success rate, sampled episodes"]
    assert list(curve.get_ydata()) == [0.25, 0.5] and list(dashed(ax)[0].get_ydata()) == [0.25, 0.25]


def test_with_reference_samples_the_curves_are_the_sampled_episodes_success():
    logs = {"cap": [log_row(1, 0.3, references=16, success_rate_on_policy=0.05),
                    log_row(2, 0.6, references=16, success_rate_on_policy=0.45)]}
    assert base_pass_rate(logs["cap"]) == 0.05
    ax = curves_against_base(logs).axes[0]
    (curve,) = [ln for ln in ax.get_lines() if ln.get_label() == "success rate, sampled episodes"]
    assert list(curve.get_ydata()) == [0.05, 0.45]
    (panel,) = [a for a in training_curves(logs).axes if a.get_title() == "success rate, sampled episodes"]
    assert list(panel.get_lines()[0].get_ydata()) == [0.05, 0.45]


@pytest.mark.parametrize("logs", [{}, {"cap": []}])
def test_figures_without_iterations_still_draw(logs):
    fig = curves_against_base(logs)
    assert fig.axes and not any(dashed(ax) for ax in fig.axes)
    assert training_curves(logs).axes
    assert "no rubric" in rubric_curves(logs).axes[0].texts[0].get_text()


def test_rubric_items_get_a_line_each():
    rows = [log_row(1, 0.0, env_score=0.25, rubric={"orders_read": 0.5, "facts_said": 0.0, "no_write": 1.0}),
            log_row(2, 0.5, env_score=0.75, rubric={"orders_read": 1.0, "facts_said": 0.5, "no_write": 1.0})]
    fig = rubric_curves({"communicate_result": rows, "no_rubric": [log_row(1, 0.5)]})
    assert len(fig.axes) == 1 and fig.axes[0].get_title() == "communicate_result"
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].get_lines()}
    assert lines == {"orders_read": [0.5, 1.0], "facts_said": [0.0, 0.5], "no_write": [1.0, 1.0],
                     "env score": [0.25, 0.75]}


def test_adapter_table_one_row_per_manifest_with_its_timing():
    manifests = [AdapterManifest(capability_id=name, path=f"/x/{name}", base_model="tiny", env_sha256="", backend="trl",
                                 rollouts_used=n, iterations=n // 8, final_reward=r)
                 for name, n, r in (("b", 16, 0.5), ("a", 8, None))]
    table = adapter_table(manifests, {"a": {"seconds_per_iteration": 2.5}, "b": {"seconds_per_iteration": None}})
    assert tuple(table.columns) == ADAPTER_COLUMNS and list(table["adapter"]) == ["b", "a"]  # the manifests' order
    assert table.iloc[0][["rollouts", "iterations", "final_reward"]].tolist() == [16, 2, 0.5]
    assert table.iloc[1]["seconds_per_iteration"] == 2.5 and table.iloc[1]["backend"] == "trl"
    assert adapter_table([], {}).empty and tuple(adapter_table([], {}).columns) == ADAPTER_COLUMNS


def test_last_iterations_skips_adapters_without_a_log():
    table = last_iterations({"a": [log_row(1, 0.25), log_row(2, 0.5)], "b": []})
    assert list(table["adapter"]) == ["a"] and table.iloc[0]["iteration"] == 2 and table.iloc[0]["success_rate"] == 0.5
    assert list(table.columns[:2]) == ["adapter", "iteration"]
