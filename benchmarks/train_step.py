"""GRPO cost per trained rollout on a synthetic environment: trace's trainer vs TRL's own loss pass.

Both rows run the train stage's code (`train_adapter_mixture`: TRL's GRPOTrainer with trace's
multi-turn `rollout_func`, same model, LoRA config, environment, seeds, groups and group size, in
one process, one after the other). They differ only in how the loss pass is computed and in the
weights' dtype:

    trl        TRL's `_get_per_token_logps_and_entropies`: every row's prompt + completion through the
               forward and backward pass, activation checkpointing, fp32 base weights, one episode per
               micro-batch (the pipeline's setting before the shared-prompt pass)
    trl-bf16   the same with bf16 base weights (LoRA weights fp32)
    ours       training/shared_prompt.py: each group's prompt once, only the agent's tokens scored,
               the iteration in passes of up to 8 rollouts in fp32, 32 in bf16 (`train.micro_batch: 0`);
               episodes sampled with continuous batching
               (`Policy.play_turns`); base weights in the params' `train.dtype` (the CPU default's 'auto':
               bf16 where it is faster than fp32, else fp32); `ours-bf16`, `ours-fp32`: either dtype
    ours-free  the same, sampled as TRL's loop samples: no grammar, no forced first tool call
    ours-turns  `ours` sampled turn by turn (`train.continuous_batching: false`): each turn of the live
               episodes one decoding call, which runs until its longest row stops
    ours-nostem  `ours` with every row prefilling its own prompt (no shared stems: the K episodes of a
               group compute a tool result they all got K times; `engine/policy.py`)
    ours-noprefix  `ours` with the start all of an iteration's rows share (system turn, tool list) computed in
               each of its loss passes instead of once for all of them (`shared_prompt.SharedPrefix`); the same
               with one pass per iteration
    ours-unfolded  `ours` sampled through PEFT's LoRA layers instead of with the adapter folded into the base
               weights (`grpo.AgentRollout.fold_lora`, the default since 2026-12-01)
    ours-unpacked  `ours` with bf16 linear layers through `F.linear` (oneDNN reorders each weight at every call)
               instead of packed once where no gradient is recorded (`engine/packed.py`, the default since 2026-12-02)
    ours-shuffled  `ours-noprefix` with TRL's shuffle of the iteration's rows before they are split into loss
               passes (the trainer before 2026-11-29): with several passes per iteration (e.g. G8 x K4 in fp32,
               4 passes of 8) a pass holds rows of several groups instead of whole groups
    trl-env    TRL's own multi-turn loop instead of the train stage's: `GRPOTrainer(environment_factory=
               ...)` on the same synthetic environment (`envs.synthetic.to_trl_environment_factory`: one
               method per target tool, the task's customer opening from `reset`, the module's verdict as
               reward), TRL's generation (`model.generate` per turn, the same per-turn token cap, no constrained
               decoding, no forced first tool call), TRL's loss pass with its defaults (activation checkpointing), fp32 weights
               (TRL's default dtype; `trl-env-bf16`: bf16 base weights), same LoRA config, seeds, groups,
               group size, temperature and learning rate

`--tool-formats json,signature` runs every row once per way of listing the tools in the system turn
(`model.tool_format`), through a prepared folder that points at `--model-dir`'s weights and records the
format (rows named `ours[signature]`).

Reported per row: seconds per trained rollout (sampling + update), of which sampling, and the ratio
to the `trl` row. The shared-prompt rows also report the loss pass's token positions (`update_positions`: every
position its forward computes, padding included; `update_span_tokens`: the prefix tree's distinct tokens) and
the floor these put under the update at `--peak-gflops` (`update_floor_per_rollout`: SmolLM2's linear layers,
forward and the backward to the activations, at that rate; attention, the output layer and the LoRA weights'
own gradients left out, so the real floor is higher). The environment is the template synthesizer's
(`--capability`) for the retail target, served by the sandbox as in the train stage.

    python benchmarks/train_step.py --model-dir data/model --iterations 2 [--rows trl-env,trl,trl-bf16,ours]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from datasets import Dataset
from transformers import set_seed

import trace_lib.engine.packed as packed_mod
import trace_lib.engine.decoding as decoding
import trace_lib.training.shared_prompt as shared_prompt_mod
import trace_lib.training.grpo_trainer as grpo_trainer_mod
import trace_lib.training.trainer as trainer_mod
from trace_lib.engine.model import bf16_is_faster, has_bf16_kernels, resolve_model
from trace_lib.config import load_params
from trace_lib.envs.synthetic import SyntheticEnv, synthetic_tasks
from trace_lib.sandbox import SandboxLimits, SandboxProcess
from trace_lib.synth.synthesize import target_spec
from trace_lib.synth.templates import render_template_module
from trace_lib.budget import RolloutLedger
from trace_lib.training.grpo import AgentRollout, TrainSource
from trace_lib.training.shared_prompt import SharedPrefix
from trace_lib.training.grpo_trainer import rows_in_order
from trace_lib.training.trainer import (
    default_timing_path,
    read_timing,
    read_train_log,
    train_adapter_mixture,
)

ROWS = {
    "trl": {"shared_prompt": False, "dtype": "float32"},
    "trl-bf16": {"shared_prompt": False, "dtype": "bfloat16"},
    "ours": {"shared_prompt": True},
    "ours-bf16": {"shared_prompt": True, "dtype": "bfloat16"},
    "ours-fp32": {"shared_prompt": True, "dtype": "float32"},
    # what TRL's environment_factory loop can do: no grammar, no forced first tool call
    "ours-free": {"shared_prompt": True, "dtype": "bfloat16", "constrained": False, "tool_choice": "auto"},
    "ours-turns": {"shared_prompt": True, "dtype": "bfloat16", "continuous_batching": False},
    "ours-nostem": {"shared_prompt": True, "dtype": "bfloat16"},
    "ours-noprefix": {"shared_prompt": True},
    "ours-shuffled": {"shared_prompt": True},
    "ours-unfolded": {"shared_prompt": True},
    "ours-unpacked": {"shared_prompt": True},
}
UNFOLDED = {"ours-unfolded"}
UNPACKED = {"ours-unpacked"}
NO_STEMS = {"ours-nostem"}
SHUFFLED = {"ours-shuffled"}
NO_PREFIX = {"ours-noprefix", "ours-shuffled"}
TRL_ENV_ROWS = {"trl-env": "float32", "trl-env-bf16": "bfloat16"}


class UpdateTokens:
    """Counts what the shared-prompt loss pass computes: each work unit's padded positions (b x widest span) and
    its spans' own tokens; an iteration's shared prefix (`SharedPrefix`) once, where it is computed, and not in the
    passes that continue from it. Measuring wrappers around `shared_prompt.work_units`, `SharedPrefix.ensure` and
    the trainer's `grouped_logps`, installed by `counting`, which returns what puts the originals back."""

    def __init__(self) -> None:
        self.positions = 0
        self.span_tokens = 0
        self.passes = 0
        self.prefix_tokens = 0

    def counting(self):
        inner, ensure, logps = shared_prompt_mod.work_units, SharedPrefix.ensure, grpo_trainer_mod.grouped_logps

        def work_units(spans, *a, **kw):
            units = inner(spans, *a, **kw)
            self.passes += 1
            for unit in units:
                lens = [spans[j].end - spans[unit[0]].start for j in unit]
                self.positions += len(unit) * max(lens)
                self.span_tokens += sum(spans[j].end - spans[j].start for j in unit)
            return units

        def counted_ensure(prefix, *a, **kw):
            if prefix.cache is None:
                self.positions += len(prefix)
                self.span_tokens += len(prefix)
                self.prefix_tokens += len(prefix)
            return ensure(prefix, *a, **kw)

        def counted_logps(*a, prefix=None, **kw):
            uses = prefix.uses if prefix is not None else 0
            out = logps(*a, prefix=prefix, **kw)
            if prefix is not None and prefix.uses > uses:  # the pass continued from the prefix
                self.positions -= len(prefix)
                self.span_tokens -= len(prefix)
            return out

        shared_prompt_mod.work_units, SharedPrefix.ensure = work_units, counted_ensure
        grpo_trainer_mod.grouped_logps = counted_logps

        def restore() -> None:
            shared_prompt_mod.work_units, SharedPrefix.ensure, grpo_trainer_mod.grouped_logps = inner, ensure, logps

        return restore


