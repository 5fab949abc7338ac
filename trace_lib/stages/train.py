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
    reports/train/<name>.csv             each adapter's curves under TRL's metric names (dvc plots)
    reports/metrics/train.json           backend, rollouts / iterations / final reward per adapter,
                                         TRACE's budget, skipped baselines, wall times (`timing`: each
                                         adapter's seconds per iteration and per rollout)
    data/logs/train/[_baselines/]<name>.timing.json
                                         each adapter's seconds per iteration (no DVC output: timings
                                         stay out of cached artifacts)

A calibrated environment (`synthesize.calibration`) trains at the difficulty and start its calibration chose
(its manifest). The training itself (GRPO through TRL, resume, budget) is `trace_lib.training.trainer`. The baselines' budget
is TRACE's as the capability adapters' configs plan it, checked against their ledgers once they are done, so
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
from functools import partial
from pathlib import Path
from typing import Any

from trace_lib.engine.model import numerics
from trace_lib.engine.policy import load_policy
from trace_lib.config import Params, TrainConfig
from trace_lib.budget import DISTILLED, trace_budget
from trace_lib.io import dumps_json, write_json, write_jsonl
from trace_lib.paths import Paths
from trace_lib.plots.train import write_train_csvs
from trace_lib.records import AdapterManifest
from trace_lib.sandbox import SandboxProcess
from trace_lib.synth.synthesize import valid_envs
from trace_lib.training import distributed
from trace_lib.budget import RolloutLedger
from trace_lib.training.lockstep import LockstepJob, LockstepSampler, resume_points, run_lockstep
from trace_lib.training.sources import sandbox_limits, synthetic_source, target_source
from trace_lib.training.trainer import (
    checkpoint_iterations,
    planned_rollouts,
    read_timing,
    read_train_log,
    resolve_train_backend,
    train_adapter_mixture,
    train_dtype,
)


