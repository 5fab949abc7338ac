"""Calibrating a synthesized environment before training: fit its difficulty and start to the base model.

Reads nothing from disk and writes nothing. The synthesize stage hands over the base policy and a factory of
training sources, one per difficulty (`training.grpo.TrainSource`: the environment served from its sandbox). It
gets back the setting to train at, or the reason none fits. This is the authors' generation loop (their plans
sample 16 rollouts x 100 seeds at T 0.7 and ask for 20–60% success with enough informative groups), sized for a
CPU. The base model plays `seeds` x `samples` episodes at the training temperature, each one as GRPO would
sample it. The environment is in band when the success rate lies in [success_lo, success_hi] and at least
`min_mixed` of the groups hold both a success and a failure (a group of equal rewards teaches nothing). The
settings lie on one scale of hardness (`ladder`): difficulty 0 with the reference's leading reads played (the
start `train.start_late` trains from), difficulty 0 from the opening, difficulty 1 with the reads played, and so
on up to the generator's highest difficulty. Calibration starts from the opening at the configured difficulty and
steps one rung toward the band after each setting it measures (`next_rung`): easier where the model succeeded
less than the band's middle, harder where more, never to a rung already measured. Then a transfer check plays
a few of the target's failed train tasks behind the capability from the start found (`transfer_check`). Every
episode played is a rollout TRACE spends.

With reference samples (`train.reference_samples` > 0) the references give every group its success, so the band
has no lower edge and no share of mixed groups: a setting fits when the base model does not already solve it
(success at most `success_hi`) and the reference solution earns full reward on every seed played
(`reference_rewards`; a reference needs no decoding and is not a rollout).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trace_lib.config import CalibrationConfig, TrainConfig
from trace_lib.records import Task, Trajectory
from trace_lib.agent.episode import Episode, leading_steps, play, play_reference, start_episode
from trace_lib.training.grpo import TrainSource

CALIBRATION_SEED0 = 900_000
"""First environment seed calibration plays: apart from validation (0..), training (`train.seed_offset` + group)
and the evaluation's held-out seeds (`evaluation.runner.INTERFERENCE_SEED0`)."""


def start_name(late: bool) -> str:
    """How a start is named in records: 'reads played' or 'opening'."""
    return "reads played" if late else "opening"


@dataclass(frozen=True)
class Setting:
    """Where the environment's episodes start: its generator's difficulty, and whether the reads are played."""

    difficulty: int
    late: bool

    @property
    def start(self) -> str:
        return start_name(self.late)


def ladder(lowest: int, highest: int) -> list[Setting]:
    """Every setting, easiest first: at each difficulty from `lowest` to `highest`, the reads played, then the
    opening."""
    return [Setting(d, late) for d in range(lowest, highest + 1) for late in (True, False)]


def next_rung(rungs: list[Setting], measured: dict[Setting, dict[str, Any]], at: Setting,
              cfg: CalibrationConfig) -> Setting | None:
    """The rung after `at`, one step toward the band: easier when `at`'s success rate is below the band's middle,
    harder otherwise; None at the end of the ladder or where that rung was measured already."""
    middle = (cfg.success_lo + cfg.success_hi) / 2
    i = rungs.index(at) + (-1 if measured[at]["success"] < middle else 1)
    return rungs[i] if 0 <= i < len(rungs) and rungs[i] not in measured else None


def judge(successes: list[list[bool]], cfg: CalibrationConfig, references: bool = False) -> dict[str, Any]:
    """Success rate, share of mixed groups and whether both are in band, for one group of outcomes per seed. With
    `references` (reference samples train it) only the band's upper edge applies."""
    n = sum(len(g) for g in successes)
    rate = sum(map(sum, successes)) / n if n else 0.0
    mixed = sum(0 < sum(g) < len(g) for g in successes) / len(successes) if successes else 0.0
    in_band = rate <= cfg.success_hi if references else (cfg.success_lo <= rate <= cfg.success_hi
                                                         and mixed >= cfg.min_mixed)
    return {"success": round(rate, 4), "mixed_groups": round(mixed, 4), "in_band": in_band}


def _start(policy: Any, source: TrainSource, env_seed: int, task: Task, sample: int, late: bool,
           train: TrainConfig) -> Episode:
    """A fresh episode of `task` in a new environment capped at the trainer's turns, from the opening or with the
    reference's leading reads played (`late`)."""
    env = source.make_env()
    env.max_steps = min(env.max_steps, train.max_steps_per_episode)
    steps = leading_steps(source.reference(task), env.tool_kinds()) if late and source.reference else []
    return start_episode(policy, source.name, env_seed, task, sample, env, preplay=steps)


def reference_rewards(policy: Any, source: TrainSource, tasks: list[tuple[int, Task]], late: bool,
                      train: TrainConfig) -> list[bool]:
    """Whether each task's reference solution, played through the environment as a reference sample is
    (`agent.episode.play_reference`, after the reads a late start plays), earns full reward; False where it has none."""
    out = []
    for env_seed, task in tasks:
        ep = _start(policy, source, env_seed, task, 0, late, train)
        solution = list(source.reference(task)) if source.reference else []
        out.append(play_reference(policy, ep, solution[ep.preplayed:], train) and ep.env.reward()[0] >= 1.0)
    return out


def play_groups(policy: Any, source: TrainSource, tasks: list[tuple[int, Task]], late: bool, samples: int,
                train: TrainConfig, seed: int) -> list[list[bool]]:
    """`samples` base-model episodes of each (env seed, task) at `train.temperature`, from the opening or with the
    reference's leading reads played (`late`); one list of successes per task, in order."""
    episodes = [_start(policy, source, env_seed, task, sample, late, train)
                for env_seed, task in tasks for sample in range(samples)]
    play(policy, episodes, train, seed=seed)
    return [[ep.env.reward()[0] >= 1 for ep in episodes[i:i + samples]] for i in range(0, len(episodes), samples)]


