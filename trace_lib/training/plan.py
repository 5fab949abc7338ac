"""The train stage's trainings: one adapter per synthesized environment, the baselines at TRACE's budget, the student.

Reads the synthesize stage's ledgers through `trace_lib.budget.trace_budget` and, when a training runs, what
`train_adapter_mixture` reads; writes what it writes (each adapter's folder, ledger, checkpoints, timing). The train
stage (`stages/train.py`) opens the sandboxes, builds a `TrainingPlan` from the sections it uses and runs its jobs
one after another or in lockstep (`run`).

The baselines' budget is TRACE's as the capability adapters' configs plan it (discovery and calibration count even
where no environment survived to be trained on), checked against their ledgers once they are done
(`check_budget`), so that the baselines can train beside them (`train.lockstep`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from trace_lib.budget import DISTILLED, RolloutLedger, trace_budget
from trace_lib.config import EnvConfig, TrainConfig
from trace_lib.engine.policy import load_policy
from trace_lib.paths import Paths
from trace_lib.records import AdapterManifest
from trace_lib.training.lockstep import LockstepJob, LockstepSampler, resume_points, run_lockstep
from trace_lib.training.sources import synthetic_source, target_source
from trace_lib.training.tracking import LiveCurves
from trace_lib.training.trainer import (
    checkpoint_iterations,
    planned_rollouts,
    read_timing,
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


def per_rollout(timing: dict[str, Any], rollouts: int | None) -> dict[str, Any]:
    """An adapter's timing (`read_timing`) with `seconds_per_rollout`: its training's wall seconds (`total_seconds`)
    over the rollouts it spent (None without rollouts)."""
    seconds = timing.get("total_seconds")
    return {**timing, "seconds_per_rollout": seconds / rollouts if rollouts and seconds is not None else None}


@dataclass
class TrainingPlan:
    """Every training of a run: `envs` (the validated environments' manifests, each served by `boxes[capability]`),
    `train` settings, the target (`env`, `rollout_split`) for GRPO on the target, and the run's `root`."""

    model_dir: Path
    cfg: TrainConfig
    envs: Sequence[Any]
    boxes: Mapping[str, Any]
    env: EnvConfig
    rollout_split: str
    difficulty: int
    """`synthesize.difficulty`: where an environment without a calibration trains."""
    root: Path
    seed: int
    common: dict[str, Any]
    """What every training gets: its checkpoints' resume key, whether to keep them, the tool format."""
    progress: bool = False
    timing: dict[str, Path] = field(default_factory=dict)
    resume: dict[str, int | None] = field(default_factory=dict)
    """In lockstep: the iteration each training resumes from (`resume_points`)."""
    skipped: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.paths = Paths(self.root)
        self.per_iter = self.cfg.groups * self.cfg.group_size
        self.budget = trace_budget(self.root, [], self.rollout_split)["total"] + len(self.envs) * planned_rollouts(
            self.cfg)
        """TRACE's total as the capability adapters will leave it: the baselines' budget."""
        for name in self.cfg.baselines:
            if name == "merged_data" and len(self.envs) < 2:
                self.skipped[name] = f"needs two or more synthetic environments, have {len(self.envs)}"
            elif self.budget < self.per_iter:
                self.skipped[name] = f"TRACE spent {self.budget} rollouts, less than one iteration ({self.per_iter})"
        self.bcfg = self.cfg.model_copy(update={"rollout_budget": self.budget,
                                                "iterations": self.budget // self.per_iter})

    def source(self, m: Any, weight: float = 1.0) -> Any:
        """A capability's environment at the difficulty it was calibrated to (else `synthesize.difficulty`)."""
        level = m.difficulty.get("value") if m.calibration else self.difficulty
        return synthetic_source(self.boxes[m.capability_id], m.capability_id, self.env, self.cfg.max_steps_per_episode,
                                level, weight)

    def baseline_sources(self, name: str) -> list[Any]:
        if name in ("grpo_target", "grpo_target_late"):
            return [target_source(self.env, self.rollout_split, self.root)]
        return [self.source(m, self.cfg.mixture.get(m.capability_id, 1.0)) for m in self.envs]  # merged_data

    def train_capability(self, m: Any, sampler: Any = None) -> AdapterManifest:
        late = {"start_late": m.calibration["start_late"]} if m.calibration.get("ok") else {}
        return train_adapter_mixture(
            self.model_dir, [self.source(m)], self.cfg.model_copy(update=late), self.paths.adapter(m.capability_id),
            seed=self.seed, ledger=RolloutLedger(self.paths.train_ledger(m.capability_id)), name=m.capability_id,
            progress=self.progress, env_sha256=m.sha256, ckpt_dir=self.paths.checkpoint(m.capability_id),
            timing_path=self.timing[m.capability_id], sampler=sampler, resume_at_most=self.resume.get(m.capability_id),
            curves=self.curves(m.capability_id), **self.common)

    def train_baseline(self, name: str, sampler: Any = None) -> AdapterManifest:
        late = {"start_late": 1.0} if name == "grpo_target_late" else {}
        return train_adapter_mixture(
            self.model_dir, self.baseline_sources(name), self.bcfg.model_copy(update=late),
            self.paths.adapter(name, baseline=True), seed=self.seed,
            ledger=RolloutLedger(self.paths.train_ledger(name, baseline=True)), name=name, progress=self.progress,
            ckpt_dir=self.paths.checkpoint(name, baseline=True), timing_path=self.timing[name], sampler=sampler,
            resume_at_most=self.resume.get(name), curves=self.curves(name), **self.common)

    def train_student(self, sampler: Any = None) -> AdapterManifest:
        return train_adapter_mixture(
            self.model_dir, self.baseline_sources("merged_data"), distill_config(self.cfg),
            self.paths.adapter(DISTILLED, True), seed=self.seed,
            ledger=RolloutLedger(self.paths.train_ledger(DISTILLED, baseline=True)), name=DISTILLED,
            progress=self.progress, ckpt_dir=self.paths.checkpoint(DISTILLED, baseline=True),
            timing_path=self.timing[DISTILLED],
            teachers={m.capability_id: self.paths.adapter(m.capability_id) for m in self.envs}, sampler=sampler,
            resume_at_most=self.resume.get(DISTILLED), curves=self.curves(DISTILLED), **self.common)

    def curves(self, name: str) -> LiveCurves:
        """Where training `name` writes its curves, summary and episode table (`training.tracking`)."""
        return LiveCurves(self.paths.train_logs / name, self.paths.train_summaries / f"{name}.json",
                          self.paths.train_episodes / f"{name}.tsv", live="dvclive" in self.cfg.report_to,
                          episodes=self.cfg.episodes_logged)

    def check_budget(self) -> None:
        spent = trace_budget(self.root, [m.capability_id for m in self.envs], self.rollout_split)["total"]
        if spent != self.budget:
            raise RuntimeError(f"TRACE's budget came to {spent} rollouts where {self.budget} were planned (the "
                               "baselines' budget): a capability adapter trained other iterations than its config's")

    def jobs(self) -> tuple[list[LockstepJob], list[LockstepJob], list[LockstepJob]]:
        """The capability adapters' jobs, the baselines' (those not skipped), the student's (it learns from the
        finished capability adapters); each training's timing file is set."""
        caps = [LockstepJob(m.capability_id, partial(self.train_capability, m)) for m in self.envs]
        rest = [LockstepJob(name, partial(self.train_baseline, name)) for name in self.cfg.baselines
                if name not in self.skipped]
        if self.cfg.distill.iterations and len(self.envs) < 2:
            self.skipped[DISTILLED] = f"needs two or more capability adapters to distil, have {len(self.envs)}"
        student = [LockstepJob(DISTILLED, self.train_student, tuple(j.name for j in caps))] if (
            self.cfg.distill.iterations and len(self.envs) >= 2) else []
        self.timing.update({m.capability_id: self.paths.train_timing(m.capability_id) for m in self.envs})
        self.timing.update({job.name: self.paths.train_timing(job.name, baseline=True) for job in rest + student})
        return caps, rest, student

    def run(self, processes: int, tool_format: str | None) -> list[AdapterManifest]:
        """Every job: in lockstep (`train.lockstep` with continuous batching, TRL, one process, several jobs),
        resumed from the newest round all unfinished ones have a checkpoint of; else one after another."""
        caps, rest, student = self.jobs()
        if (self.cfg.lockstep and self.cfg.continuous_batching and processes == 1 and len(caps + rest + student) > 1
                and resolve_train_backend(self.cfg.backend) == "trl"):
            self.resume.update(self._resume_points(rest, bool(student)))
            sampler = LockstepSampler(lambda: load_policy(self.model_dir, dtype=train_dtype(self.cfg),
                                                          tool_format=tool_format), self.seed)
            done = run_lockstep(caps + rest + student, sampler)
            self.check_budget()
            return done
        done = [job.run(None) for job in caps]  # `train.lockstep` off, or where it cannot run (TrainConfig.lockstep)
        self.check_budget()
        return done + [job.run(None) for job in rest + student]

    def _resume_points(self, rest: list[LockstepJob], student: bool) -> dict[str, int | None]:
        ckpt = {m.capability_id: self.paths.checkpoint(m.capability_id) for m in self.envs}
        ckpt.update({name: self.paths.checkpoint(name, baseline=True)
                     for name in [job.name for job in rest] + ([DISTILLED] if student else [])})
        cap_iterations = planned_rollouts(self.cfg) // self.per_iter
        last = dict.fromkeys((m.capability_id for m in self.envs), cap_iterations)
        last.update({job.name: planned_rollouts(self.bcfg) // self.per_iter for job in rest})
        last.update({DISTILLED: self.cfg.distill.iterations} if student else {})
        first = {DISTILLED: cap_iterations} if student else {}  # the round it starts in
        return resume_points({n: max(checkpoint_iterations(c), default=0) for n, c in ckpt.items()}, last, first)

    def timings(self, rollouts: Mapping[str, int]) -> dict[str, dict[str, Any]]:
        """Each training's timing with its seconds per rollout (`per_rollout`)."""
        return {name: per_rollout(read_timing(path), rollouts.get(name)) for name, path in self.timing.items()}

