"""Each trained adapter's pass rate on its own synthetic environment, before (base model) and after.

Reads the outputs of `dvc repro` (data/model, data/envs, data/adapters) and params.yaml; prints one
JSON object (the interference matrix in long form, plus seconds) and writes nothing else. Tasks are
the environments' seeds from 1,000,000 up (`evaluation.runner.INTERFERENCE_SEED0`), never a validation or a
training seed. Greedy decoding, as the evaluate stage.

    .venv/bin/python benchmarks/adapter_before_after.py --seeds 8
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import ExitStack
from pathlib import Path

from trace_lib.engine.policy import load_policy
from trace_lib.config import load_params
from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks
from trace_lib.budget import find_adapters
from trace_lib.evaluation.runner import (
    INTERFERENCE_SEED0,
    eval_rollout_config,
    interference_matrix,
)
from trace_lib.sandbox import SandboxProcess, limits_from_config
from trace_lib.synth.synthesize import valid_envs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--root", default=".")
    args = ap.parse_args()
    root = Path(args.root)
    params = load_params(root / "params.yaml")
    caps, _ = find_adapters(root)
    policy = load_policy(root / params.model.out_dir, dtype=params.model.dtype,
                         adapters={name: str(path) for name, path in caps.items()})
    cfg = eval_rollout_config(params.rollout, params.evaluate)
    t0 = time.perf_counter()
    with ExitStack() as stack:
        envs = {}
        for m in valid_envs(root):
            box = stack.enter_context(SandboxProcess(root / m.path, limits_from_config(params.synthesize.validation)))
            seeds = list(range(INTERFERENCE_SEED0, INTERFERENCE_SEED0 + args.seeds))
            tasks = synthetic_tasks(box, m.capability_id, seeds, params.synthesize.difficulty, "test")
            envs[m.capability_id] = (lambda box=box: SyntheticEnv(box, params.env,
                                                                   max_steps=params.train.max_steps_per_episode),
                                     tasks)
        rows = interference_matrix(policy, sorted(caps), envs, cfg, params.seed)
    print(json.dumps({"rows": rows, "seconds": round(time.perf_counter() - t0, 1),
                      "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens}, indent=1))


if __name__ == "__main__":
    main()
