"""Training sources: the environments GRPO draws groups from, as the train and synthesize stages build them.

Reads nothing itself: a synthesized environment is served by its sandbox process (`sandbox`), the target's
tasks come from the rollout stage's task file (`envs.load_tasks`). `synthetic_source` is what a capability adapter
trains on and what calibration (`training.calibrate`) plays; `target_source` is GRPO on the target.
"""

from __future__ import annotations

from pathlib import Path

from trace_lib.config import EnvConfig, ValidationConfig
from trace_lib.envs import load_tasks, make_env
from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks, task_payload
from trace_lib.records import Task
from trace_lib.sandbox import SandboxError, SandboxLimits, SandboxProcess
from trace_lib.training.grpo import TrainSource
from trace_lib.training.hints import hint_from_steps, reference_steps


def sandbox_limits(v: ValidationConfig) -> SandboxLimits:
    """Limits of a sandbox serving a whole training run: validation's per-request time and memory, an hour of CPU
    (the validation CPU limit is a lifetime limit for a short check)."""
    return SandboxLimits(timeout_s=v.timeout_s, cpu_s=max(v.cpu_s, 3600), memory_mb=v.memory_mb)


def target_source(env: EnvConfig, split: str, root: Path) -> TrainSource:
    """The target environment's `split` tasks as a training source (the 'GRPO on target' baseline)."""
    tasks = load_tasks(env, split, root)
    if not tasks:
        raise ValueError(f"the target {env.name!r} has no {split!r} tasks to train on")
    return TrainSource("target", lambda: make_env(env),
                       lambda seeds: [tasks[s % len(tasks)] for s in seeds],
                       hint=lambda task: hint_from_steps(reference_steps(task)), reference=reference_steps)


def module_solution(box: SandboxProcess, task: Task) -> list:
    """The module's reference solution of `task`; empty when `solve` fails (the rollout then plays
    unguided and from the start)."""
    try:
        steps = box.request("solve", task=task_payload(task))
    except SandboxError:
        return []
    return steps if isinstance(steps, list) else []


def synthetic_source(box: SandboxProcess, capability: str, env: EnvConfig, max_steps: int, difficulty: int,
                     weight: float = 1.0) -> TrainSource:
    """A validated synthetic environment (served by the sandbox `box`, with the tools of the target `env`) as a
    training source, its tasks generated at `difficulty`, its episodes at most `max_steps` agent turns."""
    return TrainSource(capability,
                       lambda: SyntheticEnv(box, env, max_steps=max_steps),
                       lambda seeds: synthetic_tasks(box, capability, seeds, difficulty, "train"),
                       weight, hint=lambda task: hint_from_steps(module_solution(box, task)),
                       reference=lambda task: module_solution(box, task))
