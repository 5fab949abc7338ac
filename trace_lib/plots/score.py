"""Figures of the score stage: pure functions from CapabilityScore records / run rows to Figures.

Reads nothing and writes nothing (the notebook saves with `trace_lib.plots.theme.save_figure`).
Mirrors the paper's selection view (§3.1): error rates in successes vs failures per candidate,
Δ against coverage with the δ/ρ thresholds, and how stable the selection is across the n runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from trace_lib.records import CapabilityScore  # noqa: E402


def scores_table(scores: Sequence[CapabilityScore]) -> pd.DataFrame:
    """One row per candidate, kept first then by Δ; undefined values stay NaN."""
    rows = [{"capability": s.capability_id, "N+": s.n_pos, "E+": s.e_pos, "ER+": s.er_pos,
             "N-": s.n_neg, "E-": s.e_neg, "ER-": s.er_neg, "delta": s.delta,
             "ci_low": s.delta_ci[0] if s.delta_ci else None, "ci_high": s.delta_ci[1] if s.delta_ci else None,
             "coverage": s.coverage, "kept_runs": s.kept_runs, "n_runs": s.n_runs, "kept": s.kept,
             "reason": s.reason} for s in scores]
    df = pd.DataFrame(rows, columns=["capability", "N+", "E+", "ER+", "N-", "E-", "ER-", "delta", "ci_low",
                                     "ci_high", "coverage", "kept_runs", "n_runs", "kept", "reason"])
    df[["ER+", "ER-", "delta", "ci_low", "ci_high", "coverage"]] = df[
        ["ER+", "ER-", "delta", "ci_low", "ci_high", "coverage"]].astype(float)
    return df.sort_values(["kept", "delta"], ascending=[False, False], na_position="last").reset_index(drop=True)


def _label(name: str, kept: bool) -> str:
    return f"{name} ✓" if kept else name


def error_rate_bars(scores: Sequence[CapabilityScore], title: str = "") -> plt.Figure:
    """ER+ and ER- side by side per candidate (kept ones marked ✓); a missing bar is undefined."""
    df = scores_table(scores)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.0 * len(df) + 2), 3.8))
    x = np.arange(len(df))
    pal = sns.color_palette()
    ax.bar(x - 0.2, df["ER+"].fillna(0), 0.4, label="ER+ (successes)", color=pal[2])
    ax.bar(x + 0.2, df["ER-"].fillna(0), 0.4, label="ER- (failures)", color=pal[3])
    for i, row in df.iterrows():
        for dx, col, n in ((-0.2, "ER+", "N+"), (0.2, "ER-", "N-")):
            txt = "n/a" if np.isnan(row[col]) else f"n={int(row[n])}"
            ax.text(i + dx, (0 if np.isnan(row[col]) else row[col]) + 0.02, txt, ha="center", fontsize=7)
    ax.set_xticks(x, [_label(c, k) for c, k in zip(df["capability"], df["kept"], strict=True)],
                  rotation=25, ha="right", fontsize=8)
    ax.set_ylim(0, 1.3)
    ax.set_ylabel("error rate (LACKING / relevant)")
    ax.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def delta_coverage(scores: Sequence[CapabilityScore], delta: float, rho: float, title: str = "") -> plt.Figure:
    """Δ against coverage with the δ and ρ lines; the kept region is the upper right; CI whiskers on Δ."""
    df = scores_table(scores).dropna(subset=["delta", "coverage"])
    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    pal = sns.color_palette()
    for kept, color, name in ((True, pal[2], "kept"), (False, pal[7], "not kept")):
        part = df[df["kept"] == kept]
        if part.empty:
            continue
        err = None
        if part["ci_low"].notna().all():
            err = [part["delta"] - part["ci_low"], part["ci_high"] - part["delta"]]
        ax.errorbar(part["coverage"], part["delta"], yerr=err, fmt="o", color=color, label=name, capsize=3)
        for i, (_, row) in enumerate(part.iterrows()):
            # Staggered so that candidates with equal Δ and coverage stay readable.
            ax.annotate(row["capability"], (row["coverage"], row["delta"]), fontsize=7,
                        xytext=(4, 4 - 9 * (i % 3)), textcoords="offset points")
    ax.axhline(delta, ls="--", color="grey", lw=1)
    ax.axvline(rho, ls=":", color="grey", lw=1)
    ax.text(1.0, delta, f" δ={delta:g}", va="bottom", ha="right", fontsize=8, color="grey")
    ax.text(rho, -1.0, f" ρ={rho:g}", va="bottom", fontsize=8, color="grey")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-1.05, 1.12)
    ax.set_xlabel("coverage E-(c) / |D-|")
    ax.set_ylabel("Δ(c) = ER-(c) − ER+(c)")
    if len(df):
        ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def stability(runs: Sequence[dict[str, Any]], k_keep: int, delta: float | None = None, title: str = "") -> plt.Figure:
    """Left: in how many of the n runs each candidate was selected (k marked). Right: Δ across runs."""
    df = pd.DataFrame(list(runs), columns=["run", "capability_id", "delta", "coverage", "selected"])
    n_runs = int(df["run"].nunique()) if len(df) else 0
    counts = (df.groupby("capability_id")["selected"].sum().sort_values(ascending=False)
              if len(df) else pd.Series(dtype=int))
    order = list(counts.index)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(7.0, 0.9 * len(order) + 4), 3.8))
    pal = sns.color_palette()
    ax1.bar(range(len(order)), counts.values, color=[pal[2] if c >= k_keep else pal[7] for c in counts.values])
    ax1.axhline(k_keep, ls="--", color="grey", lw=1)
    ax1.set_xticks(range(len(order)), order, rotation=25, ha="right", fontsize=8)
    ax1.set_ylim(0, max(1, n_runs) + 0.5)
    ax1.set_ylabel(f"runs selected (of {n_runs}); k={k_keep}")
    data = [df.loc[df["capability_id"] == c, "delta"].dropna().astype(float).to_numpy() for c in order]
    if any(len(d) for d in data):
        ax2.boxplot([d if len(d) else [np.nan] for d in data], positions=range(len(order)), widths=0.5)
    ax2.set_xticks(range(len(order)), order, rotation=25, ha="right", fontsize=8)
    if delta is not None:
        ax2.axhline(delta, ls="--", color="grey", lw=1)
    ax2.set_ylabel("Δ across runs")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
