"""The retail domain (`env.name: retail`): procedural task families over τ²-bench's retail tools, the default target.

`env.py` is the environment and its session, `families.py` the task families, `policy.md` the agent's policy;
README.md says what a task asks and how it is scored. `build_env` and `build_tasks` are the registry's entry points
(`trace_lib.envs`).
"""

from __future__ import annotations

from trace_lib.envs.retail.env import build_env, build_tasks

__all__ = ["build_env", "build_tasks"]
