"""Every figure of the pipeline, made in the library: one module per stage's figures.

Pure functions from records/DataFrames to a matplotlib Figure. The theme is set once
(`set_theme`) and figures are written by `save_figure` (both in `trace_lib.plots.theme`).
"""

from trace_lib.plots.theme import save_figure, set_theme

__all__ = ["save_figure", "set_theme"]
