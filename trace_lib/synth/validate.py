"""Validation of a synthesized environment module: may it be used for training? (paper §3.2)

Reads the module's source (static check in this process) and runs everything else in a
`trace_lib.sandbox.SandboxProcess`; reads the target environment's tools; with the optional band
check, rolls out a policy (counted in the caller's rollout ledger). Writes nothing: the
`ValidationReport` goes into the synthesize stage's manifest.

The paper keeps a synthetic environment only when it is well-formed, solvable and not trivially
solvable; the checks, in order (a failed `static`, `loads`, `contract` or `task_schema`, or any
sandbox failure, stops the run since later checks would be meaningless; other failures are recorded
and the checks go on, so a synthesizer gets all of its problems at once):

    static            trace_lib.sandbox.check_source: allowed imports only, no forbidden builtins
    loads             the module imports in the sandbox
    contract          CAPABILITY, TARGET (the configured target), DIFFICULTY range holds `difficulty`
    interface         tool_schemas() equal to the target's (names, arguments, descriptions)
    deterministic     generate_task(seed, difficulty) twice gives equal dicts, on every seed
    diverse           distinct tasks over the seeds >= min_distinct_tasks x n_seeds
    task_schema       every generated dict makes a `Task` record
    reference_solves  replaying solve(task) against the scripted user scores 1 on every seed
    do_nothing_fails  "I cannot help with that." scores above 0 on at most max_do_nothing_pass of the seeds
    random_fails      random tools on random seen strings score 1 on at most max_random_pass
    band              (cfg.band and a policy) the policy's pass rate lies in [band_lo, band_hi] and
                      some seed's samples disagree, so GRPO gets a learning signal
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trace_lib.config import EnvConfig, RolloutConfig, ValidationConfig
from trace_lib.envs.synthetic import (
    SyntheticEnv,
    TaskFormatError,
    target_env,
    task_from_dict,
    task_payload,
)
from trace_lib.records import Check, Message, Task, ToolCall, ValidationReport
from trace_lib.sandbox import (
    SandboxError,
    SandboxProcess,
    check_source,
    limits_from_config,
)

VALIDATION_SPLIT = "validate"
DO_NOTHING_TEXT = "I cannot help with that."
RANDOM_STEPS = 3


class CheckFailed(Exception):
    """A check's verdict is 'no'; `stop` when later checks would be meaningless."""

    def __init__(self, detail: str, stop: bool = False) -> None:
        super().__init__(detail)
        self.stop = stop


@dataclass
class _Run:
    box: SandboxProcess
    target_cfg: EnvConfig
    cfg: ValidationConfig
    difficulty: int
    seeds: list[int]
    raw: dict[int, dict[str, Any]] = field(default_factory=dict)
    tasks: list[Task] = field(default_factory=list)

    @property
    def capability(self) -> str:
        return str(self.box.meta.get("CAPABILITY"))

    def env(self) -> SyntheticEnv:
        return SyntheticEnv(self.box, self.target_cfg)


# --- helpers -------------------------------------------------------------------------------------
def first_difference(expected: Any, got: Any, path: str = "") -> str | None:
    """Where `got` first differs from `expected` (dict keys, list items, values), or None."""
    here = path or "(top)"
    if isinstance(expected, dict) and isinstance(got, dict):
        missing = [k for k in expected if k not in got]
        extra = [k for k in got if k not in expected]
        if missing or extra:
            parts = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + (
                [f"unexpected {', '.join(map(repr, extra))}"] if extra else [])
            return f"{here}: {'; '.join(parts)}"
        for key in expected:
            diff = first_difference(expected[key], got[key], f"{path}.{key}" if path else str(key))
            if diff:
                return diff
        return None
    if isinstance(expected, list) and isinstance(got, list):
        if len(expected) != len(got):
            return f"{here}: {len(got)} items, expected {len(expected)}"
        for i, (a, b) in enumerate(zip(expected, got)):
            diff = first_difference(a, b, f"{path}[{i}]")
            if diff:
                return diff
        return None
    if expected != got or type(expected) is not type(got):
        return f"{here}: {_short(got)}, expected {_short(expected)}"
    return None