def distill_config(cfg: TrainConfig) -> TrainConfig:
    """The student's training settings (`train.distill`): on-policy at temperature 1 (the distributions both
    log-prob passes score), so no hint swap and no late start, and every agent turn is trained (a lookup
    the teacher makes is part of what it teaches)."""
    return cfg.model_copy(update={"iterations": cfg.distill.iterations, "rollout_budget": None, "hint_fraction": 0.0,
                                  "start_late": 0.0, "learning_rate": cfg.distill.learning_rate or cfg.learning_rate,
                                  "temperature": 1.0, "filter_lookup_only": False})


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
    model_dir = Path(params.model.out_dir)  # from the working directory, as the rollout stage: sweeps share it
    cfg = params.train
    envs = valid_envs(root)
    # every training run: its checkpoints' key, and the prompts' tool list as the params say (a sweep may
    # share a model folder prepared with another format)
    common = {"resume_key": _resume_key(params), "keep_checkpoints": True, "tool_format": params.model.tool_format}
    manifests: list[AdapterManifest] = []
    timing: dict[str, Path] = {}
    with ExitStack() as stack:
        limits = sandbox_limits(params.synthesize.validation)
        boxes = {m.capability_id: stack.enter_context(SandboxProcess(root / m.path, limits)) for m in envs}

        resume: dict[str, int | None] = {}  # in lockstep: the iteration each training resumes from (`resume_points`)

        def source(m: Any, weight: float = 1.0) -> Any:
            """A capability's environment at the difficulty it was calibrated to (else `synthesize.difficulty`)."""
            level = m.difficulty.get("value") if m.calibration else params.synthesize.difficulty
            return synthetic_source(boxes[m.capability_id], m.capability_id, params.env,
                                    params.train.max_steps_per_episode, level, weight)

        def train_capability(m: Any, sampler: Any = None) -> AdapterManifest:
            late = {"start_late": m.calibration["start_late"]} if m.calibration.get("ok") else {}
            return train_adapter_mixture(
                model_dir, [source(m)], cfg.model_copy(update=late),
                paths.adapter(m.capability_id), seed=params.seed,
                ledger=RolloutLedger(paths.train_ledger(m.capability_id)), name=m.capability_id, progress=progress,
                env_sha256=m.sha256, ckpt_dir=paths.checkpoint(m.capability_id), timing_path=timing[m.capability_id],
                sampler=sampler, resume_at_most=resume.get(m.capability_id), **common)

        # TRACE's budget as the capability adapters will leave it (checked once they are done), so that the
        # baselines can train beside them (`train.lockstep`): discovery and calibration count even where no
        # environment survived to be trained on
        per_iter = cfg.groups * cfg.group_size
        budget = trace_budget(root, [], params.rollout.split)["total"] + len(envs) * planned_rollouts(cfg)
        baselines = {"grpo_target": lambda: [target_source(params.env, params.rollout.split, root)],
                     "grpo_target_late": lambda: [target_source(params.env, params.rollout.split, root)],
                     "merged_data": lambda: [source(m, cfg.mixture.get(m.capability_id, 1.0)) for m in envs]}
        skipped: dict[str, str] = {}
        for name in cfg.baselines:
            if name == "merged_data" and len(envs) < 2:
                skipped[name] = f"needs two or more synthetic environments, have {len(envs)}"
            elif budget < per_iter:
                skipped[name] = f"TRACE spent {budget} rollouts, less than one iteration ({per_iter})"
        bcfg = cfg.model_copy(update={"rollout_budget": budget, "iterations": budget // per_iter})

        def train_baseline(name: str, sampler: Any = None) -> AdapterManifest:
            late = {"start_late": 1.0} if name == "grpo_target_late" else {}
            return train_adapter_mixture(
                model_dir, baselines[name](), bcfg.model_copy(update=late), paths.adapter(name, baseline=True),
                seed=params.seed,
                ledger=RolloutLedger(paths.train_ledger(name, baseline=True)), name=name, progress=progress,
                ckpt_dir=paths.checkpoint(name, baseline=True), timing_path=timing[name], sampler=sampler,
                resume_at_most=resume.get(name), **common)

        def train_student(sampler: Any = None) -> AdapterManifest:
            return train_adapter_mixture(
                model_dir, baselines["merged_data"](), distill_config(cfg), paths.adapter(DISTILLED, True),
                seed=params.seed, ledger=RolloutLedger(paths.train_ledger(DISTILLED, baseline=True)), name=DISTILLED,
                progress=progress, ckpt_dir=paths.checkpoint(DISTILLED, baseline=True), timing_path=timing[DISTILLED],
                teachers={m.capability_id: paths.adapter(m.capability_id) for m in envs}, sampler=sampler,
                resume_at_most=resume.get(DISTILLED), **common)

        def check_budget() -> None:
            spent = trace_budget(root, [m.capability_id for m in envs], params.rollout.split)["total"]
            if spent != budget:
                raise RuntimeError(f"TRACE's budget came to {spent} rollouts where {budget} were planned (the "
                                   "baselines' budget): a capability adapter trained other iterations than its config's")

        caps = [LockstepJob(m.capability_id, partial(train_capability, m)) for m in envs]
        rest = [LockstepJob(name, partial(train_baseline, name)) for name in cfg.baselines if name not in skipped]
        if cfg.distill.iterations and len(envs) < 2:
            skipped[DISTILLED] = f"needs two or more capability adapters to distil, have {len(envs)}"
        # the student learns from the finished capability adapters
        student = [LockstepJob(DISTILLED, train_student, tuple(j.name for j in caps))] if (
            cfg.distill.iterations and len(envs) >= 2) else []
        timing.update({m.capability_id: paths.train_timing(m.capability_id) for m in envs})
        timing.update({job.name: paths.train_timing(job.name, baseline=True) for job in rest + student})
        if (cfg.lockstep and cfg.continuous_batching and size == 1 and len(caps + rest + student) > 1
                and resolve_train_backend(cfg.backend) == "trl"):
            ckpt = {m.capability_id: paths.checkpoint(m.capability_id) for m in envs}
            ckpt.update({job.name: paths.checkpoint(job.name, baseline=True) for job in rest + student})
            cap_iterations = planned_rollouts(cfg) // per_iter
            last = dict.fromkeys((m.capability_id for m in envs), cap_iterations)
            last.update({job.name: planned_rollouts(bcfg) // per_iter for job in rest})
            last.update({DISTILLED: cfg.distill.iterations} if student else {})
            first = {DISTILLED: cap_iterations} if student else {}  # the round it starts in
            resume.update(resume_points({n: max(checkpoint_iterations(c), default=0) for n, c in ckpt.items()},
                                        last, first))
            sampler = LockstepSampler(lambda: load_policy(model_dir, dtype=train_dtype(cfg),
                                                          tool_format=params.model.tool_format), params.seed)
            done = run_lockstep(caps + rest + student, sampler)
            check_budget()
        else:  # one after another: `train.lockstep` off, or where it cannot run (TrainConfig.lockstep)
            done = [job.run(None) for job in caps]
            check_budget()
            done += [job.run(None) for job in rest + student]
        manifests.extend(done)
    if rank > 0:  # process 0 writes the stage's outputs
        return {}
    write_jsonl(paths.adapter_manifests, manifests)
    paths.train.mkdir(parents=True, exist_ok=True)  # a DVC output, empty where nothing trained
    rollouts = {m.capability_id: m.rollouts_used for m in manifests}
    write_train_csvs({m.capability_id: read_train_log(Path(m.path)) for m in manifests}, paths.train_logs)
    metrics = {
        "backend": resolve_train_backend(cfg.backend),
        "adapters": {m.capability_id: {"rollouts": m.rollouts_used, "iterations": m.iterations,
                                       "final_reward": m.final_reward} for m in manifests},
        "trace_budget": budget, "baselines_skipped": skipped,
        "note": "no validated environments: no adapters trained" if not envs else "",
        "numerics": numerics(),
        "timing": {name: per_rollout(read_timing(path), rollouts.get(name)) for name, path in timing.items()},
    }
    write_json(paths.metrics("train"), metrics)
    shutil.rmtree(paths.checkpoints, ignore_errors=True)  # every adapter is written: nothing to resume
    return metrics


def per_rollout(timing: dict[str, Any], rollouts: int | None) -> dict[str, Any]:
    """An adapter's timing (`read_timing`) with `seconds_per_rollout`: its training's wall seconds (`total_seconds`)
    over the rollouts it spent (None without rollouts)."""
    seconds = timing.get("total_seconds")
    return {**timing, "seconds_per_rollout": seconds / rollouts if rollouts and seconds is not None else None}


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
