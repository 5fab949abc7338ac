"""Decoding speed on a busy machine: torch threads x OpenMP wait policy x competing busy processes.

Each cell runs `rollout_throughput.py --rows batched-bf16-kv` (the rollout engine: shared-prefix
prefill, then batched decoding with each episode's KV kept across turns) in a fresh subprocess, so the
OpenMP variables apply from the start, while `--hogs` other processes spin on the CPU (busy loops, as
another job on a shared machine would). Reports agent tokens/s per cell and the ratio to the idle
cell of the same configuration.

torch's CPU build uses GNU OpenMP (libgomp). By default a thread that reaches the end of a parallel
region first spins while it waits for its partner; when the partner has been descheduled (the cores
are shared with other work), the spinning thread takes the core it needs. `OMP_WAIT_POLICY=PASSIVE`
makes waiting threads sleep instead; `GOMP_SPINCOUNT=N` (policy `spin:N`) spins N times, then sleeps;
`default` is libgomp's own (300,000 spins). Threads `auto`: the pipeline's default, torch's count while
the other processes leave the cores free, fewer while they do not (`trace_lib/engine/threads.py`).

    python benchmarks/threads_under_load.py --hogs 0,1,2 --threads 1,2 --policies default,passive
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def spin(stop: float) -> None:
    """A busy loop until `stop` (time.time())."""
    x = 0
    while time.time() < stop:
        x += 1


def run_cell(threads: str, policy: str, hogs: int, args: argparse.Namespace) -> float | None:
    """Agent tokens/s of one configuration while `hogs` busy processes run."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif policy.startswith("spin:"):  # spin this many times, then sleep
        env["GOMP_SPINCOUNT"] = policy.removeprefix("spin:")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "rollout_throughput.py"), "--model-dir", args.model_dir,
           "--episodes", str(args.episodes), "--turns", str(args.turns), "--new-tokens", str(args.new_tokens),
           "--threads", "0" if threads == "auto" else threads, "--rows", "batched-bf16-kv"]
    procs = [mp.Process(target=spin, args=(time.time() + args.max_seconds,), daemon=True) for _ in range(hogs)]
    for p in procs:
        p.start()
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.max_seconds, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None
    finally:
        for p in procs:
            p.terminate()
            p.join()
    match = re.search(r"^batched-bf16-kv \((\d+), ([\d.]+)\)", out.stdout, re.M)
    if not match:
        raise RuntimeError(f"no result in the output:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return int(match.group(1)) / float(match.group(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="data/model")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", default="1,2,auto")
    ap.add_argument("--policies", default="default,passive")
    ap.add_argument("--hogs", default="0,1,2")
    ap.add_argument("--max-seconds", type=float, default=600, help="a cell slower than this reports n/a")
    args = ap.parse_args()
    configs = [(t, p) for t in args.threads.split(",") for p in args.policies.split(",")]
    hog_counts = [int(h) for h in args.hogs.split(",")]
    results: dict[tuple[str, str, int], float | None] = {}
    for hogs in hog_counts:
        for threads, policy in configs:
            results[threads, policy, hogs] = run_cell(threads, policy, hogs, args)
            print(f"threads={threads} policy={policy} hogs={hogs}: {results[threads, policy, hogs]}", flush=True)
    print(f"\nepisodes={args.episodes} turns={args.turns} new_tokens/turn={args.new_tokens} cores={os.cpu_count()}")
    print("| threads | OMP wait policy | " + " | ".join(f"{h} busy processes: tok/s (vs idle)" for h in hog_counts) + " |")
    print("| ---: | --- |" + " ---: |" * len(hog_counts))
    for threads, policy in configs:
        idle = results.get((threads, policy, 0))
        cells = []
        for h in hog_counts:
            v = results[threads, policy, h]
            cells.append("n/a (timed out)" if v is None else
                         f"{v:.1f}" + (f" ({v / idle:.2f}x)" if idle and h else ""))
        print(f"| {threads} | {policy} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
