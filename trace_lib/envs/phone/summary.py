"""Per-category results on the phone environment, as ToolSandbox reports them (perfect count, mean similarity).

Reads a run root's `data/rollouts/tasks-<split>.jsonl` and trajectories (the rollout stage's
`<split>.jsonl`, or any JSONL of trajectories); writes nothing. Run as
`python -m trace_lib.envs.phone.summary ROOT [--split test] [--trajectories PATH]` to print the table.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from trace_lib.envs.phone.scenarios import CATEGORIES
from trace_lib.records import Task, Trajectory


def category_table(tasks: Sequence[Task], trajectories: Sequence[Trajectory]) -> pd.DataFrame:
    """One row per scenario category (and `all`): episodes, perfect ones, mean similarity."""
    by_id = {t.id: t for t in tasks}
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for traj in trajectories:
        for cat in ["all", *by_id[traj.task_id].meta.get("categories", [])]:
            groups[cat].append(traj)
    rows = [{"category": cat, "episodes": len(groups[cat]), "perfect": sum(t.success for t in groups[cat]),
             "mean similarity": round(sum(t.reward for t in groups[cat]) / len(groups[cat]), 3)}
            for cat in ["all", *CATEGORIES] if groups.get(cat)]
    return pd.DataFrame(rows, columns=["category", "episodes", "perfect", "mean similarity"])


def main(argv: Sequence[str] | None = None) -> None:
    from trace_lib.io import read_jsonl
    from trace_lib.paths import Paths

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--split", default="test")
    ap.add_argument("--trajectories", type=Path, default=None)
    args = ap.parse_args(argv)
    tasks = read_jsonl(Paths(args.root).tasks(args.split), Task)
    trajs = read_jsonl(args.trajectories or Paths(args.root).rollouts(args.split), Trajectory)
    print(category_table(tasks, trajs).to_markdown(index=False))


if __name__ == "__main__":
    main()
