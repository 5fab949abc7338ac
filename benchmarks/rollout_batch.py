"""The rollout stage's own work, timed: batch sizes, and ragged against padded prefill and attention.

Runs the rollout stage's work (the train split's tasks, the params' samples, seed and decoding) once per
(mode, batch size) in one process, rows alternating over repeats so a drifting machine favours none, and
reports seconds, prefill and decode seconds, agent tokens, agent tokens per second and successes.

Modes:
    continuous  the engine as it is (`rollout.continuous_batching`): one `Policy.play_turns` call, an
             episode's next turn and the queue's next episode joining the batch as it decodes
    ragged   turn by turn (one `generate_ids` call per turn of the live episodes, as before 2026-11-27,
             evening): rows' new tokens prefilled in passes of similar rows
             (`policy.prefill_passes`), a decoding step reading its rows' whole key and value buffers
             (contiguous) or a long row's early keys apart (`kvcache.history_split`)
    sliced   as before 2026-11-26 (evening): the decoding step reads the filled part of the buffers, a
             slice, which a bf16 product on the CPU computes on a slow path
    padded   as before 2026-11-26 (morning): sliced, one padded prefill pass over all rows, every row's
             keys read up to the longest history (both helpers patched to always choose the single batch)

Tool formats (`--tool-formats json,signature`, `model.tool_format`): every (mode, batch size) run once per way
of listing the tools in the system turn, the same loaded model rendering its prompts in that format.

Batch size: decoding on the CPU reads every weight (~270 MB in bf16 for SmolLM2-135M) once per step
whatever the batch, so more rows per step should cost little more, unless per-row work (attention over
long histories, prefill) dominates. Episodes differ between rows: the sampling seed of a call depends on
the call's index and on which episodes share it, and bf16 rounding on the batch's shapes.

    python benchmarks/rollout_batch.py [--params params.yaml] [--modes continuous,ragged] [--batch-sizes 8] \
        [--tool-formats json,signature] [--tasks-per-family 4]
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from pathlib import Path

from trace_lib.engine import kvcache
from trace_lib.engine import decoding, policy as policy_mod
from trace_lib.agent.rollout import collect_rollouts
from trace_lib.config import load_params
from trace_lib.envs import make_env, make_tasks


@contextmanager
def engine_mode(mode: str):
    if mode not in ("continuous", "ragged", "sliced", "padded"):
        raise ValueError(f"unknown mode {mode!r} (continuous, ragged, sliced, padded)")
    saved = decoding.prefill_cost, kvcache.history_split, kvcache.WHOLE_READ_COST, kvcache.BufferedLayer.update
    if mode in ("sliced", "padded"):
        whole_update = kvcache.BufferedLayer.update

        def filled_update(self, *args, **kwargs):  # the filled part of the buffers, not the whole
            whole_update(self, *args, **kwargs)
            return self.keys, self.values

        kvcache.BufferedLayer.update = filled_update
        kvcache.WHOLE_READ_COST = 1.0  # column 0 then costs what any other cut does, as before
    if mode == "padded":
        decoding.prefill_cost = lambda *a: 0.0  # every split looks no cheaper than one padded pass
        kvcache.history_split = lambda starts, length: 0  # every row's keys from column 0
    try:
        yield
    finally:
        (decoding.prefill_cost, kvcache.history_split, kvcache.WHOLE_READ_COST,
         kvcache.BufferedLayer.update) = saved


def family_wins(trajs) -> str:
    """Successes per task family, e.g. 'order_status 5/8, order_total 1/8'."""
    won: dict[str, list[int]] = {}
    for t in trajs:
        won.setdefault(t.family, []).append(int(t.success))
    return ", ".join(f"{f} {sum(w)}/{len(w)}" for f, w in sorted(won.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--modes", default="continuous,ragged")
    ap.add_argument("--batch-sizes", default="8")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--tasks", type=int, default=0, help="first N train tasks (0: all)")
    ap.add_argument("--tasks-per-family", type=int, default=0, help="the env's tasks per family (0: the params')")
    ap.add_argument("--tool-formats", default="", help="comma list of model.tool_format values (default: the "
                                                        "prepared model's)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="the rollout's (default: the params'); 0 plays the same episodes in every mode, up to "
                         "bf16 rounding on the batch's shapes")
    args = ap.parse_args()
    params = load_params(args.params, {"env.tasks_per_family": args.tasks_per_family} if args.tasks_per_family else None)
    policy = policy_mod.load_policy(Path(params.model.out_dir), dtype=params.model.dtype)
    tasks = make_tasks(params.env, params.rollout.split)
    tasks = tasks[: args.tasks] if args.tasks else tasks
    formats = args.tool_formats.split(",") if args.tool_formats else [policy.tool_format]
    runs = [(m, int(b), f) for f in formats for m in args.modes.split(",") for b in args.batch_sizes.split(",")]
    rows: dict[tuple[str, int, str], list[tuple[float, float, float, int, int, int]]] = {r: [] for r in runs}
    for rep in range(args.repeats):
        for mode, b, fmt in runs if rep % 2 == 0 else runs[::-1]:
            policy.tool_format = fmt
            cfg = params.rollout.model_copy(update={
                "batch_size": b, "continuous_batching": mode == "continuous",
                **({} if args.temperature is None else {"temperature": args.temperature})})
            policy.clear_prefix_cache()
            before = policy.stats.as_dict()
            t0 = time.perf_counter()
            with engine_mode(mode):
                trajs, timing = collect_rollouts(policy, lambda: make_env(params.env), tasks, cfg, params.seed,
                                                 progress=False)
            seconds = time.perf_counter() - t0
            after = policy.stats.as_dict()
            prefill, decode = (after[k] - before[k] for k in ("prefill_seconds", "decode_seconds"))
            wins = sum(t.success for t in trajs)
            rows[(mode, b, fmt)].append((seconds, prefill, decode, timing.completion_tokens, wins, len(trajs)))
            print(f"{mode} batch {b} tools {fmt} repeat {rep}: {seconds:.1f} s (prefill {prefill:.1f}, decode "
                  f"{decode:.1f}), {timing.completion_tokens} agent tokens, {wins}/{len(trajs)} succeeded, by family "
                  f"{family_wins(trajs)}", flush=True)
    print("\n| mode | batch_size | tool format | seconds | prefill s | decode s | agent tokens | agent tokens/s | succeeded |")
    print("| --- | ---: | --- | --- | --- | --- | --- | --- | --- |")
    for (mode, b, fmt), rs in rows.items():
        cols = [", ".join(f"{r[i]:.1f}" for r in rs) for i in range(3)]
        print(f"| {mode} | {b} | {fmt} | {' | '.join(cols)} | {', '.join(str(r[3]) for r in rs)} | "
              f"{', '.join(f'{r[3] / r[0]:.1f}' for r in rs)} | {', '.join(f'{r[4]}/{r[5]}' for r in rs)} |")


if __name__ == "__main__":
    main()
