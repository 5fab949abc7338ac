"""Figures of the evaluate and scaling stages: pure functions from method runs / matrices to matplotlib Figures.

Reads nothing and writes nothing (the stages `stages/evaluate.py` and `stages/scaling.py`
save them with `trace_lib.plots.theme.save_figure`). Mirrors the paper's Table 1 as bars with intervals,
the adapter interference analysis as a heatmap, the router's choices against the oracle's, and success
against rollout budget (the scaling figure).
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

from trace_lib.evaluation.tables import interference_frame, ordered_rows, success_interval  # noqa: E402


TRACE_METHODS = ("trace", "distilled")


def placeholder(text: str) -> plt.Figure:
    """A small figure that only says why there is nothing to draw (so every declared plot exists)."""
    fig, ax = plt.subplots(figsize=(5, 1.6))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, wrap=True)
    return fig


def success_by_method(runs: Sequence[Any], title: str = "") -> plt.Figure:
    """Horizontal bars: overall success per method with its interval; methods not run are named as such."""
    fig, ax = plt.subplots(figsize=(6.4, 0.42 * max(3, len(runs)) + 1.2))
    pal = sns.color_palette()
    y = np.arange(len(runs))
    for i, r in enumerate(runs):
        if not r.ran:
            ax.text(0.01, i, "not run", va="center", fontsize=8, color="0.45")
            continue
        o = r.summary["overall"]
        lo, hi = success_interval(o)
        # TRACE's rows (routed adapters, and the student distilled from them) apart from the baselines
        color = pal[2] if r.method in TRACE_METHODS else pal[0] if r.key != "base" else "0.55"
        ax.barh(i, o["success_rate"], color=color, xerr=[[max(0.0, o["success_rate"] - lo)], [max(0.0, hi - o["success_rate"])]],
                capsize=3)
        ax.text(min(0.98, hi + 0.02), i, f"{100 * o['success_rate']:.1f}% ({o['successes']}/{o['n']})",
                va="center", fontsize=7)
    ax.set_yticks(y, [r.label for r in runs], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("success rate (95% Wilson interval)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def interference_heatmap(matrix: pd.DataFrame, title: str = "") -> plt.Figure:
    """Adapter (rows) x capability environment (columns) success; the diagonal is each adapter at home."""
    if matrix.empty:
        return placeholder("interference not run: no synthetic environments, or evaluate.interference_seeds is 0")
    fig, ax = plt.subplots(figsize=(1.3 * max(2, matrix.shape[1]) + 2.5, 0.55 * max(2, matrix.shape[0]) + 1.5))
    sns.heatmap(matrix.astype(float), vmin=0, vmax=1, annot=True, fmt=".2f", cmap="viridis", ax=ax,
                cbar_kws={"label": "success rate"})
    ax.set_xlabel("capability environment")
    ax.set_ylabel("adapter")
    ax.tick_params(axis="x", rotation=25, labelsize=8)
    ax.tick_params(axis="y", rotation=0, labelsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def routing_confusion(quality: dict[str, Any], title: str = "") -> plt.Figure:
    """Counts of (oracle label, router label) over the tasks the oracle routes (`routing_quality`)."""
    if not quality.get("scored"):
        return placeholder(quality.get("note") or "routing not run: no capability adapters or no tagged tasks")
    labels = quality["labels"]
    counts = np.array([[quality["confusion"][o][r] for r in labels] for o in labels])
    fig, ax = plt.subplots(figsize=(1.0 * len(labels) + 2.5, 0.8 * len(labels) + 1.5))
    sns.heatmap(counts, annot=True, fmt="d", cmap="Blues", xticklabels=labels, yticklabels=labels, ax=ax, cbar=False)
    acc = quality.get("router_accuracy")
    rnd = quality.get("random_accuracy")
    ax.set_xlabel(f"router ({quality.get('router') or 'logits'}, argmax)")
    ax.set_ylabel("oracle (task tags)" if quality.get("oracle") == "tags" else "oracle (lacking capability)")
    ax.tick_params(axis="x", rotation=25, labelsize=8)
    ax.tick_params(axis="y", rotation=0, labelsize=8)
    ax.set_title(title or (f"accuracy {acc:.2f} (random {rnd:.2f})" if acc is not None else ""))
    fig.tight_layout()
    return fig


def evaluate_figures(runs: Sequence[Any], interference: Sequence[dict[str, Any]],
                     quality: dict[str, Any]) -> dict[str, Any]:
    """The evaluate stage's figures by name under reports/figures/, each made when called (one open at a time):
    success per method, the interference heatmap, the routing confusion."""
    return {"evaluate_success": lambda: success_by_method(ordered_rows(runs)),
            "evaluate_interference": lambda: interference_heatmap(interference_frame(interference)),
            "evaluate_routing_confusion": lambda: routing_confusion(quality)}


def scaling_curve(rows: Sequence[dict[str, Any]], title: str = "") -> plt.Figure:
    """Success against training rollouts per method (Wilson interval bars); methods not run are listed."""
    ran = [r for r in rows if "success_rate" in r]
    if not ran:
        return placeholder("no scaling point was evaluated: " + "; ".join(sorted({r["reason"] for r in rows})))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pal = sns.color_palette()
    for i, method in enumerate(dict.fromkeys(r["method"] for r in ran)):
        pts = sorted((r for r in ran if r["method"] == method), key=lambda r: r["budget"])
        x = [r["budget"] for r in pts]
        y = [r["success_rate"] for r in pts]
        bounds = [success_interval(r) for r in pts]
        ax.errorbar(x, y, yerr=[[max(0.0, a - lo) for a, (lo, _) in zip(y, bounds)],
                                [max(0.0, hi - a) for a, (_, hi) in zip(y, bounds)]],
                    marker="o", capsize=3, color=pal[i], label=method)
    missing = sorted({r["method"] for r in rows} - {r["method"] for r in ran})
    if missing:
        ax.text(0.99, 0.02, "not run: " + ", ".join(missing), transform=ax.transAxes, ha="right", fontsize=8,
                color="0.4")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("rollouts (TRACE: discovery + band checks + all adapters)")
    ax.set_ylabel("success rate (95% Wilson interval)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig
