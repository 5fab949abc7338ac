"""What every stage notebook runs first, right after its parameters: the working directory and quiet dependencies.

JupyterLab starts a notebook's kernel in `notebooks/`, while the stages read `params.yaml` and write `data/` from the
repository root, where papermill runs them. Dependencies print notices that say nothing about the run (tau2's
"No .env file found", tqdm's "IProgress not found" without ipywidgets, transformers' deprecation warnings and its
weight-loading bars); they are silenced here, for the notebook's process only. A saved notebook keeps every refresh
of a progress bar as a line, so tqdm's bars are off (`TQDM_DISABLE`) and the episode loop prints one summary line
per batch instead.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path


def project_root(params_path: str | Path, cwd: Path | None = None) -> Path:
    """The folder the stage should run in: `cwd` itself, or its parent when `cwd` is the `notebooks/` folder of a
    checkout whose params file lies one level up (a notebook opened in JupyterLab)."""
    cwd = cwd or Path.cwd()
    if Path(params_path).is_absolute() or (cwd / params_path).exists():
        return cwd
    if cwd.name == "notebooks" and (cwd.parent / params_path).exists():
        return cwd.parent
    return cwd


def setup_notebook(params_path: str | Path) -> Path:
    """Move to `project_root(params_path)`, silence the dependencies' notices; returns the working directory."""
    root = project_root(params_path)
    if root != Path.cwd():
        os.chdir(root)
    os.environ.setdefault("TQDM_DISABLE", "1")  # every tqdm bar; `agent.rollout.Progress` prints a line instead
    warnings.filterwarnings("ignore", message="IProgress not found")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")
    try:
        from loguru import logger
    except ImportError:
        pass
    else:
        logger.disable("tau2.utils.utils")  # "No .env file found": tau2's API keys, which the package never uses
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        pass
    else:
        hf_logging.disable_progress_bar()
    return root
