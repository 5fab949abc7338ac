"""Does a capability adapter trained on its synthetic environment change what the agent solves on the target?

One run from nothing: the model prepared under --root (if missing), the capability's template environment
synthesized and validated there, one adapter trained on it with the given settings (GRPO through the train
stage's own path), then greedy episodes of the base model, the final adapter and (with --eval-every) its
snapshots on held-out synthetic tasks and on --target-n tasks per family of the target's --target-split
(default train: the split used for choosing settings; the test split is for the pipeline's one run). An adapter
already trained under --root (an earlier run's) is evaluated, not trained again: rerun with other --target-n or
--families and another --out.
Prints one JSON object (also written to --out/result.json): training curve, held-out and target successes per
family, and seconds; every evaluation episode goes to --out/episodes.jsonl (policy, set, trajectory). Runs on
whatever device `--profile` selects (cpu: the CPU default; gpu: CUDA).

    .venv/bin/python benchmarks/capability_transfer.py --root /tmp/ct --capability structured_data_reasoning \\
        --iterations 10 --hint-fraction 0.5 --start-late 0.5 --partial-credit 0.5 --eval-every 5 \\
        --families order_status,order_total --target-n 8
    (--kinds total=1,tracking=1 weights a template's task kinds; --set env.end_on_repeated_call=true sets any param)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from trace_lib.engine.model import resolve_model
from trace_lib.engine.policy import load_policy
from trace_lib.capabilities import CAPABILITIES
from trace_lib.config import apply_overrides, params_from_dict
from trace_lib.envs import make_env, make_tasks
from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks
from trace_lib.evaluation.runner import INTERFERENCE_SEED0, eval_rollout_config, evaluate_policy
from trace_lib.io import atomic_write_text
from trace_lib.records import AdapterManifest, Capability
from trace_lib.training.sources import sandbox_limits, synthetic_source
from trace_lib.sandbox import SandboxProcess
from trace_lib.synth.synthesize import synthesize_env
from trace_lib.budget import RolloutLedger
from trace_lib.training.trainer import SNAPSHOTS, read_timing, read_train_log, train_adapter_mixture


def _params(args: argparse.Namespace) -> dict:
    train = {"iterations": args.iterations, "hint_fraction": args.hint_fraction, "start_late": args.start_late,
             "reward": {"partial_credit": args.partial_credit}, "snapshots": args.eval_every > 0,
             "save_every": args.eval_every or args.iterations, "baselines": [], "distill": {"iterations": 0}}
    if args.no_prompt_grad:
        train["prompt_grad"] = False
    for key in ("groups", "group_size", "learning_rate", "temperature"):
        if getattr(args, key) is not None:
            train[key] = getattr(args, key)
    data = {"profile": args.profile, "seed": args.seed, "train": train,
            "model": {"out_dir": str(Path(args.root) / "data/model")}}
    if args.difficulty is not None:
        data["synthesize"] = {"difficulty": args.difficulty}
    return apply_overrides(data, dict(_pair(kv, yaml.safe_load) for kv in args.set))


def _pair(text: str, value) -> tuple[str, object]:
    key, _, raw = text.partition("=")
    return key.strip(), value(raw)


def _successes(trajs, tasks) -> dict:
    """Successes overall and per family; episodes are matched to tasks by id (evaluate_policy returns them in
    its own order)."""
    solved = {t.task_id: t.success for t in trajs}
    if sorted(solved) != sorted(t.id for t in tasks):
        raise RuntimeError("the episodes do not cover the tasks one each")
    fam: dict[str, list[int]] = {}
    for task in tasks:
        fam.setdefault(task.family or "synthetic", []).append(int(solved[task.id]))
    return {"successes": sum(solved.values()), "n": len(trajs),
            "families": {k: f"{sum(v)}/{len(v)}" for k, v in fam.items()},
            "solved": sorted(k for k, v in solved.items() if v)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="scratch folder (model, environment, adapters)")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--capability", required=True, choices=[c.id for c in CAPABILITIES])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--groups", type=int, default=None)
    ap.add_argument("--group-size", dest="group_size", type=int, default=None)
    ap.add_argument("--lr", dest="learning_rate", type=float, default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--hint-fraction", type=float, default=0.5)
    ap.add_argument("--start-late", type=float, default=0.0)
    ap.add_argument("--partial-credit", type=float, default=0.5)
    ap.add_argument("--no-prompt-grad", action="store_true",
                    help="train.prompt_grad false: the loss pass without the prompt's gradient")
    ap.add_argument("--difficulty", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--synthetic-n", type=int, default=16, help="held-out synthetic tasks")
    ap.add_argument("--target-n", type=int, default=8, help="target tasks per family")
    ap.add_argument("--target-split", default="train", help="target splits, comma-separated (never test for a gate)")
    ap.add_argument("--families", default="", help="target families (default: all)")
    ap.add_argument("--out", default=None, help="where result.json goes (default: --root)")
    ap.add_argument("--kinds", default="", help="task kinds and weights of a template that draws them, e.g. "
                                                "total=1,tracking=1,refusal=1 (default: the template's own mix)")
    ap.add_argument("--set", action="append", default=[], help="a params override, e.g. env.end_on_repeated_call=true")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    data = _params(args)
    params = params_from_dict(data)
    atomic_write_text(root / "params.yaml", yaml.safe_dump(data))
    t0 = time.perf_counter()
    model_dir = resolve_model(params.model.id, Path(params.model.out_dir), params.model.dtype,
                              tool_format=params.model.tool_format)
    spec = next(c for c in CAPABILITIES if c.id == args.capability)
    cap = Capability(id=spec.id, name=spec.name, description=spec.description, recognition=spec.recognition)
    kinds = dict(_pair(kv, int) for kv in args.kinds.split(",") if kv) or None
    manifest = synthesize_env(cap, "template", params.synthesize, params.env, params.rollout.split, root,
                              kinds=kinds)
    if not manifest.valid:
        raise SystemExit(f"{args.capability}: the template environment failed validation: {manifest.reason}")
    result: dict = {"capability": args.capability, "device_profile": args.profile,
                    "train": params.train.model_dump(mode="json", include={"iterations", "groups", "group_size",
                                                                           "learning_rate", "temperature",
                                                                           "hint_fraction", "start_late",
                                                                           "prompt_grad"}),
                    "difficulty": params.synthesize.difficulty, "kinds": kinds, "overrides": args.set,
                    "setup_seconds": round(time.perf_counter() - t0, 1)}
    out = root / "adapters"
    with SandboxProcess(root / manifest.path, sandbox_limits(params.synthesize.validation)) as box:
        t0 = time.perf_counter()
        done = out / args.capability / "manifest.json"
        if done.exists():  # an earlier run's adapter under --root: evaluate it (e.g. on more target tasks)
            m = AdapterManifest.model_validate_json(done.read_text())
            result["train_seconds"] = None
        else:
            source = synthetic_source(box, args.capability, params.env, params.train.max_steps_per_episode,
                                      params.synthesize.difficulty)
            m = train_adapter_mixture(model_dir, [source], params.train,
                                      out / args.capability, seed=args.seed,
                                      ledger=RolloutLedger(out / "ledger.jsonl"), name=args.capability,
                                      timing_path=out / "timing.json")
            result["train_seconds"] = round(time.perf_counter() - t0, 1)
        result["rollouts"] = m.rollouts_used
        if result["train_seconds"] and m.rollouts_used:
            result["seconds_per_rollout"] = round(result["train_seconds"] / m.rollouts_used, 2)
        timing = read_timing(out / "timing.json")
        result["seconds_per_iteration"] = timing.get("seconds_per_iteration")
        # per iteration: sampling (the rollout function) and the rest (the update)
        result["timing"] = [{"iteration": t["iteration"], "sampling_seconds": round(t.get("rollout_seconds", 0.0), 1),
                             "update_seconds": round(t["seconds"] - t.get("rollout_seconds", 0.0), 1)}
                            for t in timing.get("iterations", [])]
        result["curve"] = [{k: row.get(k) for k in ("iteration", "rollouts", "success_rate", "success_rate_unhinted",
                                                     "success_rate_on_policy", "references", "reference_skipped",
                                                     "frac_groups_mixed_by_reference", "env_score",
                                                     "frac_reward_zero_std", "preplayed_steps")}
                           for row in read_train_log(out / args.capability)]
        adapters = {"final": str(out / args.capability)}
        for snap in sorted((out / args.capability / SNAPSHOTS).glob("iter-*"), key=lambda p: int(p.name[5:])):
            adapters[snap.name] = str(snap)
        policy = load_policy(model_dir, dtype=params.model.dtype, device=params.model.device, adapters=adapters)
        cfg = eval_rollout_config(params.rollout, params.evaluate)
        seeds = list(range(INTERFERENCE_SEED0, INTERFERENCE_SEED0 + args.synthetic_n))
        synth_tasks = synthetic_tasks(box, args.capability, seeds, params.synthesize.difficulty, "test")
        env_cfg = params.env.model_copy(update={"tasks_per_family": args.target_n,
                                                "families": [f for f in args.families.split(",") if f]})
        target_tasks = [t for split in args.target_split.split(",") for t in make_tasks(env_cfg, split)]
        t0 = time.perf_counter()
        result["held_out"], result["target"] = {}, {}
        episodes: list[str] = []
        for name in [None, *adapters]:
            label = name or "base"
            # as the evaluate stage's interference table plays them
            trajs = evaluate_policy(policy, synth_tasks, lambda: SyntheticEnv(box, params.env), cfg, args.seed, name)
            result["held_out"][label] = f"{sum(t.success for t in trajs)}/{len(trajs)}"
            target_trajs = evaluate_policy(policy, target_tasks, lambda: make_env(env_cfg), cfg, args.seed, name)
            result["target"][label] = _successes(target_trajs, target_tasks)
            for split, ts in (("held_out", trajs), ("target", target_trajs)):
                episodes += [json.dumps({"policy": label, "set": split, "trajectory": t.model_dump(mode="json")},
                                        sort_keys=True) for t in sorted(ts, key=lambda t: t.task_id)]
            print(label, result["held_out"][label], result["target"][label]["families"], flush=True)
        result["eval_seconds"] = round(time.perf_counter() - t0, 1)
        atomic_write_text(Path(args.out or root) / "episodes.jsonl", "".join(e + "\n" for e in episodes))
    text = json.dumps(result, indent=1)
    atomic_write_text(Path(args.out or root) / "result.json", text + "\n")
    print(text)


if __name__ == "__main__":
    main()
