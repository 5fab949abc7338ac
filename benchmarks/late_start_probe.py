"""What does the base model do from the latest start of the reverse curriculum? Every leading step of
each task's reference solution played for it (`train.start_late` at its first iteration: the reference's
read calls and messages up to its first write, the user's replies included), then the agent's own turns,
sampled as in training. Prints each episode's turns after the played ones and a JSON summary: how the
episodes ended, how many made a call identical to an earlier one of the episode (played or their own), how
many said anything to the user (a valid message, not a malformed turn), the rubric.

Reads the outputs of `dvc repro` under --root (data/model, data/envs) and its params.yaml.

    .venv/bin/python benchmarks/late_start_probe.py --root <a finished repro> \
        --capability identity_verification --tasks 8 --temperature 0.8
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from trace_lib.engine.policy import load_policy
from trace_lib.envs.said import is_said_to_user
from trace_lib.training.sources import sandbox_limits, synthetic_source
from trace_lib.sandbox import SandboxProcess
from trace_lib.agent.episode import leading_steps, play, start_episode

from hint_swap import run_env  # this folder: the script's own path entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".")
    ap.add_argument("--capability", required=True)
    ap.add_argument("--tasks", type=int, default=8, help="training seeds from train.seed_offset up")
    ap.add_argument("--temperature", type=float, default=None, help="default: train.temperature; 0: greedy")
    ap.add_argument("--adapter", default=None, help="an adapter folder to sample with (default: the base model)")
    args = ap.parse_args()
    root = Path(args.root)
    params, manifest = run_env(root, args.capability)
    adapters = {"probe": args.adapter} if args.adapter else None
    policy = load_policy(root / params.model.out_dir, dtype=params.model.dtype, adapters=adapters)
    if args.adapter:
        policy.set_adapter("probe")
    temperature = params.train.temperature if args.temperature is None else args.temperature
    # model_copy does not validate, so 0 passes TrainConfig's temperature > 0; the sampler is greedy at 0
    cfg = params.train.model_copy(update={"temperature": temperature})
    seeds = list(range(params.train.seed_offset, params.train.seed_offset + args.tasks))
    with SandboxProcess(root / manifest.path, sandbox_limits(params.synthesize.validation)) as box:
        source = synthetic_source(box, args.capability, params.env, params.train.max_steps_per_episode,
                                  params.synthesize.difficulty)  # the train stage's: its env, tasks, reference
        episodes = []
        for task in source.make_tasks(seeds):
            env = source.make_env()
            steps = leading_steps(source.reference(task), env.tool_kinds())
            episodes.append(start_episode(policy, args.capability, task.seed, task, 0, env, preplay=steps))
        play(policy, episodes, cfg, seed=params.seed)
        summary: Counter[str] = Counter()
        rubric: dict[str, list[float]] = {}
        for ep in episodes:
            value, info = ep.env.reward()
            turns = [m for m in ep.context if m.role == "assistant"]
            own = turns[ep.preplayed:]
            calls = [json.dumps([c.name, c.arguments], sort_keys=True) for m in turns for c in m.tool_calls]
            first_own = sum(len(m.tool_calls) for m in turns[:ep.preplayed])
            summary["episodes"] += 1
            summary[f"ended_{info.get('termination')}"] += 1
            summary["succeeded"] += int(value >= 1.0)
            summary["said_something"] += int(any(is_said_to_user(m) for m in own))  # not an invalid turn's text
            summary["repeated_a_call"] += int(any(c in calls[:i] for i, c in enumerate(calls) if i >= first_own))
            for name, score in (info.get("rubric") or {}).get("steps", {}).items():
                rubric.setdefault(name, []).append(float(score))
            print(f"--- seed {ep.seed}: {ep.preplayed} steps played, reward {value:.2f} ({info.get('termination')})")
            for m in own:
                print("   ", (m.content or "").strip()[:160] or "", *[f"{c.name}({json.dumps(c.arguments)})"
                                                                     for c in m.tool_calls])
    print(json.dumps({"capability": args.capability, "temperature": cfg.temperature, **dict(sorted(summary.items())),
                      "rubric_steps": {k: round(sum(v) / len(v), 3) for k, v in sorted(rubric.items())}}, indent=1))


if __name__ == "__main__":
    main()
