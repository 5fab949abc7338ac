"""The one seaborn theme of every figure, and the writer that keeps an unchanged figure's bytes.

`set_theme` is called once per notebook; `save_figure` writes PNGs atomically and without a
software-version stamp so an unchanged figure keeps the same bytes.
"""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns

from trace_lib.io import atomic_write_bytes


def set_theme() -> None:
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")


def save_figure(fig: plt.Figure, path: str | Path, dpi: int = 120) -> Path:
    """Write `fig` as PNG (no software tag, so equal figures give equal bytes) and close it: a notebook shows the
    saved file, not the figure a second time."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
