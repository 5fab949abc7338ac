"""Figures of the rollout stage: the base agent's success per task family.

Pure functions from the rollout metrics (`reports/metrics/rollout.json`) to a DataFrame or a Figure.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns


def rates_table(by_group: dict[str, dict[str, float]], group: str = "family") -> pd.DataFrame:
    """Per-group success table (n, successes, rate, 95% CI) from a metrics `by_*` mapping."""
    rows = [{group: g, **v} for g, v in by_group.items()]
    return pd.DataFrame(rows, columns=[group, "n", "successes", "success_rate", "ci_low", "ci_high"])


def success_by_group(table: pd.DataFrame, group: str = "family", title: str = "") -> plt.Figure:
    """Bar chart of success rate per group with 95% CI whiskers and n under each bar."""
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(table) + 1.5), 3.6))
    x = range(len(table))
    rate = table["success_rate"].to_numpy()
    err = [rate - table["ci_low"].to_numpy(), table["ci_high"].to_numpy() - rate]
    ax.bar(x, rate, yerr=err, capsize=4, color=sns.color_palette()[0])
    ax.set_xticks(list(x), [f"{g}\n(n={int(n)})" for g, n in zip(table[group], table["n"], strict=True)],
                  rotation=20, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("success rate")
    ax.set_title(title)
    fig.tight_layout()
    return fig
