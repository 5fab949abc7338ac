"""What shared stems (`engine/policy.py`) save in prefill, on the same prompts with and without them.

Records every `Policy.generate_ids` call (prompts and session keys) of two real workloads run once
without stems, then replays the calls prefill-only (one new token each, greedy) with stems and
without, rows alternating over `--repeats` rounds so that a machine whose speed drifts favours
neither. Both variants see the same prompts, so only the prefill work differs; decoding is the same
with and without stems and is left out.

    rollout  the rollout stage's episodes (`--tasks` tasks x `rollout.samples_per_task`, the base model)
    grpo     one GRPO iteration's sampling (`agent.episode.play`: `train.groups` x `train.group_size` episodes of
             the `--capability` template environment, the LoRA-wrapped policy)

Reports per workload and row: prefill seconds (each round), prompt tokens computed.

    python benchmarks/prefill_stems.py [--tasks 8] [--repeats 2] [--workloads rollout,grpo]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import trace_lib.engine.decoding as decoding
from trace_lib.engine.policy import Policy, load_policy
from trace_lib.config import load_params

NO_STEMS = 10**9


def record_calls(policy: Policy, run) -> list[tuple[list[list[int]], list | None]]:
    """Run `run()` without stems and return every generate_ids call's (prompts, sessions)."""
    calls = []
    original = policy.generate_ids

    def recording(prompts, **kwargs):
        calls.append(([list(p) for p in prompts], list(kwargs["sessions"]) if kwargs.get("sessions") else None))
        return original(prompts, **kwargs)

    saving, decoding.MIN_STEM_SAVING = decoding.MIN_STEM_SAVING, NO_STEMS
    policy.generate_ids = recording
    try:
        run()
    finally:
        policy.generate_ids = original
        decoding.MIN_STEM_SAVING = saving
    return calls


def replay_prefill(policy: Policy, calls, stems: bool) -> tuple[float, int]:
    """(prefill seconds, prompt tokens computed) of the calls, one new token each."""
    saving = decoding.MIN_STEM_SAVING
    decoding.MIN_STEM_SAVING = saving if stems else NO_STEMS
    try:
        policy.clear_prefix_cache()
        before = dict(vars(policy.stats))
        for prompts, sessions in calls:
            policy.generate_ids(prompts, temperature=0.0, top_p=1.0, max_new_tokens=1, seed=0, sessions=sessions)
        if sessions := [k for _, s in calls for k in (s or [])]:
            policy.end_sessions(sessions)
        after = vars(policy.stats)
    finally:
        decoding.MIN_STEM_SAVING = saving
    computed = ((after["prompt_tokens"] - after["cached_prompt_tokens"])
                - (before["prompt_tokens"] - before["cached_prompt_tokens"]))
    return after["prefill_seconds"] - before["prefill_seconds"], computed


def rollout_calls(params, policy: Policy, n_tasks: int):
    from trace_lib.agent.rollout import collect_rollouts
    from trace_lib.envs import make_env, make_tasks

    tasks = make_tasks(params.env, params.rollout.split)[:n_tasks]
    return record_calls(policy, lambda: collect_rollouts(policy, lambda: make_env(params.env), tasks,
                                                         params.rollout, params.seed, progress=False))


def grpo_calls(params, policy: Policy, capability: str):
    from peft import get_peft_model

    from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks
    from trace_lib.sandbox import SandboxLimits, SandboxProcess
    from trace_lib.synth.synthesize import target_spec
    from trace_lib.synth.templates import render_template_module
    from trace_lib.agent.episode import play, start_episode
    from trace_lib.training.trainer import lora_config

    cfg = params.train
    policy.model = get_peft_model(policy.model, lora_config(cfg, policy.model)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        module = Path(tmp) / "env.py"
        module.write_text(render_template_module(capability, target_spec(params.env), params.synthesize.difficulty))
        with SandboxProcess(module, SandboxLimits(timeout_s=30, cpu_s=3600, memory_mb=2048)) as box:
            tasks = synthetic_tasks(box, capability, list(range(cfg.groups)), params.synthesize.difficulty, "train")
            episodes = [start_episode(policy, capability, seed, task, k,
                                      SyntheticEnv(box, params.env, max_steps=cfg.max_steps_per_episode))
                        for seed, task in enumerate(tasks) for k in range(cfg.group_size)]
            return record_calls(policy, lambda: play(policy, episodes, cfg, params.seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--model-dir", default="data/model")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--capability", default="communicate_result")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", default="rollout,grpo")
    args = ap.parse_args()
    params = load_params(args.params)
    rows = []
    for workload in args.workloads.split(","):  # grpo wraps the model in LoRA: a fresh policy each
        policy = load_policy(args.model_dir, dtype=params.model.dtype, threads=params.rollout.threads)
        if workload == "rollout":
            calls = rollout_calls(params, policy, args.tasks)
        elif workload == "grpo":
            calls = grpo_calls(params, policy, args.capability)
        else:
            raise SystemExit(f"unknown workload {workload!r}; known: rollout, grpo")
        runs: dict[str, list[float]] = {"no stems": [], "shared stems": []}
        computed: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, stems in (("no stems", False), ("shared stems", True)):
                seconds, tokens = replay_prefill(policy, calls, stems)
                runs[name].append(seconds)
                computed[name] = tokens
                print(workload, name, f"{seconds:.2f} s", tokens, "tokens", flush=True)
        rows += [(workload, len(calls), name, runs[name], computed[name]) for name in runs]
    print("\n| workload | calls | row | prefill s (each round) | prompt tokens computed |")
    print("| --- | ---: | --- | --- | ---: |")
    for workload, n_calls, name, seconds, tokens in rows:
        print(f"| {workload} | {n_calls} | {name} | {', '.join(f'{s:.1f}' for s in seconds)} | {tokens:,} |")


if __name__ == "__main__":
    main()
