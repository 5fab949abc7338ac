"""Does the thread governor change the evaluate stage's thread count? Its work timed, every change logged.

Runs `run_evaluate` on a finished run (cwd = its root: the stage reads `data/model` relative to it), with
`torch.set_num_threads` wrapped to record each call, governed (the pipeline's setting) or at a fixed count.
Prints seconds, the calls, and a digest of the stage's episode files (the same digest: the same episodes).
It rewrites that run's `data/evaluate/`: use a scratch copy.

    cd <finished run> && python /path/to/benchmarks/evaluate_threads.py [--threads 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from thread_governor import ThreadLog  # this folder: the script's own path entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="0: governed (the pipeline's setting)")
    args = ap.parse_args()
    log = ThreadLog(torch.get_num_threads())
    torch.set_num_threads = log  # the governor calls it through the torch module
    from trace_lib.config import load_params
    from trace_lib.stages.evaluate import run_evaluate

    root = Path(".")
    params = load_params(root / "params.yaml")
    params.rollout.threads = args.threads
    start = time.perf_counter()
    run_evaluate(params, root, progress=False)
    end = time.perf_counter()
    files = sorted((root / "data" / "evaluate").rglob("*.jsonl"))
    digest = hashlib.md5(b"".join(p.read_bytes() for p in files)).hexdigest()[:8]
    print(json.dumps({"threads": args.threads or "governed", "seconds": round(end - start, 1), "md5": digest,
                      "set_num_threads_calls": [(round(t - start, 2), n) for t, n in log.calls],
                      "seconds_below_full": round(log.seconds_below_full(start, end), 1)}))


if __name__ == "__main__":
    main()
