"""Environment registry: `make_env(cfg)`, `make_tasks(cfg, split)` and `load_tasks` by the name in params.

Each environment module exposes `build_env(cfg: EnvConfig) -> Environment` and
`build_tasks(cfg: EnvConfig, split: str) -> list[Task]`; modules are imported lazily so that a
run on the built-in environment never imports τ²-bench's evaluator, and vice versa.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from trace_lib.config import EnvConfig
from trace_lib.envs.base import Environment
from trace_lib.io import read_jsonl
from trace_lib.paths import Paths
from trace_lib.records import Task

_MODULES = {
    "phone": "trace_lib.envs.phone",
    "retail": "trace_lib.envs.retail",
    "tau2-retail": "trace_lib.envs.tau2",
    "tau2-airline": "trace_lib.envs.tau2",
}


def env_names() -> list[str]:
    return sorted(_MODULES)


def _module(name: str):
    if name not in _MODULES:
        raise ValueError(f"env.name: unknown environment {name!r}; choose one of {env_names()}")
    return importlib.import_module(_MODULES[name])


def make_env(cfg: EnvConfig) -> Environment:
    """A fresh environment instance (one per concurrent episode)."""
    env = _module(cfg.name).build_env(cfg)
    env.end_on_repeat = cfg.end_on_repeated_call
    return env


def graded_reward(name: str) -> bool:
    """Whether environment `name` scores episodes between 0 and 1 with meaning (its module's `GRADED`, e.g.
    the phone's milestone similarity): Table 1 then shows the mean reward beside the success rate."""
    return bool(getattr(_module(name), "GRADED", False))


def make_tasks(cfg: EnvConfig, split: str) -> list[Task]:
    """The environment's tasks for `split`, in a stable order."""
    return _module(cfg.name).build_tasks(cfg, split)


def task_split(name: str, split: str) -> str:
    """The task set a split name means for environment `name`: 'all' is τ²-bench's whole 'base' set."""
    return "base" if split == "all" and name.startswith("tau2") else split


def load_tasks(cfg: EnvConfig, split: str, root: Path) -> list[Task]:
    """The target's tasks of `split` as the rollout stage wrote them (`data/rollouts/tasks-<split>.jsonl`).

    Tasks are data: written once, read by every later stage. Another environment than the one rolled
    out (an extra entry of `evaluate.envs`) has no such file and is generated here, deterministically."""
    path = Paths(root).tasks(split)
    if path.is_file():
        tasks = read_jsonl(path, Task)
        if all(t.env == cfg.name for t in tasks):
            return tasks
    return make_tasks(cfg, split)
