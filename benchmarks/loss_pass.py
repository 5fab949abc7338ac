"""GRPO's loss pass on the same recorded batches: prefix tree (with and without the prompt's gradient),
prompts-only tree, padded groups.

Records the loss pass's inputs of a short GRPO run (the train stage's code, as `train_step.py --rows ours`:
template environment of `--capability`, the cpu profile's groups, bf16 base weights), then times forward +
backward on each recorded batch once per way per round (`--ways`; the first is the reference the others are
compared with), the order of the ways rotating, for `--rounds` rounds (`--start-late`: the run records
episodes that start after the reference's lookups, `train.start_late`, so the prompts hold the lookup's result):

    tree          `training/shared_prompt.grouped_logps`: every stretch rows share runs once, the rows' own
                  parts after it in padded batches where the padding costs less than a call
    prompt-tree   the same with `share_completions=False`: only prompt tokens are shared
    tree-nopg     `tree` with `prompt_grad=False`: each row's prompt (but its last token) without gradient
    padded        the pass before prefix trees (`padded_groups_logps` below): the prompt tokens all rows
                  share once, each group's prompt once, each group's completions one batch padded to its
                  longest

The loss is the log-probs times fixed per-row weights (both signs, like advantages), on a freshly initialised
LoRA adapter with non-zero B, so every LoRA weight gets a gradient. Also reported per batch: the token
positions each way runs through the decoder, and how far each tree's log-probs and gradients are from the
reference way's (the largest log-prob difference; the largest over LoRA tensors of the gradient difference's
norm over the gradient's norm; the cosine of the whole gradients). bf16 rounds differently in other batch
shapes, so the prompt-only tree, which computes the same as the padded pass but for the batch shapes, gives
the floor; fp32 agreement is a unit test.

    .venv/bin/python benchmarks/loss_pass.py --iterations 2 --rounds 3 --ways padded,tree,prompt-tree
    .venv/bin/python benchmarks/loss_pass.py --iterations 2 --rounds 3 --ways tree,tree-nopg --start-late 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import trace_lib.training.grpo_trainer as grpo_trainer_mod
import trace_lib.training.trainer as trainer_mod
from trace_lib.config import load_params
from trace_lib.training.sources import synthetic_source
from trace_lib.sandbox import SandboxLimits, SandboxProcess
from trace_lib.synth.synthesize import target_spec
from trace_lib.synth.templates import render_template_module
from trace_lib.budget import RolloutLedger
from transformers.cache_utils import DynamicCache

from trace_lib.training.shared_prompt import (expand_cache, low_precision, before_breaks, decoder_and_head, grouped_logps,
                                             prompt_breaks, scored_sequences, shared_spans, work_units)


def record_batches(model_dir: Path, capability: str, iterations: int, tmp: Path, start_late: float = 0.0,
                   groups: int = 0) -> list[dict]:
    """The inputs of every loss pass (calls with gradients) of a GRPO run of `iterations`."""
    params = load_params("params.yaml")
    cfg = params.train.model_copy(update={"iterations": iterations, "save_every": iterations, "snapshots": False,
                                          "shared_prompt": True, "dtype": "bfloat16", "start_late": start_late,
                                          "groups": groups or params.train.groups})
    batches: list[dict] = []
    real = grpo_trainer_mod.grouped_logps

    def recording(model, input_ids, attention_mask, logits_to_keep, score_mask=None, compute_entropy=False, **kw):
        if torch.is_grad_enabled():
            batches.append({"input_ids": input_ids.clone(), "attention_mask": attention_mask.clone(),
                            "logits_to_keep": logits_to_keep,
                            "score_mask": None if score_mask is None else score_mask.clone()})
        return real(model, input_ids, attention_mask, logits_to_keep, score_mask, compute_entropy, **kw)

    module = tmp / "env.py"
    module.write_text(render_template_module(capability, target_spec(params.env), params.synthesize.difficulty))
    grpo_trainer_mod.grouped_logps = recording
    try:
        with SandboxProcess(module, SandboxLimits(timeout_s=30, cpu_s=3600, memory_mb=2048)) as box:
            # the train stage's source: with the reference solution a late start plays
            source = synthetic_source(box, capability, params.env, cfg.max_steps_per_episode,
                                      params.synthesize.difficulty)
            trainer_mod.train_adapter_mixture(model_dir, [source], cfg, tmp / "adapter", seed=params.seed,
                                              ledger=RolloutLedger(tmp / "ledger.jsonl"), name="loss_pass")
    finally:
        grpo_trainer_mod.grouped_logps = real
    return batches


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Rows with the same (unpadded) prompt, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in range(prompt_ids.shape[0]):
        key = tuple(prompt_ids[i][prompt_mask[i].bool()].tolist())
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _common_length(prompts: list[torch.Tensor]) -> int:
    """Tokens every prompt starts with (at least one token of each prompt is left over)."""
    n = min(int(p.shape[0]) for p in prompts) - 1
    first = prompts[0][:n]
    for p in prompts[1:]:
        same = (p[:n] == first).long()
        n = int(same.cumprod(0).sum())
        first = first[:n]
    return n


def padded_groups_logps(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    score_mask: torch.Tensor | None = None,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss pass before prefix trees (trace at 31da80f, kept here as the peer): the prompt tokens all
    rows share once, each group's rest of its prompt once, each group's completions as one batch padded to
    its longest, every completion token up to the longest run."""
    decoder, head = decoder_and_head(model)
    width = input_ids.shape[1] - logits_to_keep
    prompts, completions = input_ids[:, :width], input_ids[:, width:]
    p_mask, c_mask = attention_mask[:, :width], attention_mask[:, width:]
    score = (c_mask if score_mask is None else score_mask * c_mask).bool()
    logps = torch.zeros(score.shape, dtype=torch.float32, device=input_ids.device)
    entropies = torch.zeros_like(logps) if compute_entropy else None
    groups = [rows for rows in prompt_groups(prompts, p_mask) if bool(score[rows].any())]
    if not groups:
        return logps, entropies
    unpadded = [prompts[rows[0]][p_mask[rows[0]].bool()] for rows in groups]
    with low_precision(model):
        shared_len = _common_length(unpadded) if len(groups) > 1 else 0
        shared = DynamicCache()
        if shared_len:
            decoder(input_ids=unpadded[0][None, :shared_len], past_key_values=shared, use_cache=True)
        for rows, prompt in zip(groups, unpadded):
            k, plen = len(rows), prompt.shape[0]
            cache = expand_cache(shared, 1) if shared_len else DynamicCache()
            hidden_p = decoder(input_ids=prompt[None, shared_len:], past_key_values=cache, use_cache=True,
                               position_ids=torch.arange(shared_len, plen, device=prompt.device)[None],
                               ).last_hidden_state
            length = int(c_mask[rows].sum(-1).max())  # completions are right-padded
            mask = torch.cat([c_mask.new_ones(k, plen), c_mask[rows, :length]], dim=1)
            positions = torch.arange(plen, plen + length, device=input_ids.device)[None].expand(k, -1)
            hidden_c = decoder(input_ids=completions[rows, :length], attention_mask=mask, position_ids=positions,
                               past_key_values=expand_cache(cache, k), use_cache=True).last_hidden_state
            # the hidden state before token t predicts it: the prompt's last one for t = 0
            before = torch.cat([hidden_p[:, -1:].expand(k, -1, -1), hidden_c[:, :-1]], dim=1)
            where = score[rows, :length]
            logits = head(before[where]).float()
            log_probs = logits.log_softmax(-1)
            targets = completions[rows, :length][where]
            picked = log_probs.gather(-1, targets[:, None]).squeeze(-1)
            index = torch.tensor(rows, device=input_ids.device)
            row_of = index[:, None].expand(-1, length)[where]
            col_of = torch.arange(length, device=input_ids.device)[None].expand(k, -1)[where]
            logps = logps.index_put((row_of, col_of), picked)
            if entropies is not None:
                ent = -(log_probs.exp() * log_probs).sum(-1)
                entropies = entropies.index_put((row_of, col_of), ent.detach())
    return logps, entropies


