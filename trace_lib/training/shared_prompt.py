"""Per-token log-probs of GRPO batches with every stretch of tokens that rows share computed once (paper §3.3
training step).

Reads and writes nothing; `trainer.AgentGRPOTrainer` calls `grouped_logps` in place of TRL's
`_get_per_token_logps_and_entropies` for text-only batches.

Why our own: the rows of a GRPO batch repeat one another at length. All start with the same system turn
and tool list (~650 tokens on a synthetic environment, ~1.8k on retail), the K rows of a group with the
same task, and most of a group's episodes with the same first tool call and its result (a few hundred
tokens more), while what is each episode's own is short. TRL runs every row's whole sequence through
the forward and backward pass, padded to the longest. Here the rows form a prefix tree
(`shared_spans`): each stretch common to several rows runs once (batch 1) with its gradient, and the
stretches after it attend to its keys and values, so the gradient through a shared stretch is the sum
over its rows, exactly as in the row-by-row computation. The rows' own parts that follow the same
span run as one batch, padded only where the padding costs less than a call (`leaf_batches`).
Log-probs (and entropies) are computed only at the positions the loss reads (the agent's tokens),
once per shared stretch, and nothing after a row's last such position runs; elsewhere they are 0,
which the loss multiplies by a zero mask anyway. `benchmarks/loss_pass.py` and `benchmarks/train_step.py` measure it.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers.cache_utils import DynamicCache


def decoder_and_head(model: Any) -> tuple[Any, Any]:
    """(decoder stack returning hidden states, LM head) of a causal LM, PEFT-wrapped or not, inside a DDP
    wrapper or not (its modules are called directly: `training/distributed.py` averages the gradients)."""
    model = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "model") or not hasattr(base, "lm_head"):
        raise TypeError(f"{type(base).__name__} has no .model/.lm_head: not a decoder-only causal LM")
    return base.model, base.lm_head


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of the sequences of `rows`, the same in each, computed once after `parent`'s."""

    rows: tuple[int, ...]
    start: int
    end: int
    parent: int
    """Index of the span this one continues (-1: it starts the sequences)."""


def shared_spans(seqs: Sequence[Sequence[int]], share_until: Sequence[int] | None = None,
                 breaks: Sequence[int] | None = None) -> list[Span]:
    """The sequences as a prefix tree of spans, each parent before its children; the spans on a row's path
    cover its tokens once each. Row i shares none of its tokens past `share_until[i]` (default: all may be
    shared), no span of row i crosses position `breaks[i]` (one ends there), and a span before a row's break is
    shared only with rows that are also before theirs; an empty sequence has no span."""
    limits = [len(s) if share_until is None else min(len(s), u) for s, u in zip(seqs, share_until or seqs)]
    cuts = [0] * len(seqs) if breaks is None else list(breaks)
    spans: list[Span] = []

    def leaf(r: int, start: int, parent: int) -> None:
        if start < cuts[r] < len(seqs[r]):
            spans.append(Span((r,), start, cuts[r], parent))
            start, parent = cuts[r], len(spans) - 1
        if len(seqs[r]) > start:
            spans.append(Span((r,), start, len(seqs[r]), parent))

    def visit(rows: list[int], start: int, parent: int) -> None:
        if not rows:
            return
        if len(rows) == 1:
            return leaf(rows[0], start, parent)
        cap = min(limits[r] for r in rows)
        n = len(os.path.commonprefix([list(seqs[r][start:cap]) for r in rows])) if cap > start else 0
        n = min([n, *(cuts[r] - start for r in rows if cuts[r] > start)])
        if len({start < cuts[r] for r in rows}) > 1:
            n = 0  # rows before their break and rows past it share nothing (they part below)
        if n:
            spans.append(Span(tuple(rows), start, start + n, parent))
            start, parent = start + n, len(spans) - 1
        parts: dict[tuple[int, bool], list[int]] = {}
        for r in rows:
            if len(seqs[r]) <= start:
                continue  # the row ends here: its tokens are all in the spans above
            if limits[r] <= start:
                leaf(r, start, parent)  # shares nothing more
            else:
                parts.setdefault((int(seqs[r][start]), start < cuts[r]), []).append(r)
        for part in parts.values():
            visit(part, start, parent)

    visit([r for r in range(len(seqs)) if len(seqs[r])], 0, -1)
    return spans


def prompt_breaks(prompt_lengths: Sequence[int]) -> list[int]:
    """Where each row's prompt stops running without gradient (`prompt_grad=False`): before its last token,
    whose hidden state predicts the first completion token and so must keep its gradient."""
    return [n - 1 for n in prompt_lengths]


def before_breaks(span: Span, breaks: Sequence[int]) -> bool:
    """Whether the span lies before the break of every row it belongs to (it runs without gradient)."""
    return all(span.end <= breaks[r] for r in span.rows)


