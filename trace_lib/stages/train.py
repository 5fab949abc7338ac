"""Stage `train`: one LoRA adapter per validated synthetic environment, then the baselines (paper §3.3, §4).

Reads params.yaml (`model`, `env`, `rollout`, `synthesize`, `train`), the prepared model folder
(`model.out_dir`, from the working directory so sweeps share it), the validated synthetic environments
(`data/envs/manifests.jsonl` and each `env.py`, served by a sandbox process) and the synthesize stage's
band-check ledger (`data/envs/rollouts.jsonl`, part of TRACE's budget); writes

    data/adapters/<capability>/          one adapter per environment (`trace_lib.training.trainer`
                                         lists the folder: PEFT weights, train_log.jsonl,
                                         manifest.json, snapshots/)
    data/adapters/_baselines/<name>/     `train.baselines` at TRACE's total rollout budget: grpo_target
                                         (GRPO on the target's train tasks), merged_data (one adapter on
                                         the mixture of every synthetic environment)
    data/adapters/_baselines/distilled/  the student distilled from the capability adapters (`train.distill`,
                                         cross-skill distillation: TRACE's unified adapter, not a baseline)
    data/adapters/manifests.jsonl        every AdapterManifest of this run
    data/train/[_baselines/]<name>/rollouts.jsonl
                                         each adapter's rollout ledger
    reports/train/<name>/plots/metrics/  each adapter's curves under TRL's metric names, as DVCLive writes them,
                                         updated every iteration (dvc plots; `trace_lib.training.tracking`)
    reports/metrics/train/<name>.json    each adapter's last values (dvc metrics: a column of `dvc exp show`)
    reports/tables/train_episodes/<name>.tsv
                                         a few sampled episodes of every iteration per adapter
    reports/metrics/train.json           backend, rollouts / iterations / final reward per adapter,
                                         TRACE's budget, skipped baselines, wall times (`timing`: each
                                         adapter's seconds per iteration and per rollout)
    data/logs/train/[_baselines/]<name>.timing.json
                                         each adapter's seconds per iteration (no DVC output: timings
                                         stay out of cached artifacts)

A calibrated environment (`synthesize.calibration`) trains at the difficulty and start its calibration chose
(its manifest). The trainings are planned in `trace_lib.training.plan`; each one (GRPO through TRL, resume, budget)
is `trace_lib.training.trainer`. The baselines' budget is TRACE's as the capability adapters' configs plan it, checked against their ledgers once they are done, so
that with `train.lockstep` the capability adapters and the baselines train together, each round's episodes of
all of them decoded in one batch (`trace_lib.training.lockstep`); the distilled student joins the rounds once the
capability adapters, its teachers, are done.
Checkpoints go to `data/checkpoints/` (no DVC output: DVC deletes a stage's outputs before it reruns the stage)
and stay until the stage is done, so a rerun after a crash resumes each adapter from its last checkpoint,
finished ones included, with its ledger rows as they were then; in lockstep every adapter resumes from the
newest round all unfinished ones have a checkpoint of (`lockstep.resume_points`), so the rounds are the
uninterrupted run's.
"""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from trace_lib.engine.model import numerics
from trace_lib.config import Params
from trace_lib.io import dumps_json, write_json, write_jsonl
from trace_lib.paths import Paths
from trace_lib.sandbox import SandboxProcess
from trace_lib.synth.synthesize import valid_envs
from trace_lib.training import distributed
from trace_lib.training.sources import sandbox_limits
from trace_lib.training.plan import TrainingPlan
from trace_lib.training.tracking import keep_only, read_curves, sampled_success
from trace_lib.training.trainer import resolve_train_backend


def _resume_key(params: Params) -> str:
    """The params the stage reads (dvc.yaml's `params:` of `train`, and the model): a checkpoint saved
    under other values is not resumed (the trainer adds its own config and the environment's hash)."""
    return dumps_json({"profile": params.profile, "seed": params.seed, "model": params.model.model_dump(mode="json"),
                       "env": params.env.model_dump(mode="json"), "rollout.split": params.rollout.split,
                       "synthesize": params.synthesize.model_dump(mode="json")})


