"""Environment registry: `make_env(cfg)` and `make_tasks(cfg, split)` by the name in params.

Each environment module exposes `build_env(cfg: EnvConfig) -> Environment` and
`build_tasks(cfg: EnvConfig, split: str) -> list[Task]`; modules are imported lazily so that a
run on the built-in environment never imports τ²-bench's evaluator, and vice versa.
"""

from __future__ import annotations

import importlib

from trace_lib.config import EnvConfig
from trace_lib.envs.base import Environment
from trace_lib.records import Task

_MODULES = {
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
    return _module(cfg.name).build_env(cfg)


def make_tasks(cfg: EnvConfig, split: str) -> list[Task]:
    """The environment's tasks for `split`, in a stable order."""
    return _module(cfg.name).build_tasks(cfg, split)
