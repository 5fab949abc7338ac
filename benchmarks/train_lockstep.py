"""The train stage's trainings one after another against in lockstep (`train.lockstep`), on the same work.

The trainings are the train stage's: one capability adapter per template environment (`--capabilities`,
rendered for the retail target as the template synthesizer writes them), GRPO on the target's train tasks
(`grpo_target`) and one adapter on the mixture of the capability environments (`merged_data`), each for
`--iterations` iterations of the cpu profile's G x K. Two arms in one process, in `--order`:

    sequential  each training alone (`train_adapter_mixture` without a sampler), one after another
    lockstep    all of them in `training.lockstep.run_lockstep`: each round decodes every training's episodes
                in one batch, each under its own adapter

Reported per arm: wall seconds, rollouts, seconds per rollout, the time spent decoding episodes (each
`play` call's generate seconds; in lockstep once per round), agent tokens decoded, trained tokens, each
training's mean reward, and the process's largest resident memory during the arm (sampled every 0.2 s).
`--no-memory-release` runs the lockstep arm without `lockstep.share_malloc_arenas` and `release_free_memory`
(both process-wide: run that arm in a process of its own, first). The arms play different episodes (other batches,
other generators), so rewards and token counts differ; the comparison is the time per rollout and per
decoded agent token.

    python benchmarks/train_lockstep.py --model-dir data/model --iterations 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from trace_lib.engine.policy import load_policy
from trace_lib.config import load_params
from trace_lib.envs import load_tasks, make_env
from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks
from trace_lib.sandbox import SandboxLimits, SandboxProcess
from trace_lib.synth.synthesize import target_spec
from trace_lib.synth.templates import render_template_module
from trace_lib.budget import RolloutLedger
from trace_lib.training.grpo import TrainSource
from trace_lib.training.lockstep import LockstepJob, LockstepSampler, run_lockstep
from trace_lib.training.trainer import read_timing, read_train_log, train_adapter_mixture, train_dtype


class RssPeak:
    """The largest resident set size of this process (MB) from construction to `stop()`."""

    def __init__(self, every: float = 0.2) -> None:
        self.peak, self._done = 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(every,), daemon=True)
        self._thread.start()

    def _watch(self, every: float) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while True:
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * page)
            if self._done.wait(every):
                return

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return round(self.peak / 2**20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="data/model")
    ap.add_argument("--capabilities", default="communicate_result,tool_call_precision")
    ap.add_argument("--baselines", default="grpo_target,merged_data")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--order", default="sequential,lockstep")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    ap.add_argument("--no-memory-release", action="store_true")
    args = ap.parse_args()
    if args.no_memory_release:
        import trace_lib.training.lockstep as lockstep_mod

        lockstep_mod.share_malloc_arenas = lockstep_mod.release_free_memory = lambda: None
    params = load_params("params.yaml")
    cfg = params.train.model_copy(update={"iterations": args.iterations, "save_every": args.iterations,
                                          "snapshots": False})
    caps = [c for c in args.capabilities.split(",") if c]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        boxes = {}
        for cap in caps:
            module = Path(tmp) / f"{cap}.py"
            module.write_text(render_template_module(cap, target_spec(params.env), params.synthesize.difficulty))
            boxes[cap] = stack.enter_context(SandboxProcess(module, SandboxLimits(timeout_s=30, cpu_s=3600,
                                                                                  memory_mb=2048)))

        def synthetic(cap: str) -> TrainSource:
            box = boxes[cap]
            return TrainSource(cap, lambda: SyntheticEnv(box, params.env, max_steps=cfg.max_steps_per_episode),
                               lambda seeds: synthetic_tasks(box, cap, seeds, params.synthesize.difficulty, "train"))

        tasks = load_tasks(params.env, params.rollout.split, Path("."))
        sources = {cap: [synthetic(cap)] for cap in caps}
        baselines = {"grpo_target": [TrainSource("target", lambda: make_env(params.env),
                                                 lambda seeds: [tasks[s % len(tasks)] for s in seeds])],
                     "merged_data": [synthetic(cap) for cap in caps]}
        sources.update({b: baselines[b] for b in args.baselines.split(",") if b})
        for arm in args.order.split(","):
            root = Path(tmp) / arm
            root.mkdir()

            def train(name: str, sampler=None, root=root):
                return train_adapter_mixture(Path(args.model_dir), sources[name], cfg, root / name, seed=params.seed,
                                             ledger=RolloutLedger(root / f"{name}.jsonl"), name=name, sampler=sampler,
                                             tool_format=params.model.tool_format)

            peak = RssPeak()
            t0 = time.perf_counter()
            if arm == "lockstep":
                sampler = LockstepSampler(lambda: load_policy(Path(args.model_dir), dtype=train_dtype(cfg),
                                                              tool_format=params.model.tool_format), params.seed)
                manifests = run_lockstep([LockstepJob(n, lambda s, n=n: train(n, s)) for n in sources], sampler)
            elif arm == "sequential":
                manifests = [train(n) for n in sources]
            else:
                raise SystemExit(f"unknown arm {arm!r}")
            wall = time.perf_counter() - t0
            peak_mb = peak.stop()
            rounds: dict[tuple, float] = {}
            for n in sources:
                for i, t in enumerate(read_timing(root / f"{n}.timing.json")["iterations"]):
                    rounds[(t["lockstep_round"],) if "lockstep_round" in t else (n, i)] = t["generate_seconds"]
            logs = {n: read_train_log(root / n) for n in sources}
            rollouts = sum(m.rollouts_used for m in manifests)
            tokens = sum(r["completion_tokens"] for log in logs.values() for r in log)
            decode = sum(rounds.values())
            results[arm] = {
                "wall_seconds": round(wall, 1), "rollouts": rollouts, "seconds_per_rollout": round(wall / rollouts, 2),
                "decoding_seconds": round(decode, 1), "decoding_calls": len(rounds), "agent_tokens": tokens,
                "decoding_ms_per_agent_token": round(1000 * decode / tokens, 1),
                "trained_tokens": sum(r["trained_tokens"] for log in logs.values() for r in log),
                "mean_reward": {n: round(sum(r["reward"] for r in log) / len(log), 3) for n, log in logs.items()},
                "peak_rss_mb": peak_mb}
            print(arm, json.dumps(results[arm]), flush=True)
    print(f"\ntrainings={list(sources)} iterations={args.iterations} groups={cfg.groups} group_size={cfg.group_size} "
          f"threads={torch.get_num_threads()} torch={torch.__version__}")
    first = next(iter(results.values()))
    print("| arm | rollouts | wall s | s/rollout | decoding s | ms per agent token | agent tokens | trained tokens | "
          "peak RSS MB | vs first |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for arm, r in results.items():
        print(f"| {arm} | {r['rollouts']} | {r['wall_seconds']} | {r['seconds_per_rollout']} | {r['decoding_seconds']} | "
              f"{r['decoding_ms_per_agent_token']} | {r['agent_tokens']} | {r['trained_tokens']} | {r['peak_rss_mb']} | "
              f"{r['seconds_per_rollout'] / first['seconds_per_rollout']:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