def linear_gflop_per_token(model_dir: Path) -> float:
    """GFLOP of one token's forward through the decoder's linear layers (2 x their weights; no embedding or output
    layer), from the prepared model's config."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    d, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or d // heads
    per_layer = d * heads * head_dim * 2 + d * kv * head_dim * 2 + 3 * d * inter
    return 2 * per_layer * c["num_hidden_layers"] / 1e9


def run_trl_environment_factory(model_dir: Path, box: SandboxProcess, params, cfg, capability: str, out: Path,
                                dtype: str) -> dict:
    """TRL's `GRPOTrainer(environment_factory=...)` on the sandboxed synthetic environment; returns
    seconds (whole `train()`), of which generation+scoring, and the rollouts TRL played."""
    from peft import get_peft_model
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from trace_lib.engine.policy import load_policy
    from trace_lib.envs.synthetic import to_trl_environment_factory, trl_reward, trl_rows
    from trace_lib.training.trainer import lora_config, stable_target_modules

    set_seed(params.seed)
    policy = load_policy(model_dir, dtype=dtype)
    model = get_peft_model(policy.model, lora_config(cfg, policy.model))
    stable_target_modules(model)
    tok = policy.tokenizer
    tok.padding_side = "left"
    # The chat template's tool calls are Hermes-style (`<tool_call>{json}</tool_call>`), the format of
    # TRL's Qwen3 response template; TRL only sets one itself for chat templates it knows by content.
    tok.response_template = qwen3_template
    seeds = range(cfg.seed_offset, cfg.seed_offset + cfg.iterations * cfg.groups)
    tasks = synthetic_tasks(box, capability, seeds, params.synthesize.difficulty, "train")
    args = GRPOConfig(
        output_dir=str(out), seed=params.seed, max_steps=cfg.iterations, per_device_train_batch_size=cfg.group_size,
        gradient_accumulation_steps=cfg.groups, num_generations=cfg.group_size, shuffle_dataset=False,
        learning_rate=cfg.learning_rate, lr_scheduler_type="constant", beta=cfg.beta, epsilon=cfg.epsilon,
        temperature=cfg.temperature, loss_type="dapo", scale_rewards="group",
        max_completion_length=cfg.max_steps_per_episode * cfg.max_new_tokens + cfg.tool_result_tokens,
        max_tool_calling_iterations=cfg.max_steps_per_episode - 1, logging_steps=1, save_strategy="no",
        generation_kwargs={"max_new_tokens": cfg.max_new_tokens},  # the same per-turn cap as the train stage
        report_to="none", disable_tqdm=True, use_cpu=True, bf16=False, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward], args=args,
                          train_dataset=Dataset.from_list(trl_rows(tasks, params.env)), processing_class=tok,
                          environment_factory=to_trl_environment_factory(box, params.env,
                                                                         params.synthesize.difficulty))
    sampling = 0.0
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        nonlocal sampling
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            sampling += time.perf_counter() - t

    trainer._generate_and_score_completions = timed_generate
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    logs = [r for r in trainer.state.log_history if "reward" in r]
    return {"rollouts": cfg.iterations * cfg.groups * cfg.group_size, "seconds": seconds, "sampling": sampling,
            "rewards": [round(r["reward"], 4) for r in logs],
            "tool_metrics": {k: round(v, 4) for r in logs for k, v in r.items() if k.startswith("tools/")},
            "completion_tokens": sum(round(r.get("completions/mean_length", 0) * cfg.groups * cfg.group_size)
                                     for r in logs)}


def row_result(rollouts: int, iterations: int, wall: float, step: float, sampling: float, trained_tokens: int | None,
               completion_tokens: int, rewards: list[float], **extra) -> dict:
    """One row of the table: seconds per rollout of the timed steps, split into sampling and update."""
    return {"rollouts": rollouts, "iterations": iterations, "wall_seconds": round(wall, 1),
            "step_seconds": round(step, 1), "seconds_per_rollout": round(step / rollouts, 2),
            "sampling_per_rollout": round(sampling / rollouts, 2),
            "update_per_rollout": round((step - sampling) / rollouts, 2),
            "trained_tokens": trained_tokens, "completion_tokens": completion_tokens, "rewards": rewards, **extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="data/model")
    ap.add_argument("--capability", default="communicate_result")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--groups", type=int, default=0, help="0: the cpu profile's")
    ap.add_argument("--group-size", type=int, default=0, help="0: the cpu profile's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="trl,ours")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    ap.add_argument("--peak-gflops", type=float, default=256.0,
                    help="the machine's matrix rate in GFLOP/s for update_floor_per_rollout, in the rows' training "
                         "dtype: for `auto` bf16 where it is faster, else fp32 (linear_dtype.py measures both)")
    ap.add_argument("--tool-formats", default="", help="comma list of model.tool_format values: each row once per "
                                                        "format (default: the prepared model's, once)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = load_params("params.yaml")
    base = params.train.model_copy(update={
        "iterations": args.iterations, "save_every": args.iterations, "snapshots": False,
        **({"groups": args.groups} if args.groups else {}), **({"group_size": args.group_size} if args.group_size else {})})
    results: dict[str, dict] = {}
    stem_saving = decoding.MIN_STEM_SAVING
    with tempfile.TemporaryDirectory() as tmp:
        module = Path(tmp) / "env.py"
        module.write_text(render_template_module(args.capability, target_spec(params.env),
                                                 params.synthesize.difficulty))
        with SandboxProcess(module, SandboxLimits(timeout_s=30, cpu_s=3600, memory_mb=2048)) as box:
            source = TrainSource(args.capability, lambda: SyntheticEnv(box, params.env,
                                                                       max_steps=base.max_steps_per_episode),
                                 lambda seeds: synthetic_tasks(box, args.capability, seeds,
                                                               params.synthesize.difficulty, "train"))
            formats = args.tool_formats.split(",") if args.tool_formats else [None]
            model_dirs = {fmt: Path(args.model_dir) if fmt is None else resolve_model(  # one folder per format
                str(Path(args.model_dir).resolve()), Path(tmp) / f"model-{fmt}", params.model.dtype, tool_format=fmt)
                for fmt in formats}
            for row, fmt in [(r, f) for f in formats for r in args.rows.split(",")]:
                model_dir = model_dirs[fmt]
                name = row if fmt is None else f"{row}[{fmt}]"
                out = Path(tmp) / name
                if row in TRL_ENV_ROWS:
                    r = run_trl_environment_factory(model_dir, box, params, base, args.capability, out,
                                                    TRL_ENV_ROWS[row])
                    results[name] = row_result(
                        r["rollouts"], base.iterations, r["seconds"], r["seconds"], r["sampling"], None,
                        r["completion_tokens"], r["rewards"], tool_metrics=r["tool_metrics"])
                else:
                    cfg = base.model_copy(update=ROWS[row])
                    decoding.MIN_STEM_SAVING = 10**9 if row in NO_STEMS else stem_saving
                    counter = UpdateTokens()
                    restore = counter.counting()
                    if row in SHUFFLED:  # TRL's own split: the rows shuffled, whatever the number of passes
                        grpo_trainer_mod.rows_in_order = nullcontext
                    min_prefix = grpo_trainer_mod.MIN_PREFIX_TOKENS
                    if row in NO_PREFIX:
                        grpo_trainer_mod.MIN_PREFIX_TOKENS = 10**9
                    AgentRollout.fold_lora = row not in UNFOLDED
                    packing_available = packed_mod.packing_available
                    if row in UNPACKED:
                        packed_mod.packing_available = lambda: False
                    t0 = time.perf_counter()
                    try:
                        manifest = train_adapter_mixture(model_dir, [source], cfg, out, seed=params.seed,
                                                         ledger=RolloutLedger(Path(tmp) / f"{name}.ledger.jsonl"),
                                                         name=row)
                    finally:
                        restore()
                        grpo_trainer_mod.rows_in_order = rows_in_order
                        grpo_trainer_mod.MIN_PREFIX_TOKENS = min_prefix
                        AgentRollout.fold_lora = True
                        packed_mod.packing_available = packing_available
                    wall = time.perf_counter() - t0
                    n = max(manifest.rollouts_used, 1)
                    floor = counter.positions * 2 * linear_gflop_per_token(model_dir) / args.peak_gflops / n
                    timing = read_timing(default_timing_path(out))["iterations"]
                    log = read_train_log(out)
                    results[name] = row_result(
                        manifest.rollouts_used, len(log), wall, sum(t["seconds"] for t in timing),
                        sum(t.get("rollout_seconds", 0.0) for t in timing), sum(r["trained_tokens"] for r in log),
                        sum(r["completion_tokens"] for r in log), [r["reward"] for r in log],
                        **{key: round(sum(t.get(key, 0) for t in timing), 2) for key in
                           ("prefill_seconds", "decode_seconds", "prompt_tokens_computed")},
                        **({"update_positions": counter.positions, "update_span_tokens": counter.span_tokens,
                            "update_passes": counter.passes, "update_prefix_tokens": counter.prefix_tokens,
                            "update_floor_per_rollout": round(floor, 2)} if counter.positions else {}))
                print(name, json.dumps(results[name]), flush=True)
    print(f"\ncapability={args.capability} iterations={args.iterations} groups={base.groups} "
          f"group_size={base.group_size} threads={args.threads} torch={torch.__version__} "
          f"cpu_capability={torch.backends.cpu.get_cpu_capability()} "
          f"cpu_bf16_kernels={has_bf16_kernels(torch.device('cpu'))} "
          f"cpu_bf16_faster={bf16_is_faster(torch.device('cpu'))}")
    refs = [ref for ref in ("trl-env", "trl") if ref in results]
    print("| row | rollouts | s/rollout | sampling s/rollout | update s/rollout |"
          + "".join(f" vs {ref} |" for ref in refs))
    print("| --- | ---: | ---: | ---: | ---: |" + " ---: |" * len(refs))
    for row, r in results.items():
        ratios = [f" {r['seconds_per_rollout'] / results[ref]['seconds_per_rollout']:.2f}x |" for ref in refs]
        print(f"| {row} | {r['rollouts']} | {r['seconds_per_rollout']} | {r['sampling_per_rollout']} | "
              f"{r['update_per_rollout']} |" + "".join(ratios))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
