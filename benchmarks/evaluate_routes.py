"""The evaluate stage's decoding, timed: every method's episodes in one batch, against method by method.

The evaluate stage plays Table 1's methods on the test split greedily: the base model, the two baselines'
adapters, the linear merge of the capability adapters, each capability adapter alone, the oracle's and the
router's per-task routes, the distilled student. Episodes a method shares with another (the same task under
the same weights) are decoded once (`runner.evaluate_policy`'s memo). Two arms, in one process, alternating
over repeats:

    per-method  as before: each method's missing episodes decoded as a batch of their own, under its weights
             (`compose.apply_route`), the engine the params choose (`rollout.continuous_batching`)
    together    `runner.decode_into_memo`: every missing (weights, task) pair in one `Policy.play_turns`
             batch whose rows run under different weights (`engine.row_lora`, one shared prefix per route)

The adapters are the CPU default's shapes (LoRA r8, alpha 16, the 7 projections) with random weights
(`--scale`: the standard deviation of B, so that they move the model about as much as trained ones do), saved
to a temporary folder: no trained adapters are needed. The routes are fixed from the tasks' capability tags
(oracle: a tagged task to an adapter chosen by its first tag; router: the same, every third task sent to
"none"), so both arms decode exactly the same (weights, task) pairs.

    python benchmarks/evaluate_routes.py [--params params.yaml] [--tasks-per-family 2] [--batch-sizes 16,32] \
        [--repeats 1] [--scale 0.002] [--model-dir DIR [--random-init]]

`--model-dir` replaces the params' model folder; `--random-init` gives the model in it random weights of its
config's shape (seeded; where only its config and tokenizer can travel, e.g. to a GPU machine: the timing
of the two arms, not what the episodes say).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from trace_lib.engine.policy import load_policy
from trace_lib.config import load_params
from trace_lib.envs import make_env, make_tasks
from trace_lib.evaluation.runner import decode_into_memo, eval_rollout_config, evaluate_policy

CAPS = ("cap_a", "cap_b")
BASELINES = ("grpo_target", "merged_data", "distilled")


def save_adapters(model_dir: Path, out: Path, scale: float) -> dict[str, str]:
    """Random LoRA adapters in the train stage's shapes, one per capability and baseline."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = {}
    for i, name in enumerate(CAPS + BASELINES):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                               LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                              "gate_proj", "up_proj", "down_proj"]))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0, scale)
        model.save_pretrained(out / name)
        folders[name] = str(out / name)
    return folders


def random_model(model_dir: Path, out: Path) -> Path:
    """A copy of `model_dir`'s config and tokenizer with seeded random weights of that shape, saved in `out`."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(out)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


def method_routings(tasks) -> dict[str, object]:
    """Table 1's methods as routings over `tasks` (see the module docstring)."""
    tags = sorted({c for t in tasks for c in t.capability_tags})
    oracle = {t.id: {CAPS[tags.index(t.capability_tags[0]) % len(CAPS)]: 1.0} if t.capability_tags else {}
              for t in tasks}
    router = {t.id: {} if i % 3 == 2 else (oracle[t.id] or {CAPS[0]: 1.0}) for i, t in enumerate(tasks)}
    return {"base": None, "grpo_target": "grpo_target", "merged_data": "merged_data",
            "linear_merge": {c: 1 / len(CAPS) for c in CAPS}, **{f"single_{c}": c for c in CAPS},
            "oracle_route": oracle, "trace": router, "distilled": "distilled"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--tasks-per-family", type=int, default=0, help="the env's tasks per family (0: the params')")
    ap.add_argument("--batch-sizes", default="16", help="the together arm's batch sizes (per-method: the params')")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--scale", type=float, default=0.002, help="standard deviation of the adapters' B matrices")
    ap.add_argument("--arms", default="per-method,together", help="which arms run (e.g. together, under a profiler)")
    ap.add_argument("--model-dir", default=None, help="the model folder (default: the params' model.out_dir)")
    ap.add_argument("--random-init", action="store_true", help="random weights of the folder's config's shape")
    args = ap.parse_args()
    params = load_params(args.params, {"env.tasks_per_family": args.tasks_per_family} if args.tasks_per_family else None)
    model_dir = Path(args.model_dir or params.model.out_dir)
    if args.random_init:
        model_dir = random_model(model_dir, Path(tempfile.mkdtemp(prefix="eval_routes_model_")))
    folders = save_adapters(model_dir, Path(tempfile.mkdtemp(prefix="eval_routes_")), args.scale)
    policy = load_policy(model_dir, dtype=params.model.dtype, adapters=folders, tool_format=params.model.tool_format,
                         threads=params.rollout.threads)
    tasks = make_tasks(params.env, params.evaluate.split)
    routings = method_routings(tasks)
    rcfg = eval_rollout_config(params.rollout, params.evaluate)
    factory = lambda: make_env(params.env)  # noqa: E731
    arms = [("per-method", rcfg.batch_size)] + [("together", int(b)) for b in args.batch_sizes.split(",")]
    arms = [a for a in arms if a[0] in args.arms.split(",")]
    results: dict[tuple[str, int], list[tuple[float, int, int, int, dict]]] = {a: [] for a in arms}
    for rep in range(args.repeats):
        for arm, b in arms if rep % 2 == 0 else arms[::-1]:
            cfg = rcfg.model_copy(update={"batch_size": b})
            policy.clear_prefix_cache()
            memo: dict = {}
            t0 = time.perf_counter()
            if arm == "together":
                decode_into_memo(policy, tasks, factory, cfg, params.evaluate.seed, list(routings.values()), memo)
            out = {m: evaluate_policy(policy, tasks, factory, cfg, params.evaluate.seed, r, memo=memo)
                   for m, r in routings.items()}
            seconds = time.perf_counter() - t0
            episodes = [t for ts in memo.values() for t in ts]
            tokens = sum(t.completion_tokens for t in episodes)
            wins = {m: sum(t.success for t in ts) for m, ts in out.items()}
            results[(arm, b)].append((seconds, len(episodes), tokens, sum(t.success for t in episodes),
                                      {k: [t.messages for t in ts] for k, ts in memo.items()}))
            print(f"{arm} batch {b} repeat {rep}: {seconds:.1f} s, {len(episodes)} episodes, {tokens} agent tokens, "
                  f"successes per method {wins}", flush=True)
    ref = results[arms[0]][0][4]
    print("\n| arm | batch_size | seconds | episodes | agent tokens | agent tokens/s | episodes identical to the first arm's |")
    print("| --- | ---: | --- | ---: | --- | --- | --- |")
    for (arm, b), rs in results.items():
        same = ", ".join(f"{sum(r[4][k] == v for k, v in ref.items())}/{len(ref)}" for r in rs)
        print(f"| {arm} | {b} | {', '.join(f'{r[0]:.1f}' for r in rs)} | {rs[0][1]} | "
              f"{', '.join(str(r[2]) for r in rs)} | {', '.join(f'{r[2] / r[0]:.1f}' for r in rs)} | {same} |")


if __name__ == "__main__":
    main()
