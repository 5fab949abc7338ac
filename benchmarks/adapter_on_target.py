"""Does an adapter change what the agent solves on the target? Each given adapter on every task of the target's
test split (no routing), greedy, beside the base model; successes overall and per family.

Reads a finished `dvc repro` under --root (data/model, data/rollouts/tasks-test.jsonl, params.yaml) and the
adapter folders named on the command line (e.g. those `hint_swap.py --out DIR` trained); prints one JSON object
and writes nothing.

    .venv/bin/python benchmarks/adapter_on_target.py --root <a finished repro> \\
        late0=DIR/hint0-pc50-late0 late100=DIR/hint0-pc50-late100
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from trace_lib.engine.policy import load_policy
from trace_lib.config import load_params
from trace_lib.envs import load_tasks, make_env
from trace_lib.evaluation.runner import eval_rollout_config, evaluate_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit", type=int, default=0, help="only the first N tasks (0: all)")
    ap.add_argument("adapters", nargs="*", help="NAME=ADAPTER_DIR")
    args = ap.parse_args()
    root = Path(args.root)
    params = load_params(root / "params.yaml")
    adapters = dict(a.split("=", 1) for a in args.adapters)
    tasks = load_tasks(params.env, args.split, root)
    tasks = tasks[: args.limit] if args.limit else tasks
    policy = load_policy(root / params.model.out_dir, dtype=params.model.dtype, adapters=adapters)
    cfg = eval_rollout_config(params.rollout, params.evaluate)
    result: dict = {"split": args.split, "tasks": len(tasks), "policies": {}}
    for name in [None, *adapters]:
        t0 = time.perf_counter()
        trajs = evaluate_policy(policy, tasks, lambda: make_env(params.env), cfg, params.seed, routing=name)
        solved = {t.task_id: t.success for t in trajs}
        families: dict[str, int] = {}
        for task in tasks:
            families[task.family] = families.get(task.family, 0) + int(solved[task.id])
        result["policies"][name or "base"] = {"successes": sum(solved.values()), "families": families,
                                              "solved": sorted(k for k, v in solved.items() if v),
                                              "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
