"""Stage `rollout`: the base agent on the target environment's train split (paper §3.1, first step).

Reads params.yaml (`model`, `policy`, `env`, `rollout`; `evaluate.split`) and the prepared model folder
(`model.out_dir`, taken from the working directory so sweeps share it), or with `policy.backend:
openai` sends the turns to that server instead (engine/remote.py); writes the target's tasks of
the rollout and evaluation splits (`data/rollouts/tasks-<split>.jsonl`, written once here and read
by every later stage), the trajectories (`data/rollouts/<split>.jsonl`, sorted by id, no timings so
the bytes repeat) and `reports/metrics/rollout.json` (success rate with 95% CI, per family, tool
calls, invalid-action rate, tokens/s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_lib.engine.backends import check_model_dir, open_policy
from trace_lib.engine.model import numerics
from trace_lib.agent.rollout import collect_rollouts, summarize
from trace_lib.config import Params
from trace_lib.envs import make_env, make_tasks, task_split
from trace_lib.io import write_json, write_jsonl
from trace_lib.paths import Paths


def run_rollout(params: Params, root: Path = Path("."), *, progress: bool = True) -> dict[str, Any]:
    """The whole stage: write the tasks, load the policy, roll out, write trajectories and metrics."""
    model_dir = Path(params.model.out_dir)
    check_model_dir(params.policy, model_dir)  # before any file is written
    paths = Paths(root)
    by_split = {s: make_tasks(params.env, s)
                for s in sorted({params.rollout.split, task_split(params.env.name, params.evaluate.split)})}
    for split, split_tasks in by_split.items():
        write_jsonl(paths.tasks(split), split_tasks)
    from trace_lib.engine.threads import set_threads  # torch is imported only when the stage runs

    set_threads(params.rollout.threads)
    tasks = by_split[params.rollout.split][: params.rollout.max_tasks]
    if not tasks:
        raise ValueError(f"env {params.env.name!r} has no tasks for split {params.rollout.split!r}")
    policy = open_policy(params.model, params.policy, model_dir)
    trajectories, timing = collect_rollouts(
        policy, lambda: make_env(params.env), tasks, params.rollout, params.seed, progress=progress
    )
    write_jsonl(paths.rollouts(params.rollout.split), trajectories)
    metrics = {
        "env": params.env.name,
        "split": params.rollout.split,
        "policy_id": policy.policy_id,
        "constrained": params.rollout.constrained,
        "temperature": params.rollout.temperature,
        **summarize(trajectories),
        "numerics": numerics(getattr(policy, "device", None)),
        "backend": params.policy.backend,
        "timing": {
            "seconds": round(timing.seconds, 2),
            "seconds_per_episode": round(timing.seconds / max(1, timing.episodes), 3),
            "agent_tokens_per_second": round(timing.tokens_per_second, 2),
        },
    }
    if params.policy.backend == "openai":
        metrics["server"] = {"base_url": params.policy.base_url, **policy.stats.as_dict()}
    write_json(paths.metrics("rollout"), metrics)
    return metrics