WAYS = ("tree", "tree-nopg", "prompt-tree", "padded")


def decoder_tokens(batch: dict, way: str) -> int:
    """Token positions the decoder runs for one batch, each way, padding included."""
    ids, mask, n = batch["input_ids"], batch["attention_mask"], batch["logits_to_keep"]
    width = ids.shape[1] - n
    if way == "padded":
        groups = prompt_groups(ids[:, :width], mask[:, :width])
        prompts = [ids[rows[0], :width][mask[rows[0], :width].bool()] for rows in groups]
        shared = _common_length(prompts) if len(groups) > 1 else 0
        return shared + sum(len(p) - shared + len(rows) * int(mask[rows, width:].sum(-1).max())
                            for rows, p in zip(groups, prompts))
    seqs, _, plens = scored_sequences(ids, mask, n, batch["score_mask"])
    breaks = prompt_breaks(plens) if way == "tree-nopg" else None
    spans = shared_spans([s.tolist() for s in seqs], None if way.startswith("tree") else plens, breaks)
    return sum(len(unit) * max(spans[j].end - spans[j].start for j in unit) for unit in work_units(spans))


def prompt_tokens_without_grad(batch: dict) -> int:
    """Token positions `tree-nopg` runs without gradient (each row's prompt but its last token, once per span)."""
    seqs, _, plens = scored_sequences(batch["input_ids"], batch["attention_mask"], batch["logits_to_keep"],
                                      batch["score_mask"])
    breaks = prompt_breaks(plens)
    spans = shared_spans([s.tolist() for s in seqs], None, breaks)
    return sum(s.end - s.start for s in spans if before_breaks(s, breaks))


