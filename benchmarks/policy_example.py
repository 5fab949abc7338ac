"""Does the agent copy the retail policy's worked example? The base model, greedy, on a split of the target with
the example's last two lines (the tool's reply and the answer) rewritten per variant: as shipped (no status
shown), or showing a status and an answer that says it; successes per family and
the answers' words for the status.

Reads a finished `dvc repro` under --root (data/model, data/rollouts/tasks-<split>.jsonl, params.yaml); prints one
JSON object and writes nothing.

    .venv/bin/python benchmarks/policy_example.py --root <a finished repro> --split test
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from pathlib import Path

from trace_lib.config import load_params
from trace_lib.engine.policy import load_policy
from trace_lib.envs import load_tasks, make_env, retail
from trace_lib.evaluation.runner import eval_rollout_config, evaluate_policy

EXAMPLE_TOOL = 'tool: {"order_id": "#W0000000", ...}'
EXAMPLE_ANSWER = "assistant: (the facts the tool returned)"
VARIANTS = {
    "no status (as shipped)": None,
    "processed": ('tool: {"order_id": "#W0000000", "status": "processed", ...}',
                  "assistant: Your order #W0000000 is processed."),
    "pending": ('tool: {"order_id": "#W0000000", "status": "pending", ...}',
                "assistant: Your order #W0000000 is pending."),
}
"""Variant name -> (tool line, answer line) replacing the example's; None keeps the policy as it is."""
STATUSES = ("pending", "processed", "delivered", "cancelled")


def policy_variant(text: str, lines: tuple[str, str] | None) -> str:
    """The policy text with the example's tool and answer lines replaced by `lines`."""
    if lines is None:
        return text
    if EXAMPLE_TOOL not in text or EXAMPLE_ANSWER not in text:
        raise ValueError("the policy's worked example changed: update EXAMPLE_TOOL and EXAMPLE_ANSWER")
    return text.replace(EXAMPLE_TOOL, lines[0]).replace(EXAMPLE_ANSWER, lines[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".")
    ap.add_argument("--split", default="test")
    args = ap.parse_args()
    root = Path(args.root)
    params = load_params(root / "params.yaml")
    tasks = load_tasks(params.env, args.split, root)
    policy = load_policy(root / params.model.out_dir, dtype=params.model.dtype)
    cfg = eval_rollout_config(params.rollout, params.evaluate)
    load_policy_text = retail.load_policy_text  # what RetailEnv.system_prompt reads; put back after
    original = load_policy_text()
    result: dict = {"split": args.split, "tasks": len(tasks), "variants": {}}
    try:
        for name, lines in VARIANTS.items():
            text = policy_variant(original, lines)
            retail.load_policy_text = lambda text=text: text
            t0 = time.perf_counter()
            trajs = evaluate_policy(policy, tasks, lambda: make_env(params.env), cfg, params.seed)
            by_family: Counter = Counter()
            words: Counter = Counter()
            for traj in trajs:
                by_family[traj.family] += int(traj.success)
                answers = " ".join(m.content or "" for m in traj.messages if m.role == "assistant" and not m.tool_calls)
                words.update(f"{traj.family}:{s}" for s in STATUSES if re.search(rf"\b{s}\b", answers, re.I))
            result["variants"][name] = {"successes": sum(by_family.values()),
                                        "families": dict(sorted(by_family.items())),
                                        "status words said (episodes)": dict(sorted(words.items())),
                                        "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        retail.load_policy_text = load_policy_text
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