def run_train(params: Params, root: Path = Path("."), *, progress: bool = False) -> dict[str, Any]:
    """The whole stage (see the module docstring); returns the metrics written to train.json.

    With `train.processes` > 1 it runs under `accelerate launch` on that many processes (`launch_train`);
    process 0 writes every output."""
    rank, size = distributed.init()
    if params.train.processes > 1 and size == 1:
        return launch_train(params, root, progress)
    paths = Paths(root)
    cfg = params.train
    envs = valid_envs(root)
    # every training run: its checkpoints' key, and the prompts' tool list as the params say (a sweep may
    # share a model folder prepared with another format)
    common = {"resume_key": _resume_key(params), "keep_checkpoints": True, "tool_format": params.model.tool_format}
    with ExitStack() as stack:
        limits = sandbox_limits(params.synthesize.validation)
        boxes = {m.capability_id: stack.enter_context(SandboxProcess(root / m.path, limits)) for m in envs}
        # the model folder from the working directory, as the rollout stage: sweeps share it
        plan = TrainingPlan(Path(params.model.out_dir), cfg, envs, boxes, params.env, params.rollout.split,
                            params.synthesize.difficulty, root, params.seed, common, progress)
        manifests = plan.run(size, params.model.tool_format)
    if rank > 0:  # process 0 writes the stage's outputs
        return {}
    write_jsonl(paths.adapter_manifests, manifests)
    paths.train.mkdir(parents=True, exist_ok=True)  # a DVC output, empty where nothing trained
    names = [m.capability_id for m in manifests]
    for folder, suffix in ((paths.train_logs, ""), (paths.train_summaries, ".json"), (paths.train_episodes, ".tsv")):
        keep_only(folder, names, suffix)  # an earlier run's adapters that this one did not train
    curves = read_curves(paths.train_logs)
    metrics = {
        "backend": resolve_train_backend(cfg.backend),
        "adapters": {m.capability_id: {"rollouts": m.rollouts_used, "iterations": m.iterations,
                                       "final_reward": m.final_reward,
                                       "final_success": sampled_success((curves.get(m.capability_id) or [{}])[-1])}
                     for m in manifests},
        "trace_budget": plan.budget, "baselines_skipped": plan.skipped,
        "note": "no validated environments: no adapters trained" if not envs else "",
        "numerics": numerics(),
        "timing": plan.timings({m.capability_id: m.rollouts_used for m in manifests}),
    }
    write_json(paths.metrics("train"), metrics)
    shutil.rmtree(paths.checkpoints, ignore_errors=True)  # every adapter is written: nothing to resume
    return metrics


def launch_train(params: Params, root: Path, progress: bool = False) -> dict[str, Any]:
    """Run this stage on `train.processes` local processes (`python -m trace_lib.stages.train` under
    `accelerate launch`); their output is passed through as it comes. Returns the metrics process 0
    wrote; a failed launch raises with the command and the end of its output."""
    import subprocess
    import sys
    import tempfile
    from collections import deque

    from trace_lib.engine.serve import free_port
    from trace_lib.io import read_json

    with tempfile.TemporaryDirectory(prefix="trace-train-") as tmp:
        spec = Path(tmp) / "params.json"
        write_json(spec, params.model_dump(mode="json"))
        target = ["-m", "trace_lib.stages.train", "--params", str(spec), "--root", str(Path(root).resolve()),
                  *(["--progress"] if progress else [])]
        cmd = distributed.launch_command(params.train.processes, target, port=free_port())
        tail: deque[str] = deque(maxlen=60)
        with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as proc:
            for line in proc.stdout or []:
                sys.stderr.write(line)
                tail.append(line)
        code = proc.returncode
    if code != 0:
        raise RuntimeError(f"the train stage on {params.train.processes} processes failed (exit {code}): "
                           f"{' '.join(cmd)}\n{''.join(tail)}")
    return read_json(Paths(root).metrics("train"))


def _main(argv: list[str] | None = None) -> None:
    """Entry point of each process `launch_train` starts."""
    import argparse

    from trace_lib.io import read_json

    parser = argparse.ArgumentParser(description="trace's train stage, one process of a distributed launch")
    parser.add_argument("--params", required=True, help="the validated params, as JSON")
    parser.add_argument("--root", required=True)
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    run_train(Params.model_validate(read_json(Path(args.params))), Path(args.root), progress=args.progress)


if __name__ == "__main__":
    _main()