def timed_pass(model, batch: dict, weights: torch.Tensor, way: str) -> tuple[float, torch.Tensor, list]:
    params = [p for p in model.parameters() if p.requires_grad]
    args = (model, batch["input_ids"], batch["attention_mask"], batch["logits_to_keep"], batch["score_mask"])
    t0 = time.perf_counter()
    if way == "padded":
        logps, _ = padded_groups_logps(*args)
    else:
        logps, _ = grouped_logps(*args, share_completions=way.startswith("tree"), prompt_grad=way != "tree-nopg")
    grads = torch.autograd.grad((logps * weights[:, None]).sum(), params)
    return time.perf_counter() - t0, logps.detach(), grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="data/model")
    ap.add_argument("--capability", default="communicate_result")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ways", default=",".join(WAYS), help=f"of {', '.join(WAYS)}; the first is the reference")
    ap.add_argument("--start-late", type=float, default=0.0, help="train.start_late of the recorded run")
    ap.add_argument("--groups", type=int, default=0, help="train.groups of the recorded run (0: the params')")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    ap.add_argument("--batches", default="", help="a torch file of recorded batches: read if it exists, "
                                                  "else written after recording")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.batches and Path(args.batches).exists():
        batches = torch.load(args.batches)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            batches = record_batches(Path(args.model_dir), args.capability, args.iterations, Path(tmp),
                                     args.start_late, args.groups)
        if args.batches:
            torch.save(batches, args.batches)
    if not batches:
        raise SystemExit("no loss pass ran (every group had equal rewards): try more --iterations")
    params = load_params("params.yaml")
    cfg = params.train.model_copy(update={"dtype": "bfloat16"})
    policy, _ = trainer_mod.load_trainable(Path(args.model_dir), cfg, "trl", params.seed)
    model = policy.model.train()
    torch.manual_seed(0)
    with torch.no_grad():  # B = 0 at init: give the adapter an output so both LoRA factors get gradients
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    ways = args.ways.split(",")
    if not ways or any(w not in WAYS for w in ways):
        raise SystemExit(f"--ways: each of {', '.join(WAYS)}; got {args.ways!r}")
    ref = ways[0]
    results = []
    for b, batch in enumerate(batches):
        rows = batch["input_ids"].shape[0]
        weights = torch.linspace(-1, 1, rows)
        seconds: dict[str, list[float]] = {w: [] for w in ways}
        out: dict[str, tuple] = {}
        for r in range(args.rounds):
            for way in ways[r % len(ways):] + ways[:r % len(ways)]:
                s, logps, grads = timed_pass(model, batch, weights, way)
                seconds[way].append(s)
                out[way] = (logps, grads)
        def apart(way: str) -> tuple[float, float, float]:
            """Largest |log-prob difference|; largest gradient difference / norm over LoRA tensors; cosine of
            the whole gradients (all LoRA tensors as one vector)."""
            diff = (out[way][0] - out[ref][0]).abs().max()
            rel = max(float((a - c).norm() / c.norm().clamp_min(1e-12)) for a, c in zip(out[way][1], out[ref][1]))
            g, h = (torch.cat([t.flatten().float() for t in out[w][1]]) for w in (way, ref))
            cos = float(g @ h / (g.norm() * h.norm()).clamp_min(1e-12))
            return round(float(diff), 4), round(rel, 4), round(cos, 4)

        score = batch["score_mask"]
        results.append({
            "batch": b, "rows": rows, "scored_tokens": None if score is None else int(score.sum()),
            "prompt_tokens_without_grad": prompt_tokens_without_grad(batch),
            **{f"decoder_tokens_{w}": decoder_tokens(batch, w) for w in ways},
            **{f"seconds_{w}": [round(x, 2) for x in seconds[w]] for w in ways},
            **{f"{w}_vs_{ref}_logp_grad_cos": apart(w) for w in ways[1:]}})
        print(json.dumps(results[-1]), flush=True)
    med = {w: sum(sorted(r[f"seconds_{w}"])[len(r[f"seconds_{w}"]) // 2] for r in results) for w in ways}
    print(f"\ncapability={args.capability} batches={len(batches)} rounds={args.rounds} threads={args.threads} "
          f"start_late={args.start_late} torch={torch.__version__}")
    print(f"| way | decoder token positions | s (sum of per-batch medians) | vs {ref} |")
    print("| --- | ---: | ---: | ---: |")
    for w in ways:
        tokens = sum(r[f"decoder_tokens_{w}"] for r in results)
        print(f"| {w} | {tokens} | {med[w]:.2f} | {med[w] / med[ref]:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
