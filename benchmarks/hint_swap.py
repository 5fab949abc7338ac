"""Does an adapter learn its capability, and with which settings? One synthetic environment, the same
seed and budget, one arm per combination of `train.learning_rate`, `train.hint_fraction`,
`train.reward.partial_credit`, `train.start_late` and `train.prompt_grad` given; each adapter's training curve
and its held-out success (greedy, whole episodes, seeds from `INTERFERENCE_SEED0` up: never a training or
validation seed), with `--eval-every k` also that of the snapshot after every k-th iteration (the held-out curve).

Reads the outputs of `dvc repro` under --root (data/model, data/envs) and its params.yaml; writes the
adapters under --out (default a temporary folder) and prints one JSON object.

    .venv/bin/python benchmarks/hint_swap.py --capability communicate_result --iterations 4 \
        --fractions 0,0.5 --partial-credits 0 --seeds 16
    .venv/bin/python benchmarks/hint_swap.py --capability communicate_result --iterations 6 \
        --lrs 1e-4,2e-4,5e-4 --fractions 0 --partial-credits 0.5 --eval-every 2 --seeds 16
    .venv/bin/python benchmarks/hint_swap.py --capability communicate_result --iterations 10 \
        --fractions 0 --partial-credits 0.5 --start-lates 1 --prompt-grads 1,0 --eval-every 5 --seeds 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from trace_lib.engine.policy import load_policy
from trace_lib.config import Params, load_params
from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks
from trace_lib.evaluation.runner import INTERFERENCE_SEED0, eval_rollout_config, interference_matrix
from trace_lib.records import AdapterManifest, SyntheticEnvManifest
from trace_lib.training.sources import sandbox_limits, synthetic_source
from trace_lib.sandbox import SandboxProcess
from trace_lib.synth.synthesize import valid_envs
from trace_lib.budget import RolloutLedger
from trace_lib.training.trainer import SNAPSHOTS, read_timing, read_train_log, train_adapter_mixture


def run_env(root: Path, capability: str) -> tuple[Params, SyntheticEnvManifest]:
    """A finished run's params and the manifest of its validated environment for `capability`."""
    manifest = next((m for m in valid_envs(root) if m.capability_id == capability), None)
    if manifest is None:
        raise SystemExit(f"no validated environment {capability!r} under {root / 'data/envs'}")
    return load_params(root / "params.yaml"), manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".")
    ap.add_argument("--capability", required=True)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--fractions", default="0,0.5", help="train.hint_fraction values")
    ap.add_argument("--partial-credits", default="0", help="train.reward.partial_credit values (multi-level rewards)")
    ap.add_argument("--lrs", default="", help="train.learning_rate values (default: the params')")
    ap.add_argument("--start-lates", default="",
                    help="train.start_late values (reverse curriculum; default: the params')")
    ap.add_argument("--prompt-grads", default="",
                    help="train.prompt_grad values, 1 or 0 (the loss pass's gradient through the prompt; "
                         "default: the params')")
    ap.add_argument("--groups", type=int, default=0, help="train.groups (0: the params')")
    ap.add_argument("--seed", type=int, default=None, help="training seed (default: the params' seed)")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also evaluate the snapshot after every k-th iteration (0: the final adapters only)")
    ap.add_argument("--seeds", type=int, default=16, help="held-out tasks")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.root)
    params, manifest = run_env(root, args.capability)
    out = Path(args.out or tempfile.mkdtemp(prefix="hint_swap-"))
    seed = params.seed if args.seed is None else args.seed
    result: dict = {"capability": args.capability, "iterations": args.iterations, "seed": seed, "arms": {}}
    with SandboxProcess(root / manifest.path, sandbox_limits(params.synthesize.validation)) as box:
        adapters = {}
        lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else [params.train.learning_rate]
        lates = [float(x) for x in args.start_lates.split(",")] if args.start_lates else [params.train.start_late]
        values = [x.strip() for x in args.prompt_grads.split(",")] if args.prompt_grads else []
        if any(v not in ("0", "1") for v in values):
            raise SystemExit(f"--prompt-grads: 1 or 0 each, got {args.prompt_grads!r}")
        pgs = [v == "1" for v in values] or [params.train.prompt_grad]
        arms = [(lr, float(f), float(c), late, pg) for lr in lrs for f in args.fractions.split(",")
                for c in args.partial_credits.split(",") for late in lates for pg in pgs]
        for lr, fraction, credit, late, prompt_grad in arms:
            # adapter names may not contain "."
            name = (f"hint{round(100 * fraction)}-pc{round(100 * credit)}"
                    + (f"-lr{lr:.2e}".replace(".", "p") if args.lrs else "")
                    + (f"-late{round(100 * late)}" if args.start_lates else "")
                    + (f"-pg{int(prompt_grad)}" if args.prompt_grads else "")
                    + (f"-s{seed}" if args.seed is not None else ""))
            cfg = params.train.model_copy(update={"hint_fraction": fraction, "iterations": args.iterations,
                                                  "start_late": late, "groups": args.groups or params.train.groups,
                                                  "learning_rate": lr, "snapshots": args.eval_every > 0,
                                                  "prompt_grad": prompt_grad,
                                                  "save_every": args.eval_every or params.train.save_every,
                                                  "reward": params.train.reward.model_copy(
                                                      update={"partial_credit": credit})})
            t0 = time.perf_counter()
            if (out / name / "manifest.json").exists():  # --out of an earlier run: evaluate what it trained
                m = AdapterManifest.model_validate_json((out / name / "manifest.json").read_text())
            else:
                source = synthetic_source(box, args.capability, params.env, params.train.max_steps_per_episode,
                                          params.synthesize.difficulty)
                m = train_adapter_mixture(root / params.model.out_dir, [source], cfg, out / name,
                                          seed=seed, ledger=RolloutLedger(out / f"{name}.ledger.jsonl"),
                                          name=name, timing_path=out / f"{name}.timing.json")
            adapters[name] = str(out / name)
            for snap in sorted((out / name / SNAPSHOTS).glob("iter-*")) if args.eval_every else []:
                adapters[f"{name}-{snap.name}"] = str(snap)
            result["arms"][name] = {
                "learning_rate": lr, "hint_fraction": fraction, "partial_credit": credit, "start_late": late,
                "prompt_grad": prompt_grad,
                "rollouts": m.rollouts_used,
                "train_seconds": round(time.perf_counter() - t0, 1),
                "curve": [{k: row.get(k) for k in ("iteration", "success_rate", "hinted", "success_rate_unhinted",
                                                    "success_rate_hinted", "env_score", "rubric",
                                                    "frac_reward_zero_std", "trained_tokens", "preplayed_steps")}
                          for row in read_train_log(out / name)],
                "seconds_per_iteration": read_timing(out / f"{name}.timing.json").get("seconds_per_iteration"),
            }
        policy = load_policy(root / params.model.out_dir, dtype=params.model.dtype, adapters=adapters)
        seeds = list(range(INTERFERENCE_SEED0, INTERFERENCE_SEED0 + args.seeds))
        tasks = synthetic_tasks(box, args.capability, seeds, params.synthesize.difficulty, "test")
        env = (lambda: SyntheticEnv(box, params.env, max_steps=params.train.max_steps_per_episode), tasks)
        t0 = time.perf_counter()
        rows = interference_matrix(policy, sorted(adapters), {args.capability: env},
                                   eval_rollout_config(params.rollout, params.evaluate), seed)
        result["held_out"] = {r["adapter"]: f"{r['successes']}/{r['n']}" for r in rows}
        result["eval_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