def measure(policy: Any, source: TrainSource, setting: Setting, cfg: CalibrationConfig, train: TrainConfig,
            seed: int) -> dict[str, Any]:
    """Play `cfg.seeds` x `cfg.samples` base-model episodes of `source` from `setting` at `train.temperature`; the
    outcome (`judge`) with the setting and the rollouts spent. With reference samples, also each seed's reference
    (`reference_rewards`): `references_full` of them earned full reward, and the setting is in band only when all
    did."""
    seeds = list(range(CALIBRATION_SEED0, CALIBRATION_SEED0 + cfg.seeds))
    tasks = list(zip(seeds, source.make_tasks(seeds), strict=True))
    outcomes = play_groups(policy, source, tasks, setting.late, cfg.samples, train, seed)
    out = {"difficulty": setting.difficulty, "start": setting.start,
           **judge(outcomes, cfg, references=train.reference_samples > 0), "rollouts": cfg.samples * len(tasks)}
    if train.reference_samples > 0:
        full = sum(reference_rewards(policy, source, tasks, setting.late, train))
        out = {**out, "references_full": full, "in_band": out["in_band"] and full == len(tasks)}
    return out


def tasks_behind(evidence: Sequence[Trajectory], cited: Sequence[str], tasks: Sequence[Task], n: int) -> list[Task]:
    """Up to `n` of the target tasks whose episodes failed among the trajectories `cited` (a capability's evidence),
    taken in turn from each family (families and tasks by id), so a few tasks cover the failures' families."""
    cited_ids = set(cited)
    failed = {e.task_id for e in evidence if e.id in cited_ids and not e.success}
    by_family: dict[str, list[Task]] = {}
    for task in sorted((t for t in tasks if t.id in failed), key=lambda t: t.id):
        by_family.setdefault(task.family, []).append(task)
    turns = [fam_tasks for _, fam_tasks in sorted(by_family.items())]
    out: list[Task] = []
    for i in range(max(map(len, turns), default=0)):
        out.extend(fam_tasks[i] for fam_tasks in turns if i < len(fam_tasks))
    return out[:n]


def transfer_check(policy: Any, source: TrainSource, tasks: Sequence[Task], late: bool, cfg: CalibrationConfig,
                   train: TrainConfig, seed: int) -> dict[str, Any]:
    """The base model on target tasks behind a capability (`tasks_behind`), `cfg.samples` episodes each at
    `train.temperature` from the start its environment trains at: whether the target's own failures give GRPO a
    signal there. Recorded beside the calibration, never a gate."""
    outcomes = play_groups(policy, source, list(enumerate(tasks)), late, cfg.samples, train, seed)
    by_family: dict[str, list[int]] = {}
    for task, group in zip(tasks, outcomes, strict=True):
        solved_played = by_family.setdefault(task.family, [0, 0])
        solved_played[0] += sum(group)
        solved_played[1] += len(group)
    judged = judge(outcomes, cfg)
    return {"start": start_name(late), "tasks": [t.id for t in tasks], "rollouts": sum(map(len, outcomes)),
            "successes": sum(map(sum, outcomes)), "success": judged["success"],
            "mixed_groups": judged["mixed_groups"],
            "by_family": {fam: f"{solved}/{played}" for fam, (solved, played) in sorted(by_family.items())}}


def calibrate(policy: Any, source_at: Callable[[int], TrainSource], cfg: CalibrationConfig, train: TrainConfig,
              difficulty: int, seed: int, difficulties: tuple[int, int] | None = None) -> dict[str, Any]:
    """Walk the ladder (`ladder`, `next_rung`) from the opening at `difficulty` until a setting is in band, at most
    `cfg.max_attempts` settings. Returns `ok`, the setting found (`difficulty`, `start_late`: 1.0 where the reads
    must be played, else `train.start_late`), every attempt, the rollouts spent, and the reason when none fits.
    `difficulties`: the generator's lowest and highest (its DIFFICULTY; None: 0 and `difficulty`, so the walk
    only eases)."""
    lowest, highest = difficulties if difficulties is not None else (0, difficulty)
    rungs = ladder(min(lowest, difficulty), max(highest, difficulty))
    measured: dict[Setting, dict[str, Any]] = {}
    attempts: list[dict[str, Any]] = []
    at: Setting | None = Setting(difficulty, False)
    while at is not None and len(attempts) < cfg.max_attempts:
        measured[at] = measure(policy, source_at(at.difficulty), at, cfg, train, seed)
        attempts.append(measured[at])
        if measured[at]["in_band"]:
            return {"ok": True, "difficulty": at.difficulty,
                    "start_late": 1.0 if at.late else train.start_late, "attempts": attempts,
                    "rollouts": sum(a["rollouts"] for a in attempts), "reason": ""}
        at = next_rung(rungs, measured, at, cfg)
    refs = train.reference_samples > 0

    def second(a: dict[str, Any]) -> str:
        return (f"references of full reward {a['references_full']}/{cfg.seeds}" if refs
                else f"mixed groups {a['mixed_groups']:.2f}")
    tried = "; ".join(f"difficulty {a['difficulty']} from the {a['start']}: success {a['success']:.2f}, {second(a)}"
                      for a in attempts)
    band = (f"success <= {cfg.success_hi} and every reference of full reward" if refs
            else f"success in [{cfg.success_lo}, {cfg.success_hi}], mixed groups >= {cfg.min_mixed}")
    return {"ok": False, "difficulty": None, "start_late": None, "attempts": attempts,
            "rollouts": sum(a["rollouts"] for a in attempts), "reason": f"no setting in band ({band}): {tried}"}