CALL_COST_TOKENS = 128
"""Padding (token positions) worth one decoder call fewer in the loss pass: a call's fixed cost is that of
many tokens, so rows whose own parts differ little in width are padded into one call rather than run apart
(`benchmarks/loss_pass.py`)."""


def leaf_batches(spans: Sequence[Span], call_cost: int = CALL_COST_TOKENS) -> list[list[int]]:
    """The one-row spans (a row's own part) grouped into padded batches: siblings (same parent) only, longest
    first, each joining its batch while it is at most `call_cost` tokens shorter than the batch's longest. A
    one-row span that others continue (cut at a break) stays alone."""
    parents = {span.parent for span in spans}
    siblings: dict[int, list[int]] = {}
    for j, span in enumerate(spans):
        if len(span.rows) == 1 and j not in parents:
            siblings.setdefault(span.parent, []).append(j)
    batches: list[list[int]] = []
    for leaves in siblings.values():
        leaves = sorted(leaves, key=lambda j: spans[j].start - spans[j].end)  # longest first, stable
        batch = [leaves[0]]
        for j in leaves[1:]:
            longest = spans[batch[0]].end - spans[batch[0]].start
            if longest - (spans[j].end - spans[j].start) <= call_cost:
                batch.append(j)
            else:
                batches.append(batch)
                batch = [j]
        batches.append(batch)
    return batches


def expand_cache(cache: DynamicCache, k: int) -> DynamicCache:
    """A cache whose k rows all start with `cache`'s single row (views; gradients flow back)."""
    out = DynamicCache()
    for idx, layer in enumerate(cache.layers):
        out.update(layer.keys.expand(k, -1, -1, -1), layer.values.expand(k, -1, -1, -1), idx)
    return out


def low_precision(model: Any):
    """bf16 autocast without PEFT's input casting when the base weights are bf16 on CPU.

    PEFT keeps LoRA weights in fp32 and casts every LoRA input to fp32, so each adapted layer adds
    fp32 element-wise work over the whole activation; in the loss pass that was ~40% of the forward
    time (py-spy, SmolLM2 with LoRA on 7 modules). Under autocast the LoRA products run in bf16 from
    the fp32 master weights, which receive fp32 gradients.
    """
    from contextlib import ExitStack

    from peft.helpers import disable_input_dtype_casting

    stack = ExitStack()
    weight = next((p for p in model.parameters() if not p.requires_grad), None)
    if weight is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        stack.enter_context(disable_input_dtype_casting(model))
    return stack


