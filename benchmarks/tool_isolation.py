"""What running every tool call in a forked copy (`trace_lib.envs.limits`) costs a rollout.

The rollout stage's own work, twice in one process on the same tasks and seed: once with the
environment's tool calls isolated (the default: a forked copy under a time, memory and output limit)
and once run in this process as before (`Environment.isolate_tools = False`). Rows alternate so that
a machine whose speed drifts favours neither. Reports seconds, tool calls and seconds per tool call
of each, whether the trajectories are the same, and the fork cost alone (a no-op tool, in this process
with the model loaded).

    python benchmarks/tool_isolation.py [--params params.yaml] [--tasks 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from trace_lib.engine.policy import load_policy
from trace_lib.agent.rollout import collect_rollouts
from trace_lib.config import load_params
from trace_lib.envs import make_env, make_tasks
from trace_lib.envs.base import Environment
from trace_lib.envs.limits import ToolLimits, call_limited
from trace_lib.io import dumps_json


def _rollout(params, policy, tasks, isolate: bool) -> tuple[float, int, str]:
    def env() -> Environment:
        e = make_env(params.env)
        e.isolate_tools = isolate
        return e

    t0 = time.perf_counter()
    trajs, _ = collect_rollouts(policy, env, tasks, params.rollout, params.seed, progress=False)
    seconds = time.perf_counter() - t0
    same = dumps_json([t.model_dump(mode="json", exclude={"seconds"}) for t in trajs])
    return seconds, sum(t.tool_calls for t in trajs), same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    params = load_params(args.params)
    if params.rollout.threads:
        import torch

        torch.set_num_threads(params.rollout.threads)
    policy = load_policy(Path(params.model.out_dir), dtype=params.model.dtype)
    tasks = make_tasks(params.env, params.rollout.split)[: args.tasks]

    forks = []
    for _ in range(50):
        t0 = time.perf_counter()
        call_limited(lambda: ("ok", False), ToolLimits())
        forks.append(time.perf_counter() - t0)
    print(f"fork of a no-op tool call with the model loaded: median {1000 * statistics.median(forks):.1f} ms")

    rows: dict[str, list[float]] = {"isolated": [], "in-process": []}
    outputs: dict[str, set[str]] = {"isolated": set(), "in-process": set()}
    calls = 0
    for r in range(args.repeats):
        order = ("isolated", "in-process") if r % 2 == 0 else ("in-process", "isolated")
        for row in order:
            seconds, calls, out = _rollout(params, policy, tasks, isolate=row == "isolated")
            rows[row].append(seconds)
            outputs[row].add(out)
            print(f"repeat {r} {row}: {seconds:.1f} s, {calls} tool calls", flush=True)
    result = {row: {"seconds": [round(s, 1) for s in secs], "median_seconds": round(statistics.median(secs), 1)}
              for row, secs in rows.items()}
    extra = statistics.median(rows["isolated"]) - statistics.median(rows["in-process"])
    result["tool_calls"] = calls
    result["extra_seconds_per_tool_call"] = round(extra / max(1, calls), 3)
    result["ratio"] = round(statistics.median(rows["isolated"]) / statistics.median(rows["in-process"]), 3)
    result["same_trajectories"] = len(outputs["isolated"] | outputs["in-process"]) == 1
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
