"""The τ²-bench domains (`env.name: tau2-retail`, `tau2-airline`), run and scored the way τ²-bench runs them.

`env.py` is the environment, its tasks and scoring; `scenario.py` turns a task's user scenario into the
scripted user's facts; the LLM user is `trace_lib.envs.llm_user`, shared with the phone. README.md says what a task asks and how it is scored.
`build_env` and `build_tasks` are the registry's entry points (`trace_lib.envs`).
"""

from __future__ import annotations

from trace_lib.envs.tau2.env import build_env, build_tasks

__all__ = ["build_env", "build_tasks"]
