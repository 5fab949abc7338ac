"""The phone environment: a ToolSandbox-style stateful target with milestone scoring (`env.name: phone`).

Reads its scenarios from `scenarios.py` (procedural, seeded) and the places dataset next to
`world.py`; writes nothing. The paper's second benchmark is ToolSandbox (arXiv 2408.04682): a phone
whose settings, contacts, messages and reminders the tools read and change, with dependencies between
tools that the agent discovers from errors, and episodes scored by how well their snapshots match a
DAG of milestones, zero when a minefield is hit. ToolSandbox itself needs Python 3.12, old pinned
packages, an LLM user and web API keys; this package plays the same kind of scenarios offline.

`build_env` and `build_tasks` are the registry's entry points (`trace_lib.envs`). The episode's
reward is the milestone similarity in [0, 1]; a trajectory is a success when it is *perfect*
(similarity 1), so Table 1's success column counts perfect scenarios and its mean reward is the mean
similarity, as ToolSandbox reports them.
"""

from __future__ import annotations

from trace_lib.config import EnvConfig
from trace_lib.envs.phone.env import PhoneEnv, llm_user_factory
from trace_lib.envs.phone.scenarios import build_phone_tasks
from trace_lib.records import Task

__all__ = ["GRADED", "PhoneEnv", "build_env", "build_tasks"]

GRADED = True
"""Rewards are the milestone similarity in [0, 1], not only 0 or 1 (`trace_lib.envs.graded_reward`)."""


def build_env(cfg: EnvConfig) -> PhoneEnv:
    """A fresh PhoneEnv configured from the `env` params section."""
    factory = llm_user_factory(cfg) if cfg.user == "llm" else None
    return PhoneEnv(max_steps=cfg.max_steps, max_errors=cfg.max_errors, user_factory=factory)


def build_tasks(cfg: EnvConfig, split: str) -> list[Task]:
    """Seeded scenarios of `split` ('train', 'test' or 'all'), see `trace_lib.envs.phone.scenarios`."""
    return build_phone_tasks(cfg, split)