def _scored_logps(head: Any, before: torch.Tensor, targets: torch.Tensor, compute_entropy: bool,
                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of each target token, entropy or None) from the hidden states before them, under the
    distribution the tokens were sampled from: the logits divided by `temperature`."""
    logits = head(before).float()
    log_probs = (logits if temperature == 1.0 else logits / temperature).log_softmax(-1)
    picked = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    return picked, (-(log_probs.exp() * log_probs).sum(-1)).detach() if compute_entropy else None


def scored_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                     score_mask: torch.Tensor | None) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """(sequences, scored, prompt lengths) of a TRL batch (`grouped_logps`' arguments): each row's unpadded
    prompt and its completion up to its last position to score (empty if it has none), the positions of that
    sequence to score (bool), and the prompt's length."""
    width = input_ids.shape[1] - logits_to_keep
    p_mask, c_mask = attention_mask[:, :width].bool(), attention_mask[:, width:]
    score = (c_mask if score_mask is None else score_mask * c_mask).bool()
    plens = p_mask.sum(-1).tolist()
    if any(n == 0 and bool(score[i].any()) for i, n in enumerate(plens)):
        raise ValueError("a row with tokens to score has an empty prompt: its first token has nothing to predict it")
    seqs, scored = [], []
    for i in range(input_ids.shape[0]):
        cols = score[i].nonzero().flatten()
        end = int(cols[-1]) + 1 if len(cols) else 0
        seqs.append(torch.cat([input_ids[i, :width][p_mask[i]], input_ids[i, width:width + end]]) if end else
                    input_ids.new_zeros(0))
        scored.append(torch.cat([score.new_zeros(plens[i]), score[i, :end]]) if end else score.new_zeros(0))
    return seqs, scored, plens


def work_units(spans: Sequence[Span]) -> list[list[int]]:
    """The decoder calls of a pass, in an order where every span's parent comes first: a shared span alone
    (batch 1), the rows' own parts in padded batches of siblings (`leaf_batches`)."""
    batch_of = {j: batch for batch in leaf_batches(spans, CALL_COST_TOKENS) for j in batch}
    return [batch_of.get(j, [j]) for j in range(len(spans)) if j not in batch_of or batch_of[j][0] == j]


def require_cache(cache: DynamicCache, length: int) -> None:
    """Raise unless the decoder kept `length` positions of keys and values in `cache`: the spans after a shared
    stretch continue from them, and without them would attend to nothing."""
    if cache.get_seq_length() != length:
        raise RuntimeError(f"the decoder kept {cache.get_seq_length()} keys and values of {length}: the shared-prompt "
                           "pass needs its cache (activation checkpointing turns it off)")


class SharedPrefix:
    """The tokens every row of an iteration starts with (the system turn and tool list), computed once for all of
    the iteration's loss passes instead of once per pass.

    The first pass that needs it runs the prefix (batch 1, with gradient unless `grad` is False) and keeps that
    graph; the passes attend to detached copies of its keys and values (and of its last hidden state), which
    collect the gradient every pass sends back, in fp32 whatever the model's dtype (the sum over passes that
    the LoRA weights' fp32 gradients would otherwise hold). `backward()`, once after the last pass and before the
    optimizer step, carries that sum into the weights: the same gradient as computing the prefix in every pass,
    since the gradient through a shared stretch is the sum over the rows that attend to it. `uses` counts the
    passes that continued from it since it was last spent."""

    def __init__(self, tokens: Sequence[int], grad: bool = True) -> None:
        self.tokens = list(tokens)
        self.grad = grad
        self.cache: DynamicCache | None = None
        self.last: torch.Tensor | None = None
        self.uses = 0
        self._decoder: int | None = None
        self._graph: list[torch.Tensor] = []
        self._leaves: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def fits(self, seqs: Sequence[Sequence[int]], first_scored: Sequence[int], decoder: Any = None) -> bool:
        """Whether every sequence (token lists) starts with the prefix and scores no position inside it (a position
        scored at the prefix's last token would need that token's hidden state, which this keeps; inside, nothing
        is), and, once computed, whether `decoder` is the one it was computed by."""
        n = len(self.tokens)
        if n == 0 or (self.cache is not None and decoder is not None and id(decoder) != self._decoder):
            return False
        return all(s[:n] == self.tokens and f >= n for s, f in zip(seqs, first_scored) if len(s))

    def ensure(self, decoder: Any, device: torch.device) -> None:
        """Run the prefix once (the first pass of the iteration that uses it)."""
        if self.cache is not None:
            return
        ids = torch.tensor([self.tokens], device=device)
        cache = DynamicCache()
        with nullcontext() if self.grad else torch.no_grad():
            hidden = decoder(input_ids=ids, position_ids=torch.arange(len(self.tokens), device=device)[None],
                             past_key_values=cache, use_cache=True).last_hidden_state[:, -1:]
        require_cache(cache, len(self.tokens))
        self.cache, self._decoder = DynamicCache(), id(decoder)

        def leaf(t: torch.Tensor) -> torch.Tensor:
            # fp32 leaves collect the passes' gradients; the cast back to the model's dtype is built once. A tensor
            # the trainable weights do not reach (layer 0's keys with LoRA on q and v only) gets no gradient.
            held = t.detach().float().requires_grad_(t.requires_grad)
            self._graph.append(t)
            self._leaves.append(held)
            return held.to(t.dtype)

        for idx, layer in enumerate(cache.layers):
            self.cache.update(leaf(layer.keys), leaf(layer.values), idx)
        self.last = leaf(hidden)

    def backward(self) -> None:
        """Carry the gradient the passes sent to the prefix's keys, values and last hidden state into the weights
        (nothing when no pass used it or it runs without gradient); the prefix is spent afterwards."""
        pairs = [(t, leaf.grad.to(t.dtype)) for t, leaf in zip(self._graph, self._leaves) if leaf.grad is not None]
        if self.grad and pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self.cache, self.last, self.uses, self._decoder, self._graph, self._leaves = None, None, 0, None, [], []


def grouped_logps(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    score_mask: torch.Tensor | None = None,
    compute_entropy: bool = False,
    share_completions: bool = True,
    temperature: float = 1.0,
    prompt_grad: bool = True,
    prefix: SharedPrefix | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropies), each (rows, logits_to_keep), of the completion tokens.

    `input_ids` rows are [left-padded prompt | right-padded completion] as TRL builds them;
    `score_mask` (rows, logits_to_keep) marks the positions to score (default: the completion's
    attention mask); other positions are 0. Every stretch several rows start with runs once
    (`shared_spans`); without `share_completions` only prompt tokens are shared and each row's whole
    completion is its own part (a group's episodes usually share their first tool call and its result).
    `temperature` divides the logits before the softmax, as TRL's own pass does, so that the gradient is that
    of the distribution the rollouts were sampled from.

    Without `prompt_grad`, each row's prompt but its last token (which predicts the first completion token)
    runs without gradient: the completions attend to its keys and values as constants. The log-probs are the
    same; the gradient leaves out how the adapter changes the prompt's encoding (`train.prompt_grad`).

    With a `prefix` that every row starts with (`SharedPrefix.fits`), the prefix's tokens are not run here: the
    pass continues from its keys and values, computed once per iteration, whose gradient `SharedPrefix.backward`
    carries into the weights after the last pass.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    decoder, head = decoder_and_head(model)
    logps = torch.zeros(input_ids.shape[0], logits_to_keep, dtype=torch.float32, device=input_ids.device)
    entropies = torch.zeros_like(logps) if compute_entropy else None
    seqs, scored, plens = scored_sequences(input_ids, attention_mask, logits_to_keep, score_mask)
    breaks = None if prompt_grad else prompt_breaks(plens)
    token_lists = [s.tolist() for s in seqs]
    spans = shared_spans(token_lists, None if share_completions else plens, breaks)
    if not spans:
        return logps, entropies
    units = work_units(spans)
    parents = {span.parent for span in spans}
    caches: dict[int, DynamicCache] = {}
    last: dict[int, torch.Tensor] = {}  # a shared span's last hidden state: it predicts its children's first token
    if prefix is not None:
        first_scored = [int(sc.nonzero()[0]) if bool(sc.any()) else len(sc) for sc in scored]
        rows = [r for r in range(len(seqs)) if len(seqs[r])]
        root = spans[0]
        # the prefix tree's first span holds every row and covers the prefix: the prefix stands in for its start
        if not (prefix.fits(token_lists, first_scored, decoder) and root.parent == -1 and list(root.rows) == rows
                and root.end >= len(prefix)):
            prefix = None
    at_rows, at_cols, values, ents = [], [], [], []
    with low_precision(model):
        if prefix is not None:
            prefix.ensure(decoder, input_ids.device)
            prefix.uses += 1
            caches[-2], last[-2] = prefix.cache, prefix.last
        for unit in units:
            members = [spans[j] for j in unit]
            start, parent, b = members[0].start, members[0].parent, len(unit)
            if prefix is not None and unit == [0]:
                if root.end == len(prefix):  # the root is the prefix: its children continue from it
                    caches[0], last[0] = prefix.cache, prefix.last
                    continue
                start, parent = len(prefix), -2
                members = [Span(root.rows, start, root.end, parent)]
            lens = [m.end - start for m in members]
            width_u = max(lens)
            ids = input_ids.new_zeros(b, width_u)
            for i, m in enumerate(members):
                ids[i, :lens[i]] = seqs[m.rows[0]][start:m.end]
            valid = torch.arange(width_u, device=ids.device)[None] < torch.tensor(lens, device=ids.device)[:, None]
            mask = None if min(lens) == width_u else torch.cat([valid.new_ones(b, start), valid], dim=1).long()
            cache = expand_cache(caches[parent], b) if parent != -1 else DynamicCache()  # -2: the prefix
            positions = torch.arange(start, start + width_u, device=ids.device)[None].expand(b, -1)
            context = breaks is not None and all(before_breaks(m, breaks) for m in members)
            with torch.no_grad() if context else nullcontext():
                hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                                 use_cache=True).last_hidden_state
            if b == 1 and unit[0] in parents:  # the spans after this one continue from it
                require_cache(cache, members[0].end)
                caches[unit[0]], last[unit[0]] = cache, hidden[:, -1:]
            # the hidden state before token t predicts it; a span's first token, its parent's last one (a
            # sequence's first token is a prompt token, never scored)
            first = last[parent].expand(b, -1, -1) if parent != -1 else hidden[:, :1]
            before = torch.cat([first, hidden[:, :-1]], dim=1)
            wanted = [[torch.nn.functional.pad(scored[r][start:m.end], (0, width_u - lens[i])) for r in m.rows]
                      for i, m in enumerate(members)]
            any_row = torch.stack([torch.stack(w).any(0) for w in wanted])  # (b, width_u)
            if not bool(any_row.any()):
                continue
            picked, ent = _scored_logps(head, before[any_row], ids[any_row], compute_entropy, temperature)
            slot = (any_row.flatten().long().cumsum(0) - 1).view(b, width_u)
            for i, m in enumerate(members):
                for r, want in zip(m.rows, wanted[i]):
                    pos = want.nonzero().flatten()
                    at_rows.append(torch.full_like(pos, r))
                    at_cols.append(pos + start - plens[r])
                    values.append(picked[slot[i, pos]])
                    if ent is not None:
                        ents.append(ent[slot[i, pos]])
    at = (torch.cat(at_rows), torch.cat(at_cols))
    logps = logps.index_put(at, torch.cat(values))
    if entropies is not None:
        entropies = entropies.index_put(at, torch.cat(ents))
    return logps, entropies
