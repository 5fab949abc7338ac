"""Figures shared by the notebooks: pure functions from metrics/records to matplotlib Figures.

The seaborn theme is set once (`set_theme`); `save_figure` writes PNGs atomically and without a
software-version stamp so an unchanged figure keeps the same bytes.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from trace_lib.io import atomic_write_bytes


def set_theme() -> None:
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")


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


def save_figure(fig: plt.Figure, path: str | Path, dpi: int = 120) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return atomic_write_bytes(path, buf.getvalue())


def metrics_overview(metrics: dict[str, Any], keys: tuple[str, ...]) -> pd.DataFrame:
    """A two-column table of the scalar metrics named in `keys`."""
    return pd.DataFrame([{"metric": k, "value": metrics.get(k)} for k in keys])
