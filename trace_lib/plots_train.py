"""Training-curve figures for the train stage (paper §3.3): pure functions from train logs to Figures.

Reads the rows of `data/adapters/<name>/train_log.jsonl` (one per GRPO iteration, written by
`trace_lib.train`); writes nothing (the notebook saves the figures with `plots.save_figure`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

CURVES = (("reward", "mean reward"), ("success_rate", "success rate"),
          ("frac_reward_zero_std", "groups with identical rewards"), ("tool_calls", "tool calls per episode"))
"""(log key, axis label) of the panels drawn for every adapter."""


def logs_frame(logs: Mapping[str, Sequence[dict[str, Any]]]) -> pd.DataFrame:
    """One row per (adapter, iteration) with every logged metric; adapters in name order."""
    rows = [{"adapter": name, **row} for name in sorted(logs) for row in logs[name]]
    return pd.DataFrame(rows)


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
