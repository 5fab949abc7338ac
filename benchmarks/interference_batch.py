"""The evaluate stage's interference matrix, timed: weight by weight against one batch per environment.

The matrix plays the base model and every capability adapter on every capability's synthetic environment
(`evaluate.interference_seeds` tasks each, greedy). Two arms, in one process, alternating over repeats:

    by-weight   `runner.interference_matrix(..., together=False)`: one batch per (weights, environment), each
                holding that environment's few seeds (2 rows in the CPU default)
    together    `together=True` (`evaluate.decode_together`): one batch per environment whose rows run under
                the base model and every adapter (`runner.decode_into_memo`, `engine.row_lora`)

Reads a finished pipeline run under `--root` (its trained adapters in data/adapters/, its synthetic
environments in data/envs/, the prepared model); writes nothing. Prints each arm's seconds and whether the
two matrices agree.

    python benchmarks/interference_batch.py [--params params.yaml] [--root .] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack
from pathlib import Path

from trace_lib.engine.backends import open_policy
from trace_lib.config import load_params
from trace_lib.budget import find_adapters
from trace_lib.evaluation import inputs
from trace_lib.evaluation.runner import eval_rollout_config, interference_matrix
from trace_lib.evaluation.router_side import interference_envs, open_sandboxes
from trace_lib.sandbox import limits_from_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--root", default=".")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    root = Path(args.root)
    params = load_params(root / args.params)
    cfg = params.evaluate
    caps, baselines = find_adapters(root)
    names = sorted(caps)
    if not names:
        raise SystemExit(f"no capability adapters under {root / 'data/adapters'}: run the pipeline first")
    policy = open_policy(params.model, params.policy, root / params.model.out_dir, caps, threads=params.rollout.threads)
    rcfg = eval_rollout_config(params.rollout, cfg)
    envs_on_disk = inputs.synthetic_manifests(root)
    with ExitStack() as stack:
        boxes = open_sandboxes(stack, root, limits_from_config(params.synthesize.validation),
                               [n for n in names if n in envs_on_disk], envs_on_disk)
        envs = interference_envs(boxes, params.env, cfg.interference_seeds, params.synthesize.difficulty)
        print(f"adapters {names}; environments {list(envs)}; {cfg.interference_seeds} seeds each; "
              f"{(len(names) + 1) * len(envs) * cfg.interference_seeds} episodes per arm")
        results: dict[str, list] = {}
        for rep in range(args.repeats):
            arms = ("by-weight", "together") if rep % 2 == 0 else ("together", "by-weight")
            for arm in arms:
                t0 = time.perf_counter()
                rows = interference_matrix(policy, names, envs, rcfg, cfg.seed, together=arm == "together")
                seconds = time.perf_counter() - t0
                results.setdefault(arm, []).append(rows)
                print(f"repeat {rep + 1} {arm:9s} {seconds:7.1f} s  "
                      + " ".join(f"{r['adapter']}@{r['env']}={r['successes']}/{r['n']}" for r in rows))
        print("matrices agree:", all(r == results["by-weight"][0] for arm in results for r in results[arm]))


if __name__ == "__main__":
    main()
