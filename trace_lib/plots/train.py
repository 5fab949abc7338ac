"""Training curves for the train stage (paper §3.3): figures and tables from train-log rows.

The rows are one per GRPO iteration, as the trainer logs them (training/trainer.py); the train notebook reads them
back from the DVCLive files the stage wrote while it trained (`training.tracking.read_curves`). The figure and table
functions are pure (the notebook saves the figures with `plots.save_figure`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from trace_lib.training.tracking import sampled_success

CURVES = (("reward", "mean reward"), ("success_sampled", "success rate, sampled episodes"),
          ("frac_reward_zero_std", "groups with identical rewards"), ("tool_calls", "tool calls per episode"))
"""(log key, axis label) of the panels drawn for every adapter."""


def rubric_items(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The rubric items an adapter's train-log rows hold, in first-seen order."""
    return list(dict.fromkeys(k for row in rows for k in (row.get("rubric") or {})))


def logs_frame(logs: Mapping[str, Sequence[dict[str, Any]]]) -> pd.DataFrame:
    """One row per (adapter, iteration) with every logged metric; adapters in name order."""
    rows = [{"adapter": name, **row, "success_sampled": sampled_success(row)} for name in sorted(logs)
            for row in logs[name]]
    return pd.DataFrame(rows)


ADAPTER_COLUMNS = ("adapter", "backend", "rollouts", "iterations", "final_reward", "seconds_per_iteration")


def adapter_table(manifests: Sequence[Any], timing: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """One row per adapter (AdapterManifest): rollouts spent, iterations, last iteration's mean reward and
    seconds per iteration (`timing`: adapter -> its timing record, `train.json`'s `timing`)."""
    return pd.DataFrame([{"adapter": m.capability_id, "backend": m.backend, "rollouts": m.rollouts_used,
                          "iterations": m.iterations, "final_reward": m.final_reward,
                          "seconds_per_iteration": timing[m.capability_id].get("seconds_per_iteration")}
                         for m in manifests], columns=list(ADAPTER_COLUMNS))


def last_iterations(logs: Mapping[str, Sequence[dict[str, Any]]]) -> pd.DataFrame:
    """The last train-log row of each adapter that logged one, every metric a column."""
    return pd.DataFrame([{"adapter": name, **rows[-1]} for name, rows in logs.items() if rows])


def training_curves(logs: Mapping[str, Sequence[dict[str, Any]]], title: str = "") -> plt.Figure:
    """Reward, success, identical-reward groups and tool calls per iteration, one line per adapter."""
    frame = logs_frame(logs)
    fig, axes = plt.subplots(1, len(CURVES), figsize=(3.3 * len(CURVES), 3.2))
    for ax, (key, label) in zip(axes, CURVES, strict=True):
        if not frame.empty and key in frame:
            for name, part in frame.groupby("adapter", sort=True):
                ax.plot(part["iteration"], part[key], marker="o", label=str(name))
        ax.set_xlabel("iteration")
        ax.set_title(label, fontsize=10)
    if not frame.empty:
        axes[0].legend(fontsize=7)
    else:
        axes[0].text(0.5, 0.5, "no adapters trained", ha="center", va="center", transform=axes[0].transAxes)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def efficiency_curves(logs: Mapping[str, Sequence[dict[str, Any]]], title: str = "") -> plt.Figure:
    """The efficiency threshold l_t and the mean tool calls of correct trajectories per iteration."""
    frame = logs_frame(logs)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    drawn = False
    if not frame.empty and "l_t" in frame:
        for name, part in frame.groupby("adapter", sort=True):
            if part["l_t"].notna().any():
                ax.step(part["iteration"], part["l_t"], where="post", label=f"{name}: l_t")
                ax.plot(part["iteration"], part["tool_calls_correct"], marker="o", linestyle=":",
                        label=f"{name}: calls (correct)")
                drawn = True
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "efficiency reward off (train.reward.efficiency: false)", ha="center", va="center",
                transform=ax.transAxes, fontsize=9)
    ax.set_xlabel("iteration")
    ax.set_ylabel("tool calls")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def rubric_curves(logs: Mapping[str, Sequence[dict[str, Any]]], title: str = "") -> plt.Figure:
    """Multi-level rewards: per adapter, each rubric item's mean per iteration (a gate's: the share of
    finished episodes that kept it) and the environment's mean partial score (dashed)."""
    names = [n for n in sorted(logs) if any(r.get("rubric") for r in logs[n])]
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(3.6 * max(1, len(names)), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = logs[name]
        its = [r["iteration"] for r in rows]
        for item in rubric_items(rows):
            ax.plot(its, [(r.get("rubric") or {}).get(item) for r in rows], marker="o", label=item)
        ax.plot(its, [r.get("env_score") for r in rows], color="black", linestyle="--", label="env score")
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("iteration")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=6)
    if not names:
        axes[0][0].text(0.5, 0.5, "no rubric in the train logs (all-or-nothing environments)", ha="center",
                        va="center", transform=axes[0][0].transAxes, fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def base_pass_rate(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The base model's pass rate on the adapter's environment: the unguided success rate of
    iteration 1, whose rollouts are sampled before the first update (LoRA B starts at zero), at the
    training temperature. None when the log has no first iteration."""
    first = [r for r in rows if r.get("iteration") == 1]
    return sampled_success(first[0]) if first else None


def curves_against_base(logs: Mapping[str, Sequence[dict[str, Any]]], temperature: float | None = None,
                        title: str = "") -> plt.Figure:
    """One panel per adapter: success rate per iteration (and the reward, where it differs) against a
    dashed line at the base model's pass rate on that environment (`base_pass_rate`)."""
    names = sorted(logs)
    cols = min(3, max(1, len(names)))
    rows_n = max(1, math.ceil(len(names) / cols))
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.8 * cols, 3.2 * rows_n), squeeze=False)
    flat = list(axes.flat)
    label = "base pass rate" + (f" (T={temperature:g})" if temperature is not None else "")
    for ax, name in zip(flat, names):
        frame = pd.DataFrame(list(logs[name]))
        low = 0.0
        if frame.empty:
            ax.text(0.5, 0.5, "no iterations logged", ha="center", va="center", transform=ax.transAxes)
        else:
            guided = bool(frame.get("hinted", pd.Series([0])).fillna(0).any()
                          or frame.get("references", pd.Series([0])).fillna(0).any())
            ax.plot(frame["iteration"], [sampled_success(r) for r in logs[name]], marker="o",
                    label="success rate, sampled episodes" if guided else "success rate")
            if not np.allclose(frame["reward"], frame["success_rate"]):  # the efficiency reward is on
                ax.plot(frame["iteration"], frame["reward"], marker=".", alpha=0.7, label="reward")
                low = min(low, float(frame["reward"].min()))
        base = base_pass_rate(logs[name])
        if base is not None:
            ax.axhline(base, linestyle="--", color="0.35", label=label)
        ax.set_ylim(low - 0.05, 1.05)  # rates on a common scale: a small gain should look small
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("iteration")
        if ax.get_lines():
            ax.legend(fontsize=7)
    for ax in flat[len(names):]:
        ax.set_axis_off()
    if not names:
        flat[0].set_axis_on()
        flat[0].text(0.5, 0.5, "no adapters trained", ha="center", va="center", transform=flat[0].transAxes)
    for row in axes:
        row[0].set_ylabel("success rate")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
