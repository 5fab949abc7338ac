"""The rollout stage's work with torch's thread count governed (`trace_lib.engine.threads`) against fixed.

One process, one loaded policy, the same tasks and seed per row; rows alternate over repeats so that a
machine whose speed drifts favours none. `governed` is what the pipeline runs (`rollout.threads: 0`);
`fixed-N` sets N threads and never changes them. Every `torch.set_num_threads` call the governor makes is
counted, with the seconds spent below the full count, so a governor that gives up threads on an idle
machine shows. Reports seconds, agent tokens/s and whether the trajectories are the same as the first row's.

    python benchmarks/thread_governor.py [--params params.yaml] [--tasks 14] [--rows governed,fixed-2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

from trace_lib.engine import threads
from trace_lib.engine.backends import open_policy
from trace_lib.agent.rollout import collect_rollouts
from trace_lib.config import load_params
from trace_lib.envs import make_env, make_tasks
from trace_lib.io import dumps_json


class ThreadLog:
    """Wraps torch.set_num_threads: when each count was set, to add up the time spent below `full`."""

    def __init__(self, full: int) -> None:
        self.full, self.calls, self._set = full, [], torch.set_num_threads

    def __call__(self, n: int) -> None:
        self.calls.append((time.perf_counter(), n))
        self._set(n)

    def seconds_below_full(self, start: float, end: float) -> float:
        below, since = 0.0, None
        for t, n in self.calls:
            if t < start:
                continue
            if n < self.full and since is None:
                since = t
            elif n >= self.full and since is not None:
                below, since = below + t - since, None
        return below + (end - since if since is not None else 0.0)


def _row(name: str, params, policy, tasks, log: ThreadLog) -> dict:
    gov = threads.governor()
    if name == "governed":  # undo an earlier row's fix(): the full count, and no sample from before this row
        gov.fixed, gov.max_threads = False, log.full
        gov.restore()
    else:
        gov.fix(int(name.split("-", 1)[1]))
    start, n_calls = time.perf_counter(), len(log.calls)
    trajs, timing = collect_rollouts(policy, lambda: make_env(params.env), tasks, params.rollout, params.seed,
                                     progress=False)
    end = time.perf_counter()
    same = dumps_json([t.model_dump(mode="json", exclude={"seconds"}) for t in trajs])
    return {"row": name, "seconds": round(end - start, 1),
            "agent_tokens_per_second": round(timing.tokens_per_second, 2),
            "set_num_threads_calls": len(log.calls) - n_calls,
            "seconds_below_full": round(log.seconds_below_full(start, end), 1) if name == "governed" else None,
            "trajectories_md5": hashlib.md5(same.encode()).hexdigest()[:8]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--tasks", type=int, default=14, help="first tasks of the rollout split")
    ap.add_argument("--rows", default="governed,fixed-2")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    params = load_params(args.params)
    full = torch.get_num_threads()
    log = ThreadLog(full)
    torch.set_num_threads = log  # the governor calls it through the torch module
    policy = open_policy(params.model, params.policy, Path(params.model.out_dir))  # as the rollout stage opens it
    tasks = make_tasks(params.env, params.rollout.split)[: args.tasks]
    rows = args.rows.split(",")
    out = []
    for r in range(args.repeats):
        for name in (rows if r % 2 == 0 else rows[::-1]):
            out.append({"repeat": r, **_row(name, params, policy, tasks, log)})
            print(json.dumps(out[-1]), flush=True)
    first = out[0]["trajectories_md5"]
    print(json.dumps({"threads": full, "tasks": len(tasks), "episodes": len(tasks) * params.rollout.samples_per_task,
                      "same_trajectories": all(o["trajectories_md5"] == first for o in out)}))


if __name__ == "__main__":
    main()
