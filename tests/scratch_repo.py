"""A scratch copy of this repository (git + dvc, tiny params) where the end-to-end tests run whole stages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml


REPO = Path(__file__).resolve().parents[1]


BIN = Path(sys.executable).parent


def run_checked(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def tiny_params(model_dir: Path) -> dict:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"]["id"] = str(model_dir)
    params["env"].update({"tasks_per_family": 1, "test_tasks_per_family": 1, "validation_tasks_per_family": 1,
                          "max_steps": 3})
    # a tiny random model is in no calibration band: the environments would all be dropped
    params["synthesize"]["calibration"] = {"enabled": False}
    params["score"]["max_kept"] = None  # every capability that passes trains (the cpu profile keeps one)
    params["rollout"].update({"samples_per_task": 1, "max_new_tokens": 24, "batch_size": 4})
    return params


def rules_params(model_dir: Path, train: dict) -> dict:
    """`tiny_params` with the rules analyst, every candidate capability kept (the tiny model never
    succeeds, so no capability has a gap to show) and the given `train` section."""
    params = tiny_params(model_dir)
    params["analyst"]["backend"] = "rules"
    params["score"]["empty_rate"] = 0.0
    params["train"] = train
    params["evaluate"].update({"n_boot": 100})
    return params


def make_scratch_repo(root: Path, params: dict) -> Path:
    """`root` made a git + dvc repo holding a copy of the library, notebooks, tests and dvc.yaml, with
    `params` as its params.yaml."""
    for name in ("trace_lib", "notebooks", "tests"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", ".gitignore"):
        shutil.copy(REPO / name, root / name)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    run_checked(["git", "init", "-q"], root)
    run_checked([str(BIN / "dvc"), "init", "-q"], root)
    return root
