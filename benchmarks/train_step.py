"""GRPO cost per trained rollout on a synthetic environment: trace's trainer vs TRL's own loss pass.

Both rows run the train stage's code (`train_adapter_mixture`: TRL's GRPOTrainer with trace's
multi-turn `rollout_func`, same model, LoRA config, environment, seeds, groups and group size, in
one process, one after the other). They differ only in how the loss pass is computed and in the
weights' dtype:

    trl        TRL's `_get_per_token_logps_and_entropies`: every row's prompt + completion through the
               forward and backward pass, activation checkpointing, fp32 base weights, one episode per
               micro-batch (the pipeline's setting before the shared-prompt pass)
    trl-bf16   the same with bf16 base weights (LoRA weights fp32)
    ours       training/shared_prompt.py: each group's prompt once, only the agent's tokens scored,
               bf16 base weights, the whole iteration in one pass

Reported per row: seconds per trained rollout (sampling + update), of which sampling, and the ratio
to the `trl` row. The environment is the template synthesizer's (`--capability`) for the retail
target, served by the sandbox as in the train stage.

    python benchmarks/train_step.py --model-dir data/model --iterations 2 [--rows trl,trl-bf16,ours]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from trace_lib.config import load_params
from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks
from trace_lib.synth.sandbox import SandboxLimits, SandboxProcess
from trace_lib.synth.synthesize import target_spec
from trace_lib.synth.templates import render_template_module
from trace_lib.training.budget import RolloutLedger
from trace_lib.training.grpo import TrainSource
from trace_lib.training.trainer import default_timing_path, read_timing, read_train_log, train_adapter_mixture

ROWS = {
    "trl": {"shared_prompt": False, "dtype": "float32"},
    "trl-bf16": {"shared_prompt": False, "dtype": "bfloat16"},
    "ours": {"shared_prompt": True, "dtype": "bfloat16"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="data/model")
    ap.add_argument("--capability", default="communicate_result")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--groups", type=int, default=0, help="0: the cpu profile's")
    ap.add_argument("--group-size", type=int, default=0, help="0: the cpu profile's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="trl,ours")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = load_params("params.yaml")
    base = params.train.model_copy(update={
        "iterations": args.iterations, "save_every": args.iterations, "snapshots": False,
        **({"groups": args.groups} if args.groups else {}), **({"group_size": args.group_size} if args.group_size else {})})
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        module = Path(tmp) / "env.py"
        module.write_text(render_template_module(args.capability, target_spec(params.env),
                                                 params.synthesize.difficulty))
        with SandboxProcess(module, SandboxLimits(timeout_s=30, cpu_s=3600, memory_mb=2048)) as box:
            source = TrainSource(args.capability, lambda: SyntheticEnv(box, params.env,
                                                                       max_steps=base.max_steps_per_episode),
                                 lambda seeds: synthetic_tasks(box, args.capability, seeds,
                                                               params.synthesize.difficulty, "train"))
            for row in args.rows.split(","):
                cfg = base.model_copy(update=ROWS[row])
                out = Path(tmp) / row
                t0 = time.perf_counter()
                manifest = train_adapter_mixture(Path(args.model_dir), [source], cfg, out, seed=params.seed,
                                                 ledger=RolloutLedger(Path(tmp) / f"{row}.ledger.jsonl"), name=row)
                wall = time.perf_counter() - t0
                timing = read_timing(default_timing_path(out))["iterations"]
                log = read_train_log(out)
                n = manifest.rollouts_used
                step = sum(t["seconds"] for t in timing)
                sampling = sum(t.get("rollout_seconds", 0.0) for t in timing)
                results[row] = {"rollouts": n, "iterations": len(log), "wall_seconds": round(wall, 1),
                                "step_seconds": round(step, 1), "seconds_per_rollout": round(step / n, 2),
                                "sampling_per_rollout": round(sampling / n, 2),
                                "update_per_rollout": round((step - sampling) / n, 2),
                                "trained_tokens": sum(r["trained_tokens"] for r in log),
                                "completion_tokens": sum(r["completion_tokens"] for r in log),
                                "rewards": [r["reward"] for r in log]}
                print(row, json.dumps(results[row]), flush=True)
    print(f"\ncapability={args.capability} iterations={args.iterations} groups={base.groups} "
          f"group_size={base.group_size} threads={args.threads} torch={torch.__version__}")
    print("| row | rollouts | s/rollout | sampling s/rollout | update s/rollout | vs trl |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    ref = results.get("trl", {}).get("seconds_per_rollout")
    for row, r in results.items():
        ratio = f"{r['seconds_per_rollout'] / ref:.2f}x" if ref else "-"
        print(f"| {row} | {r['rollouts']} | {r['seconds_per_rollout']} | {r['sampling_per_rollout']} | "
              f"{r['update_per_rollout']} | {ratio} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