def _short(value: Any, n: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def action_message(action: Any, index: int) -> Message:
    """A reference action as the assistant turn that performs it."""
    if isinstance(action, dict) and "tool" in action:
        args = action.get("arguments", {})
        if not isinstance(args, dict):
            raise ValueError(f"action {index}: arguments must be a dict, got {type(args).__name__}")
        return Message(role="assistant", tool_calls=[ToolCall(name=str(action["tool"]), arguments=args,
                                                             id=f"call_{index}_0")])
    if isinstance(action, dict) and "say" in action:
        return Message(role="assistant", content=str(action["say"]))
    raise ValueError(f"action {index} is neither {{'tool': ..., 'arguments': ...}} nor {{'say': ...}}: {_short(action)}")


def _run_episode(env: SyntheticEnv, task: Task, next_message: Callable[[int], Message | None]) -> tuple[float, dict]:
    """Reset, step `next_message(i)` until the episode ends or it returns None, then score."""
    env.reset(task)
    try:
        i = 0
        while not env.done:
            msg = next_message(i)
            if msg is None:
                break
            env.step(msg)
            i += 1
        return env.reward()
    finally:
        env.close()


def _strings(value: Any, out: list[str]) -> None:
    """Every string leaf of a JSON value (observations are JSON where the tools return JSON)."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _strings(v, out)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out)


def _random_value(schema: dict[str, Any], pool: list[str], rng: random.Random) -> Any:
    kind = schema.get("type")
    if kind == "integer":
        return rng.randint(0, 10)
    if kind == "number":
        return round(rng.uniform(0, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_random_value(schema.get("items", {}), pool, rng)]
    if kind == "object":
        return {}
    return rng.choice(pool) if pool else "unknown"


# --- checks ------------------------------------------------------------------------------------
_CAPABILITY_ID = re.compile(r"[A-Za-z0-9_.-]+")


def _contract(run: _Run) -> str:
    meta = run.box.meta
    if meta.get("missing"):
        raise CheckFailed(f"missing or not callable: {', '.join(meta['missing'])}", stop=True)
    cap, target, diff = meta.get("CAPABILITY"), meta.get("TARGET"), meta.get("DIFFICULTY")
    problems = []
    if not isinstance(cap, str) or not _CAPABILITY_ID.fullmatch(cap):
        problems.append(f"CAPABILITY must be an id of letters, digits, '_', '-', '.', got {_short(cap)}")
    if not isinstance(target, dict) or target.get("name") != run.target_cfg.name:
        problems.append(f"TARGET must name the target {run.target_cfg.name!r}, got {_short(target)}")
    elif run.target_cfg.name == "retail" and target.get("tools", "core") != run.target_cfg.tools:
        problems.append(f"TARGET tools {target.get('tools', 'core')!r} differ from the target's {run.target_cfg.tools!r}")
    keys = ("default", "min", "max")
    if not isinstance(diff, dict) or not all(isinstance(diff.get(k), int) for k in keys):
        problems.append(f"DIFFICULTY must be {{'default': int, 'min': int, 'max': int}}, got {_short(diff)}")
    elif not diff["min"] <= diff["default"] <= diff["max"]:
        problems.append(f"DIFFICULTY needs min <= default <= max, got {_short(diff)}")
    elif not diff["min"] <= run.difficulty <= diff["max"]:
        problems.append(f"difficulty {run.difficulty} is outside DIFFICULTY [{diff['min']}, {diff['max']}]")
    if problems:
        raise CheckFailed("; ".join(problems), stop=True)
    return f"capability {cap!r}, target {target['name']!r}, difficulty {run.difficulty} in [{diff['min']}, {diff['max']}]"


def _interface(run: _Run) -> str:
    got = run.box.request("tool_schemas")
    expected = {t.name: t.to_schema() for t in target_env(run.target_cfg).tools}
    if not isinstance(got, list) or not all(isinstance(s, dict) for s in got):
        raise CheckFailed(f"tool_schemas() must return a list of dicts, got {_short(got)}")
    names = [s.get("function", {}).get("name") if isinstance(s.get("function"), dict) else None for s in got]
    missing = [n for n in expected if n not in names]
    extra = [str(n) for n in names if n not in expected]
    if missing or extra:
        raise CheckFailed(f"tool names differ from the target's: missing {missing}, unexpected {extra}")
    for name, schema in zip(names, got):
        diff = first_difference(expected[name], schema, name)
        if diff:
            raise CheckFailed(f"schema differs from the target's at {diff}")
    return f"{len(expected)} tools equal to the target's"


def _deterministic(run: _Run) -> str:
    diffs = []
    for seed in run.seeds:  # every seed is generated, so the checks after this one see them all
        run.raw[seed] = run.box.request("generate_task", seed=seed, difficulty=run.difficulty)
        again = run.box.request("generate_task", seed=seed, difficulty=run.difficulty)
        diff = first_difference(run.raw[seed], again)
        if diff:
            diffs.append(f"generate_task({seed}, {run.difficulty}) gave different tasks on two calls, at {diff}")
    if diffs:
        raise CheckFailed(f"{diffs[0]} ({len(diffs)}/{len(run.seeds)} seeds differ); "
                          "draw all randomness from random.Random(seed)")
    return f"{len(run.seeds)} seeds, each generated twice, equal"


def _diverse(run: _Run) -> str:
    distinct = len({json.dumps(t, sort_keys=True) for t in run.raw.values()})
    need = math.ceil(run.cfg.min_distinct_tasks * len(run.seeds))
    detail = f"{distinct} distinct tasks over {len(run.seeds)} seeds (need >= {need})"
    if distinct < need:
        raise CheckFailed(detail + "; make the seed choose the task")
    return detail


def _task_schema(run: _Run) -> str:
    try:
        run.tasks = [task_from_dict(run.raw[s], run.capability, s, run.difficulty, VALIDATION_SPLIT) for s in run.seeds]
    except TaskFormatError as err:
        raise CheckFailed(str(err), stop=True) from None
    return f"{len(run.tasks)} tasks convert to Task records"


def _reference_solves(run: _Run) -> str:
    failures, lengths = [], []
    env = run.env()
    for task in run.tasks:
        actions = run.box.request("solve", task=task_payload(task))
        if not isinstance(actions, list) or not actions:
            failures.append(f"seed {task.seed}: solve() must return a non-empty list, got {_short(actions)}")
            continue
        try:
            messages = [action_message(a, i) for i, a in enumerate(actions)]
        except ValueError as err:
            failures.append(f"seed {task.seed}: {err}")
            continue
        lengths.append(len(actions))
        reward, info = _run_episode(env, task, lambda i: messages[i] if i < len(messages) else None)
        if reward < 1:
            errors = [m.content for m in (env.state.messages if env.state else []) if m.role == "tool" and m.error]
            failures.append(f"seed {task.seed}: reward {reward:g} (termination {info.get('termination')}, "
                            f"evaluate {info.get('evaluate')})" + (f", tool errors: {errors[:2]}" if errors else ""))
    if failures:
        raise CheckFailed(f"the reference fails on {len(failures)}/{len(run.tasks)} seeds: " + "; ".join(failures[:3]))
    return f"reference scores 1 on all {len(run.tasks)} seeds ({sum(lengths) / len(lengths):.1f} actions on average)"


def _share_check(run: _Run, label: str, passes: int, limit: float) -> str:
    share = passes / len(run.tasks)
    detail = f"{label} passes {passes}/{len(run.tasks)} seeds ({share:.0%}, allowed <= {limit:.0%})"
    if share > limit:
        raise CheckFailed(detail + "; the evaluator rewards something other than the capability")
    return detail


def _do_nothing_fails(run: _Run) -> str:
    env = run.env()
    say = Message(role="assistant", content=DO_NOTHING_TEXT)
    # > 0, not >= 1: under a rubric, partial credit for doing nothing would be a reward GRPO can farm
    passes = sum(_run_episode(env, t, lambda i: say)[0] > 0 for t in run.tasks)
    return _share_check(run, "an agent that does nothing", passes, run.cfg.max_do_nothing_pass)


def _random_agent(env: SyntheticEnv, task: Task):
    """next_message for an agent that calls random tools on strings it has seen, then says one."""
    rng = random.Random(f"random-agent/{task.seed}")
    pool = [v for v in task.user.known_info.values() if v]
    steps = max(1, min(RANDOM_STEPS, env.max_steps - 1))

    def next_message(i: int) -> Message | None:
        if i > 0 and env.state is not None:  # harvest the last observations
            for m in env.state.messages[-2:]:
                if m.role == "tool":
                    try:
                        _strings(json.loads(m.content), pool)
                    except ValueError:
                        pool.append(m.content)
        if i < steps:
            spec = rng.choice(env.tools)
            props = spec.parameters.get("properties", {})
            args = {k: _random_value(props.get(k, {}), pool, rng) for k in spec.parameters.get("required", [])}
            return Message(role="assistant", tool_calls=[ToolCall(name=spec.name, arguments=args, id=f"call_{i}_0")])
        if i == steps:
            return Message(role="assistant", content=f"Here is what I found: {rng.choice(pool) if pool else 'nothing'}.")
        return None

    return next_message


def _random_fails(run: _Run) -> str:
    env = run.env()
    passes = sum(_run_episode(env, t, _random_agent(env, t))[0] >= 1 for t in run.tasks)
    return _share_check(run, "a random-tool agent", passes, run.cfg.max_random_pass)


def _band(run: _Run, policy: Any, ledger: Any, rollout_cfg: RolloutConfig | None) -> str:
    from trace_lib.agent.rollout import collect_rollouts
    from trace_lib.envs.synthetic import synthetic_tasks

    cfg = run.cfg
    have = {t.seed: t for t in run.tasks}
    missing = [s for s in range(cfg.band_seeds) if s not in have]
    tasks = [have[s] for s in range(cfg.band_seeds) if s in have] + synthetic_tasks(
        run.box, run.capability, missing, run.difficulty, VALIDATION_SPLIT)
    rcfg = (rollout_cfg or RolloutConfig()).model_copy(update={"samples_per_task": cfg.band_samples})
    trajectories, _ = collect_rollouts(policy, run.env, tasks, rcfg, seed=0, progress=False)
    if ledger is not None:
        ledger.add("synthesize", len(trajectories))  # the stage that spends them (trace_lib.budget)
    by_task: dict[str, list[float]] = {}
    for t in trajectories:
        by_task.setdefault(t.task_id, []).append(t.reward)
    rate = sum(t.success for t in trajectories) / max(1, len(trajectories))
    varied = sum(len(set(r)) > 1 for r in by_task.values())
    detail = (f"pass rate {rate:.2f} over {len(trajectories)} rollouts (band [{cfg.band_lo}, {cfg.band_hi}]), "
              f"{varied}/{len(by_task)} seeds with differing rewards")
    if not cfg.band_lo <= rate <= cfg.band_hi or varied == 0:
        raise CheckFailed(detail + "; adjust the difficulty so the policy sometimes, but not always, succeeds")
    return detail


# --- entry point -----------------------------------------------------------------------------------
def validate_env(module_path: str | Path, target_cfg: EnvConfig, cfg: ValidationConfig, difficulty: int,
                 policy: Any = None, ledger: Any = None, rollout_cfg: RolloutConfig | None = None) -> ValidationReport:
    """Run every check on the module at `module_path`; never raises for anything the module does.

    `policy` (trace_lib.agent.rollout's Generator protocol) and `ledger` (anything with `add(stage, rollouts)`;
    the band's episodes are added under stage 'synthesize') are used only by the band check
    (`cfg.band`); `rollout_cfg` sets its sampling (default RolloutConfig)."""
    checks: list[Check] = []

    def report(capability: str | None = None) -> ValidationReport:
        failed = next((c.name for c in checks if not c.ok), None)
        return ValidationReport(valid=failed is None, checks=checks, failed=failed, capability=capability)

    try:
        source = Path(module_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        checks.append(Check(name="static", ok=False, detail=f"cannot read the module: {err}"))
        return report()
    problems = check_source(source)
    checks.append(Check(name="static", ok=not problems,
                        detail="; ".join(problems) or "imports, builtins and attributes allowed; contract names defined"))
    if problems:
        return report()
    try:
        box = SandboxProcess(module_path, limits_from_config(cfg))
    except (SandboxError, OSError) as err:
        checks.append(Check(name="loads", ok=False, detail=str(err)))
        return report()
    with box:
        checks.append(Check(name="loads", ok=True, detail=f"imported in the sandbox (network isolation: {box.isolation})"))
        run = _Run(box, target_cfg, cfg, difficulty, list(range(cfg.n_seeds)))
        steps: list[tuple[str, Callable[[_Run], str]]] = [
            ("contract", _contract), ("interface", _interface), ("deterministic", _deterministic),
            ("diverse", _diverse), ("task_schema", _task_schema), ("reference_solves", _reference_solves),
            ("do_nothing_fails", _do_nothing_fails), ("random_fails", _random_fails)]
        if cfg.band and policy is not None:
            steps.append(("band", lambda r: _band(r, policy, ledger, rollout_cfg)))
        for name, check in steps:
            try:
                checks.append(Check(name=name, ok=True, detail=check(run)))
            except CheckFailed as err:
                checks.append(Check(name=name, ok=False, detail=str(err)))
                if err.stop:
                    break
            except SandboxError as err:  # the module raised, hung or died: later checks cannot run
                checks.append(Check(name=name, ok=False, detail=f"sandbox: {err}"))
                break
            except Exception as err:  # e.g. a reply of the wrong shape; the verdict is still 'invalid'
                checks.append(Check(name=name, ok=False, detail=f"{type(err).__name__}: {err}"))
                break
        capability = box.meta.get("CAPABILITY")
        return report(capability if isinstance(capability, str) else None)
