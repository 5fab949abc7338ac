"""What the message's length bound costs a constrained decoding step: in the grammar, or in the processor.

Two ways to keep an agent's plain message to at most `max_text_chars` characters (1,200 by default):

    bounded    the grammar's message rule as a bounded repetition, `[^<{ \\t\\r\\n] [^<]{0,1199}`
               (trace_lib.engine.grammar before 2026-11-27)
    processor  the rule unbounded, `[^<]*`, and `ToolCallLogitsProcessor` forbidding the tokens that would
               take a message row past the bound (the module now)

Both allow the same tokens at every step (`tests/engine/test_grammar.py` compares the masks), so the same seeds decode
the same tokens. Part 1 times xgrammar's mask (`fill_next_token_bitmask`) along one fixed message and one fixed
tool call, per step. Part 2 runs the rollout stage's work (the train split, the params' decoding) both ways in one
process, alternating on repeats, and checks that the episodes are the same.

    python benchmarks/grammar_mask.py [--params params.yaml] [--repeats 1] [--tasks 0]
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from trace_lib.engine import grammar
from trace_lib.engine import policy as policy_mod
from trace_lib.agent.rollout import collect_rollouts
from trace_lib.config import load_params
from trace_lib.envs import make_env, make_tasks

BOUNDED = 'root ::= [^<{{ \\t\\r\\n] [^<]{{0,{rest}}}'
MESSAGE = ("Your order #W5673917 has been delivered. The total was 123.45 dollars, paid with your gift card. "
           "The customer purchased a wallet and a pair of shoes; both items were shipped together. ") * 2
CALL = '<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": "#W5673917"}}\n</tool_call>'


@contextmanager
def way(name: str, policy=None, limit: int = grammar.MAX_TEXT_CHARS):
    """The grammar module (and `policy`'s grammar options) as `name` keeps a bound of `limit` characters;
    yields the processor's `max_text_chars`. Compiled grammars are cached per way."""
    if name not in ("bounded", "processor"):
        raise ValueError(f"unknown way {name!r} (bounded, processor)")
    saved = grammar.TEXT_EBNF, dict(grammar.COMPILED), dict(policy.grammar_options) if policy else None
    grammar.COMPILED.clear()
    bound = limit
    if name == "bounded":  # the old rule; the processor's bound past anything a turn can reach
        grammar.TEXT_EBNF = BOUNDED.format(rest=limit - 1)
        bound = 10**9
    if policy is not None:
        policy.grammar_options = {**policy.grammar_options, "max_text_chars": bound}
    try:
        yield bound
    finally:
        grammar.TEXT_EBNF = saved[0]
        grammar.COMPILED.clear()
        grammar.COMPILED.update(saved[1])
        if policy is not None:
            policy.grammar_options = saved[2]


def mask_costs(tokenizer, tools: list[dict], vocab: int) -> None:
    print("| way | turn | tokens | mask ms per step (mean) | last 10 steps | slowest step |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    turns = (("message", MESSAGE, grammar.MAX_TEXT_CHARS), ("message ending at its bound", MESSAGE, len(MESSAGE)),
             ("tool call", CALL, grammar.MAX_TEXT_CHARS))
    for name in ("bounded", "processor"):
        for turn, text, limit in turns:
            with way(name, limit=limit) as bound:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                proc = grammar.make_tool_call_processor(tokenizer, tools, vocab_size=vocab, max_text_chars=bound)
                times = []
                for i in range(len(ids)):
                    scores = torch.zeros(1, vocab)
                    t0 = time.perf_counter()
                    scores = proc(torch.tensor([ids[:i]], dtype=torch.long), scores)
                    times.append(time.perf_counter() - t0)
                    assert bool(scores[0, ids[i]].isfinite()), (name, turn, i)
                mean, last = 1000 * sum(times) / len(times), 1000 * sum(times[-10:]) / 10
                print(f"| {name} | {turn} | {len(ids)} | {mean:.3f} | {last:.3f} | {1000 * max(times):.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--tasks", type=int, default=0, help="first N train tasks (0: all)")
    args = ap.parse_args()
    params = load_params(args.params)
    policy = policy_mod.load_policy(Path(params.model.out_dir), dtype=params.model.dtype)
    env = make_env(params.env)
    mask_costs(policy.tokenizer, env.tool_schemas(), policy._vocab_size())

    tasks = make_tasks(params.env, params.rollout.split)
    tasks = tasks[: args.tasks] if args.tasks else tasks
    names = ["bounded", "processor"]
    rows: dict[str, list[tuple[float, float, int, int, int]]] = {n: [] for n in names}
    episodes: dict[str, str] = {}
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            policy.clear_prefix_cache()
            before = policy.stats.decode_seconds
            t0 = time.perf_counter()
            with way(name, policy):
                trajs, timing = collect_rollouts(policy, lambda: make_env(params.env), tasks, params.rollout,
                                                 params.seed, progress=False)
            seconds = time.perf_counter() - t0
            decode = policy.stats.decode_seconds - before
            wins = sum(t.success for t in trajs)
            rows[name].append((seconds, decode, timing.completion_tokens, wins, len(trajs)))
            episodes[name] = json.dumps([[m.model_dump(mode="json") for m in t.messages] for t in trajs])
            print(f"{name} repeat {rep}: {seconds:.1f} s (decode {decode:.1f}), {timing.completion_tokens} agent "
                  f"tokens, {wins}/{len(trajs)} succeeded", flush=True)
    print("\n| way | seconds | decode s | agent tokens | agent tokens/s | succeeded |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rs in rows.items():
        print(f"| {name} | {', '.join(f'{r[0]:.1f}' for r in rs)} | {', '.join(f'{r[1]:.1f}' for r in rs)} | "
              f"{', '.join(str(r[2]) for r in rs)} | {', '.join(f'{r[2] / r[0]:.1f}' for r in rs)} | "
              f"{', '.join(f'{r[3]}/{r[4]}' for r in rs)} |")
    same = episodes["bounded"] == episodes["processor"]
    print(f"\nthe two ways played the same episodes (every message of every trajectory): {same}")


if __name__ == "__main__":
    main()
