"""τ²-bench episodes played and scored: a database shared copy-on-write against a private copy per environment.

Every τ² episode builds three τ² environments: one to play in, and the evaluator's two replays (the
gold actions, the agent's calls), whose database hashes are compared. `fresh_tau2_env` shares the
domain's database among them until one may write (module docstring of `trace_lib.envs.tau2.env`); the
`private` row builds them the way it did before: each unpickles its own copy of the database and the
evaluator hashes both.

Two workloads per domain, every task of τ²'s `base` set, scripted user:
* `do-nothing`: the agent says one sentence; the scripted user ends the episode; τ²'s reward.
* `gold`: the task's gold actions replayed as the agent's tool calls; τ²'s reward.

Both rows play the same episodes, one after the other in this process; the rewards must agree task by
task (the run stops otherwise).

    .venv/bin/python benchmarks/tau2_scoring.py [--domains retail,airline] [--rows private,shared]
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trace_lib.config import EnvConfig  # noqa: E402
from trace_lib.envs import make_env, make_tasks  # noqa: E402
from trace_lib.envs.tau2 import env as tau2  # noqa: E402
from trace_lib.envs.tau2.env import replay_gold  # noqa: E402
from trace_lib.records import Message  # noqa: E402


def private_tau2_env(domain: str, solo_mode: bool = False):
    """The constructor before copy-on-write: a private unpickled database for every environment."""
    return tau2.domain_module(domain).get_environment(db=pickle.loads(tau2.pristine_db(domain).pickled), solo_mode=solo_mode)


CONSTRUCTORS: dict[str, Callable] = {"private": private_tau2_env, "shared": tau2.fresh_tau2_env}
PAUSES: dict[str, Callable] = {"private": contextlib.nullcontext, "shared": tau2.gc_paused}


def do_nothing(env, task) -> float:
    env.reset(task)
    env.step(Message(role="assistant", content="Hello."))
    return env.reward()[0]


def gold(env, task) -> float:
    return replay_gold(env, task)[0]


def run(domain: str, workload: Callable, row: str) -> tuple[list[float], float]:
    cfg = EnvConfig(name=f"tau2-{domain}", max_steps=200, max_errors=10)
    tasks = make_tasks(cfg, "base")
    env = make_env(cfg)
    shared, paused = tau2.fresh_tau2_env, tau2.gc_paused
    # the module's own lookups (reset, the evaluator) see them
    tau2.fresh_tau2_env, tau2.gc_paused = CONSTRUCTORS[row], PAUSES[row]
    try:
        start = time.perf_counter()
        rewards = [workload(env, t) for t in tasks]
        return rewards, time.perf_counter() - start
    finally:
        tau2.fresh_tau2_env, tau2.gc_paused = shared, paused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--domains", default="retail,airline")
    ap.add_argument("--rows", default="private,shared")
    args = ap.parse_args()
    rows = args.rows.split(",")
    unknown = set(rows) - set(CONSTRUCTORS)
    if unknown:
        ap.error(f"--rows: unknown {sorted(unknown)}; choose from {sorted(CONSTRUCTORS)}")
    for domain in args.domains.split(","):
        tau2.pristine_db(domain)  # loading the database once is not what is compared
        tau2.tool_specs(domain)
        for name, workload in (("do-nothing", do_nothing), ("gold", gold)):
            results = {row: run(domain, workload, row) for row in rows}
            first = results[rows[0]][0]
            for row, (rewards, seconds) in results.items():
                if rewards != first:
                    raise SystemExit(f"{domain} {name}: rewards of {row} differ from {rows[0]}'s")
                print(f"{domain:8s} {name:10s} {row:8s} {len(rewards):4d} episodes  {seconds:7.2f} s  "
                      f"{1000 * seconds / len(rewards):7.1f} ms/episode  reward sum {sum(rewards):.0f}", flush=True)
        assert tau2.pristine_db_intact(domain), f"{domain}: the shared database was written"


if __name__ == "__main__":
    main()
