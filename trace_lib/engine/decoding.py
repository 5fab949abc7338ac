"""Batched, KV-cached decoding for `engine/policy.py`'s `Policy`: the prefill and decoding loop, and sampling.

Reads and writes nothing. `BatchDecoding` holds the loop `Policy.generate_ids` and `Policy.play_turns` run (shared
prefix, per-episode sessions, shared stems, prefill passes of similar rows, rows joining the decoding batch);
`sample_tokens` draws each row's token from its own generator; `shared_stems`, `prefill_cost` and
`prefill_passes` plan the prefill. What each of these buys is in `engine/policy.py`'s module docstring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import DynamicCache

from trace_lib.engine.adapters import canonical_weights, route_label
from trace_lib.engine.chat import row_seed
from trace_lib.engine.sampling import row_generators, sample_tokens
from trace_lib.engine.kvcache import RowRoutes, append_rows, new_cache, row_routes, select_rows
from trace_lib.engine.threads import govern_threads


MIN_PREFIX_TOKENS = 16
"""Shorter shared prefixes are not worth a separate forward pass."""
MIN_STEM_SAVING = 16
"""A shared stem is computed separately only when it saves at least this many token-forwards."""
MAX_STEM_TAIL = 8
"""Longest part of a row's prompt after its shared stem (see `shared_stems`)."""
JOIN_SHARE = 0.25
"""Continuous batching (`Policy.play_turns`): rows whose next turn is ready join the decoding batch once
they are at least this share of the rows decoding (each join copies the batch's KV buffers once)."""
MAX_SESSIONS = 256
"""Episodes whose KV states are kept between turns (~23 KB per token each for SmolLM2-135M in bf16)."""
PASS_OVERHEAD_TOKENS = 32
"""Fixed cost of one prefill pass (30 layers' operator dispatch), in token-forwards (see `prefill_cost`)."""
KEYS_PER_TOKEN = 750
"""Query-key pairs of prefill attention that cost as much as one token-forward of the rest of the model (from
the rollout stage's prefill passes on 2 cores, bf16, SmolLM2-135M: docs/archive/2026-11.md)."""


class NextTurn(NamedTuple):
    """A row's next turn in `Policy.play_turns`."""

    prompt: list[int]
    require_tool_call: bool = False
    session: Hashable | None = None
    """A new session key: the row starts another episode (the caller ends the old one's session)."""
    route: int | None = None
    """With `session`, in a `play_turns` call with `routes`: the new episode's route (an index into them)."""


@dataclass
class TurnRun:
    """The state of one `play_turns` call that outlives its batches."""

    prompts: list[list[int]]
    keys: list[Hashable]
    next_turn: Callable[[int, list[int], str], Any]
    seed: int
    processor: Any
    turns: int = 0
    """Turns started so far: the next one draws from row_seed(seed, turns)."""
    route_of: list[int] | None = None
    """Per row, the index of the route it runs under (`play_turns` with `routes`); None: the policy's adapter."""
    labels: list[str | None] | None = None
    """Per route, its name in session heads and prefix keys (None, an adapter, or a merge label)."""
    temperatures: list[float] | None = None
    """Per route, the temperature its rows sample at (`play_turns` with a temperature per route)."""
    prefill_seconds: float = 0.0
    callback_seconds: float = 0.0
    """Spent in `next_turn` (the caller's environments), neither prefill nor decoding."""


class BatchDecoding:
    """The decoding loop behind `Policy.generate_ids` and `Policy.play_turns`: prefill (shared prefix, sessions,
    shared stems, passes of similar rows), decoding steps with rows leaving and joining, and the KV states kept.

    A mixin of `Policy` (it reads the model, the caches and the stats the policy holds); one job, the batched
    KV-cached decoding loop, which is why it is long (see the module docstring of `engine/policy.py`)."""

    def _join(self, run: TurnRun, joining: list[tuple[int, bool | None]], prefix_len, prefix_kv, cascade,
              prefix_ids, max_new_tokens):
        """Prefill the joining rows' turns: (logits, cache, mask, their generators); counts their prompts."""
        t1 = time.perf_counter()
        rows = [r for r, _ in joining]
        new_prompts = [run.prompts[r] for r in rows]
        logits, cache, mask, cached = self._start_rows(
            new_prompts, prefix_len, prefix_kv, cascade, [self._head(run, r, prefix_ids) for r in rows],
            [run.keys[r] for r in rows], max_new_tokens, None if run.route_of is None else [run.route_of[r] for r in rows])
        self.stats.sequences += len(rows)
        self.stats.prompt_tokens += sum(len(p) for p in new_prompts)
        self.stats.cached_prompt_tokens += cached
        gens = [torch.Generator(device=mask.device).manual_seed(row_seed(run.seed, run.turns + k))
                for k in range(len(rows))]
        run.turns += len(rows)
        if run.processor is not None and any(flag is not None for _, flag in joining):
            run.processor.add_rows([bool(flag) for _, flag in joining])
        run.prefill_seconds += time.perf_counter() - t1
        return logits, cache, mask, gens

    def _decode_turns(self, run: TurnRun, starting, prefix_len, prefix_kv, cascade, temperature, top_p,
                      max_new_tokens) -> list[tuple[int, bool]]:
        """One batch of `play_turns` under one shared prefix; returns the turns that need another prefix."""
        prefix_ids = tuple(run.prompts[starting[0][0]][:prefix_len])
        if run.processor is not None and starting[0][1] is not None:  # a later batch: its rows start afresh
            run.processor.clear_rows()
        logits, cache, mask, gens = self._join(run, starting, prefix_len, prefix_kv, cascade, prefix_ids,
                                               max_new_tokens)
        rows = [r for r, _ in starting]  # batch position -> row
        outs: dict[int, list[int]] = {r: [] for r in rows}
        waiting: list[tuple[int, bool]] = []  # rows whose next turn is ready, and its tool-call flag
        deferred: list[tuple[int, bool]] = []  # ... whose prompt does not start with this batch's prefix
        positions = mask.sum(dim=-1)
        stop = torch.tensor(self.stop_ids, device=mask.device)
        generated = torch.empty(len(rows), 0, dtype=torch.long, device=mask.device)
        routes = self._row_routes(run, rows, mask.device)
        while rows:
            if run.processor is not None:
                logits = run.processor(generated, logits)
            temps = temperature if run.temperatures is None else torch.tensor(
                [run.temperatures[run.route_of[r]] for r in rows])
            tok = sample_tokens(logits, temps, top_p, gens)
            generated = torch.cat([generated, tok[:, None]], dim=1)
            stopped = torch.isin(tok, stop).tolist()
            ended = []
            for j, (r, t) in enumerate(zip(rows, tok.tolist())):
                outs[r].append(t)
                if stopped[j] or len(outs[r]) >= max_new_tokens:
                    ended.append(j)
            for j in ended:
                r = rows[j]
                self._keep(run.keys[r], self._head(run, r, prefix_ids), run.prompts[r], prefix_len, outs[r][:-1],
                           cache, mask, j)
                self.stats.completion_tokens += len(outs[r])
                c0 = time.perf_counter()
                nxt = run.next_turn(r, outs.pop(r), "stop" if stopped[j] else "length")
                run.callback_seconds += time.perf_counter() - c0
                if nxt is None:
                    continue
                nxt = NextTurn(*nxt)
                run.prompts[r] = list(nxt.prompt)
                if nxt.session is not None:
                    run.keys[r] = nxt.session
                if nxt.route is not None:
                    if run.route_of is None:
                        raise ValueError(f"NextTurn.route {nxt.route!r} without routes: pass play_turns routes= "
                                         "and row_routes=")
                    if nxt.session is None:
                        raise ValueError(f"NextTurn.route {nxt.route!r} without a new session: a route changes "
                                         "only with a new episode")
                    if not 0 <= nxt.route < len(run.labels):
                        raise ValueError(f"NextTurn.route {nxt.route!r} is not an index into the "
                                         f"{len(run.labels)} routes")
                    run.route_of[r] = nxt.route
                fits = len(nxt.prompt) > prefix_len and tuple(nxt.prompt[:prefix_len]) == prefix_ids
                (waiting if fits else deferred).append((r, nxt.require_tool_call))
            if ended:
                gone = set(ended)
                keep = [j for j in range(len(rows)) if j not in gone]
                index = torch.tensor(keep, dtype=torch.long, device=mask.device)
                rows, gens = [rows[j] for j in keep], [gens[j] for j in keep]
                tok, positions, generated = tok[index], positions[index], generated[index]
                if run.processor is not None:
                    run.processor.select_rows(keep)
                if rows:
                    mask = select_rows(cache, mask, index, prefix_len if cascade else 0)
                routes = self._row_routes(run, rows, mask.device)
            if rows:
                logits, mask, positions = self._step(tok, mask, positions, cache, cascade, routes)
            if waiting and (not rows or len(waiting) >= JOIN_SHARE * len(rows)):
                new_logits, new_cache_, new_mask, new_gens = self._join(run, waiting, prefix_len, prefix_kv, cascade,
                                                                        prefix_ids, max_new_tokens)
                if rows:
                    cache, mask = append_rows(cache, mask, new_cache_, new_mask, max_new_tokens, prefix_len)
                    logits = torch.cat([logits, new_logits])
                    positions = torch.cat([positions, new_mask.sum(dim=-1)])
                else:  # every row was waiting: the joining rows are the batch
                    cache, mask, logits, positions = new_cache_, new_mask, new_logits, new_mask.sum(dim=-1)
                # the columns before a row joined hold -1, which the processor skips
                generated = torch.cat([generated, generated.new_full((len(waiting), generated.shape[1]), -1)])
                gens += new_gens
                rows += [r for r, _ in waiting]
                outs.update({r: [] for r, _ in waiting})
                waiting = []
                routes = self._row_routes(run, rows, mask.device)
        return deferred

    def _reusable(self, prompts: list[list[int]], prefix_len: int, sessions: Sequence[Hashable] | None,
                  heads: Sequence[tuple[str | None, tuple[int, ...]]]) -> list[Session | None]:
        """Per row, the kept session whose tokens the prompt repeats (at least one token left to compute),
        computed under the row's head (its adapter or route, and the shared prefix)."""
        if sessions is None:
            return [None] * len(prompts)
        out: list[Session | None] = []
        for key, prompt, head in zip(sessions, prompts, heads):
            kept = self._sessions.get(key)
            if kept is None or kept.head != head:
                out.append(None)
                continue
            n = _common_prefix(kept.ids, prompt[prefix_len:], len(prompt) - prefix_len - 1)
            out.append(kept.cut(n) if n else None)
        return out

    def _keep(self, key: Hashable, head: tuple[str | None, tuple[int, ...]], prompt: list[int], prefix_len: int,
              fed: list[int], cache: Any, mask: torch.Tensor, j: int) -> None:
        """Store row j's KV states after the shared prefix (its valid positions) under `key`."""
        self._sessions.pop(key, None)
        self._sessions[key] = _row_session(head, prompt[prefix_len:] + fed, cache, mask, j, prefix_len)
        while len(self._sessions) > MAX_SESSIONS:  # the oldest first
            self._sessions.pop(next(iter(self._sessions)))

    def _with_stems(self, prompts, prefix_len, prefix_kv, cascade, heads, reused, routes=None):
        """`reused` extended by shared stems (see `shared_stems`), and the stem tokens computed for them.

        Each stem is the common stretch of its rows' prompts after the most their members have
        cached; it is prefilled once (from the base row's own session) and each member row then
        reuses it like a kept session. The KV states of a position depend only on the tokens up to
        it, so this is the computation each row would have done.

        The other rows compute all but their last token here too, so that the final pass is as
        narrow as the stems' tails. These passes are not one padded batch: a pass costs every row
        the widest row's new tokens times its longest history (padding), so rows are split into
        passes of similar shapes (`prefill_passes`). Without stems, rows do this only where it is
        cheaper than one padded pass over whole suffixes (`prefill_cost`).

        Rows share a stem only with rows of the same head (`heads`: adapter or route, and prefix); `routes`
        (per row, an index into `play_turns`' routes) are the rows' routes in a mixed-route batch.
        """
        n = len(prompts)
        kept = [0 if r is None else len(r.ids) for r in reused]
        stems: list[tuple[list[int], int]] = []
        for members in _same_head(heads):
            found = shared_stems([prompts[i] for i in members], [prefix_len + kept[i] for i in members])
            stems += [([members[j] for j in rows], end) for rows, end in found]
        shared = bool(stems)
        grouped = {i for rows, _ in stems for i in rows}
        stems += [([i], len(p) - 1) for i, p in enumerate(prompts)
                  if i not in grouped and len(p) - 1 > prefix_len + kept[i]]
        if not stems:
            return reused, 0
        bases = [max(rows, key=lambda i: kept[i]) for rows, _ in stems]
        widths = [end - prefix_len - kept[b] for b, (_, end) in zip(bases, stems)]
        held = [kept[b] for b in bases]
        passes = prefill_passes(widths, held, prefix_len)
        if not shared:
            one_pass = prefill_cost([len(p) - prefix_len - k for p, k in zip(prompts, kept)], kept, prefix_len)
            split = sum(prefill_cost([widths[j] for j in part], [held[j] for j in part], prefix_len)
                        for part in passes)
            split += prefill_cost([1] * n, [len(p) - 1 - prefix_len for p in prompts], prefix_len)
            if one_pass <= split:
                return reused, 0
        out = list(reused)
        for part in passes:
            stem_prompts = [prompts[bases[j]][: stems[j][1]] for j in part]
            _, cache, mask = self._prefill(stem_prompts, prefix_len, prefix_kv, 0, cascade,
                                           [reused[bases[j]] for j in part],
                                           None if routes is None else [routes[bases[j]] for j in part])
            for slot, j in enumerate(part):
                session = _row_session(heads[bases[j]], stem_prompts[slot][prefix_len:], cache, mask, slot,
                                       prefix_len)
                for i in stems[j][0]:
                    out[i] = session
        return out, sum(widths)

    def _decode(self, prompts, prefix_len, prefix_kv, cascade, temperature, top_p, max_new_tokens, seed,
                processor, t0, sessions=None):
        head = (self.adapter, tuple(prompts[0][:prefix_len]))  # what kept sessions must have been computed under
        logits, cache, mask, cached = self._start_rows(prompts, prefix_len, prefix_kv, cascade, [head] * len(prompts),
                                                       sessions, max_new_tokens)
        t1 = time.perf_counter()

        n = len(prompts)
        rows = list(range(n))  # batch position -> original row
        gens = row_generators(seed, n, mask.device)
        outs: list[list[int]] = [[] for _ in range(n)]
        finish = ["length"] * n
        positions = mask.sum(dim=-1)  # next position id of each row
        stop = torch.tensor(self.stop_ids, device=mask.device)
        generated = torch.empty(n, 0, dtype=torch.long, device=mask.device)
        for step in range(max_new_tokens):
            if processor is not None:
                logits = processor(generated, logits)
            tok = sample_tokens(logits, temperature, top_p, gens)
            generated = torch.cat([generated, tok[:, None]], dim=1)
            done = torch.isin(tok, stop)
            for r, t, d in zip(rows, tok.tolist(), done.tolist()):  # one transfer per step off an accelerator
                outs[r].append(t)
                if d:
                    finish[r] = "stop"
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            if bool(done.any()):
                if sessions is not None:
                    for j in done.nonzero().flatten().tolist():
                        self._keep(sessions[rows[j]], head, prompts[rows[j]], prefix_len, outs[rows[j]][:-1],
                                   cache, mask, j)
                keep = (~done).nonzero().flatten()
                rows = [rows[j] for j in keep.tolist()]
                gens = [gens[j] for j in keep.tolist()]
                tok, positions, generated = tok[keep], positions[keep], generated[keep]
                mask = select_rows(cache, mask, keep, prefix_len if cascade else 0)
                if processor is not None:
                    processor.select_rows(keep.tolist())
            logits, mask, positions = self._step(tok, mask, positions, cache, cascade)
        if sessions is not None:
            for j, r in enumerate(rows):
                self._keep(sessions[r], head, prompts[r], prefix_len, outs[r][:-1], cache, mask, j)
        t2 = time.perf_counter()
        self.stats.calls += 1
        self.stats.sequences += n
        self.stats.prompt_tokens += sum(len(p) for p in prompts)
        self.stats.cached_prompt_tokens += cached
        self.stats.completion_tokens += sum(len(o) for o in outs)
        self.stats.prefill_seconds += t1 - t0
        self.stats.decode_seconds += t2 - t1
        return outs, finish

    def _step(self, tok, mask, positions, cache, cascade, routes: RowRoutes | None = None):
        """Feed each row its sampled token: (the next logits, the mask and position ids one position on).
        `routes`: the rows' routes in a mixed-route batch."""
        mask = torch.cat([mask, mask.new_ones(len(tok), 1)], dim=1)
        govern_threads()
        with row_routes(routes):
            out = self.model(
                input_ids=tok[:, None], attention_mask=mask[:, None, None, :].bool() if cascade else mask,
                position_ids=positions[:, None], past_key_values=cache, use_cache=True,
            )
        return out.logits[:, -1, :].float(), mask, positions + 1

    def _start_rows(self, prompts, prefix_len, prefix_kv, cascade, heads, sessions, max_new_tokens, routes=None):
        """Prefill rows from their kept sessions and shared stems: (last-token logits, cache, mask, prompt
        tokens not computed). `heads`: per row, what its kept sessions must have been computed under."""
        reused = self._reusable(prompts, prefix_len, sessions, heads)
        reused, stem_tokens = self._with_stems(prompts, prefix_len, prefix_kv, cascade, heads, reused, routes)
        logits, cache, mask = self._prefill(prompts, prefix_len, prefix_kv, max_new_tokens, cascade, reused, routes)
        reused_tokens = sum(len(r.ids) for r in reused if r is not None)
        return logits, cache, mask, prefix_len * len(prompts) + reused_tokens - stem_tokens

    def _prefixes_for(self, prompts: list[list[int]], run: TurnRun
                      ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """`_prefix_for` under the policy's adapter; with routes, the same prefix under every route, its K/V
        stacked per layer (routes, kv_heads, P, dim) for `cascade_attention`."""
        if run.route_of is None:
            return self._prefix_for(prompts, self.adapter)
        keep = len(run.labels) + 4  # every route's prefix, and a few other environments' or adapters'
        with row_routes(RowRoutes([0], self.device)):  # the first route finds the prefix's length
            prefix_len, kv = self._prefix_for(prompts, run.labels[0], keep)
        if kv is None:
            return 0, None
        ids, kvs = tuple(prompts[0][:prefix_len]), [kv]
        for k, label in enumerate(run.labels[1:], start=1):
            with row_routes(RowRoutes([k], self.device)):
                kvs.append(self._prefix_kv(ids, label, keep))
        if len(kvs) == 1:
            return prefix_len, kvs[0]
        return prefix_len, [(torch.cat([kv[i][0] for kv in kvs]), torch.cat([kv[i][1] for kv in kvs]))
                            for i in range(len(kvs[0]))]

    def _prefix_for(self, prompts: list[list[int]], label: str | None, keep: int = 4
                    ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """The shared prefix (length, per-layer K/V of batch 1) computed under `label` (the adapter or route the
        model runs now), reused across calls when it matches; at most `keep` prefixes are kept."""
        shortest = min(len(p) for p in prompts)
        for (adapter, ids), kv in self._prefixes.items():
            if adapter == label and len(ids) < shortest and all(tuple(p[: len(ids)]) == ids for p in prompts):
                return len(ids), kv
        # New prefix: the common tokens, cut after the first turn so it stays stable across turns,
        # and leaving every row at least one token to compute logits from.
        first = prompts[0]
        lcp = min(_common_prefix(first, p, shortest - 1) for p in prompts)
        if self._turn_end_id in first[:lcp]:
            lcp = min(lcp, first.index(self._turn_end_id) + 1)
        if lcp < MIN_PREFIX_TOKENS:
            return 0, None
        return lcp, self._prefix_kv(tuple(first[:lcp]), label, keep)

    def _prefix_kv(self, ids: tuple[int, ...], label: str | None, keep: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The per-layer K/V of the prefix `ids` under `label` (kept; computed by the model as it runs now)."""
        if (label, ids) in self._prefixes:
            return self._prefixes[(label, ids)]
        cache = DynamicCache()
        self.model(input_ids=torch.tensor([ids], device=self.device), past_key_values=cache, use_cache=True,
                   logits_to_keep=1)
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        while len(self._prefixes) >= keep:  # a handful of environments/adapters at a time
            self._prefixes.pop(next(iter(self._prefixes)))
        self._prefixes[(label, ids)] = kv
        return kv

    def _prefill(self, prompts, prefix_len, prefix_kv, max_new_tokens, cascade=False, reused=None, routes=None):
        """Run the prompts' uncached parts; returns last-token logits, the cache and the 2D mask.

        Row layout along the sequence: [shared prefix | pad, reused session KV | pad, new tokens];
        the mask is zero on the pads and position ids come from its cumsum. `routes`: per row, its route in
        a mixed-route batch (the prefix K/V then one per route).
        """
        n = len(prompts)
        reused = reused or [None] * n
        kept = [0 if r is None else len(r.ids) for r in reused]
        suffixes = [p[prefix_len + k:] for p, k in zip(prompts, kept)]
        width, held = max(len(s) for s in suffixes), max(kept)
        start = prefix_len + held  # first column of the new tokens' block
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(n, start + width, dtype=torch.long)
        mask[:, :prefix_len] = 1
        for i, (s, k) in enumerate(zip(suffixes, kept)):
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, start - k:start] = 1
            mask[i, start + width - len(s):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)  # built on the CPU, sent once
        rows = None if routes is None else RowRoutes(list(routes), mask.device)
        if cascade:  # the prefix stays shared (kvcache.cascade_attention), rows hold their suffix only
            cache = new_cache(self.model, held + width + max_new_tokens, offset=prefix_len)
        else:
            cache = new_cache(self.model, start + width + max_new_tokens)
        if prefix_kv is not None and not cascade:
            for layer_idx, (k, v) in enumerate(prefix_kv):
                if k.shape[0] > 1:  # one prefix per route: each row gets its route's
                    cache.update(k.index_select(0, rows.index), v.index_select(0, rows.index), layer_idx)
                else:
                    cache.update(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1), layer_idx)
        if held:
            for layer_idx, (k0, v0) in enumerate(next(r for r in reused if r is not None).kv):
                ks = k0.new_zeros(n, k0.shape[0], held, k0.shape[-1])
                vs = v0.new_zeros(n, v0.shape[0], held, v0.shape[-1])
                for i, r in enumerate(reused):
                    if r is not None:
                        ks[i, :, held - kept[i]:] = r.kv[layer_idx][0]
                        vs[i, :, held - kept[i]:] = r.kv[layer_idx][1]
                cache.update(ks, vs, layer_idx)
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)[:, start:]
        with row_routes(rows):
            out = self.model(
                input_ids=ids, attention_mask=_causal_4d(mask, start) if cascade else mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=1,
            )
        return out.logits[:, -1, :].float(), cache, mask


@dataclass
class Session:
    """An episode's KV states after the shared prefix, kept between its turns."""

    head: tuple[str | None, tuple[int, ...]]
    """(adapter, shared prefix tokens) they were computed under."""
    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer (kv_heads, len(ids), dim) keys and values."""

    def cut(self, n: int) -> Session:
        return Session(self.head, self.ids[:n], [(k[:, :n], v[:, :n]) for k, v in self.kv])


def route_labels(routes: Sequence[Mapping[str, float]]) -> list[str | None]:
    """Each route's name in session heads and prefix keys: `route_label`, made unique where two different
    weightings share one (a merge label keeps 6 significant digits)."""
    labels: list[str | None] = []
    for k, r in enumerate(routes):
        label = route_label(r)
        clash = any(label == route_label(other) and canonical_weights(other) != canonical_weights(r)
                    for other in routes[:k])
        labels.append(f"{label}#{k}" if clash else label)
    return labels


def _same_head(heads: Sequence[Hashable]) -> list[list[int]]:
    """Row indices grouped by equal head, groups in order of their first row."""
    groups: dict[Hashable, list[int]] = {}
    for i, h in enumerate(heads):
        groups.setdefault(h, []).append(i)
    return list(groups.values())


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common start of `a` and `b`, at most `limit`."""
    n = min(len(a), len(b), max(0, limit))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_stems(prompts: Sequence[Sequence[int]], starts: Sequence[int],
                 max_tail: int | None = None) -> list[tuple[list[int], int]]:
    """Groups of rows worth computing a common stretch of their prompts once: (rows, end).

    Row i still has to compute its prompt from `starts[i]` on. A group's rows share their first
    `end` tokens; computing positions max(start)..end once instead of every row's start..end
    saves sum(end - start_i) - (end - max start) token-forwards, and a group is kept when that is at
    least MIN_STEM_SAVING. Every row keeps at least its last token to compute, and at most
    `max_tail` (default MAX_STEM_TAIL): the tails are computed in a second pass padded to its
    widest row, where one long tail would make every row pay for its width (a long tail can make the second
    pass cost more than the stems save). Rows are grouped greedily in sorted
    order (where rows with long common prefixes are neighbours).
    """
    max_tail = MAX_STEM_TAIL if max_tail is None else max_tail
    def saving(rows: list[int], end: int) -> int:
        return sum(max(0, end - starts[i]) for i in rows) - max(0, end - max(starts[i] for i in rows))

    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    groups: list[tuple[list[int], int]] = []
    rows: list[int] = []
    end = 0
    for i in order:
        if rows:
            common = _common_prefix(prompts[rows[-1]], prompts[i], min(end, len(prompts[i]) - 1))
            if (common > max(starts[r] for r in [*rows, i]) and saving([*rows, i], common) > saving(rows, end)
                    and all(len(prompts[r]) - common <= max_tail for r in [*rows, i])):
                rows, end = [*rows, i], common
                continue
            groups.append((rows, end))
        rows, end = [i], len(prompts[i]) - 1
    groups.append((rows, end))
    return [(sorted(g), e) for g, e in groups if len(g) > 1 and saving(g, e) >= MIN_STEM_SAVING]


def prefill_cost(widths: Sequence[int], held: Sequence[int], prefix_len: int) -> float:
    """Estimated cost of one padded prefill pass over these rows, in token-forwards.

    Every row is padded to the widest row's new tokens, and each new token attends to the shared
    prefix and to the longest history held by any row (masked, but computed):
    `PASS_OVERHEAD_TOKENS + rows x width x (1 + (prefix + history + width) / KEYS_PER_TOKEN)`.
    """
    if not widths:
        return 0.0
    w, h = max(widths), max(held)
    return PASS_OVERHEAD_TOKENS + len(widths) * w * (1 + (prefix_len + h + w) / KEYS_PER_TOKEN)


def prefill_passes(widths: Sequence[int], held: Sequence[int], prefix_len: int) -> list[list[int]]:
    """Rows (`widths[i]` new tokens after `held[i]` cached ones) split into prefill passes.

    Greedy, widest rows first: a row joins the current pass when padding it there costs less
    than a pass of its own (`prefill_cost`). A long tool result then gets a pass to itself
    instead of making every row of the batch pay for its width and history.
    """
    passes: list[list[int]] = []
    for i in sorted(range(len(widths)), key=lambda i: (-widths[i], -held[i], i)):
        if passes:
            cur = passes[-1]
            joined = prefill_cost([widths[j] for j in [*cur, i]], [held[j] for j in [*cur, i]], prefix_len)
            apart = (prefill_cost([widths[j] for j in cur], [held[j] for j in cur], prefix_len)
                     + prefill_cost([widths[i]], [held[i]], prefix_len))
            if joined <= apart:
                cur.append(i)
                continue
        passes.append([i])
    return [sorted(p) for p in passes]


def _row_session(head: tuple[str | None, tuple[int, ...]], ids: list[int], cache: Any, mask: torch.Tensor, j: int,
                 prefix_len: int) -> Session:
    """Row j's KV states after the shared prefix (its valid positions), as a session over `ids`."""
    valid = mask[j, prefix_len:].bool()
    kv = []
    for layer in cache.layers:
        k, v = layer.keys[j], layer.values[j]  # (hkv, stored, d); stored positions end at the mask's end
        k, v = k[:, k.shape[1] - valid.numel():], v[:, v.shape[1] - valid.numel():]
        kv.append((k[:, valid], v[:, valid]))
    assert kv[0][0].shape[1] == len(ids), (kv[0][0].shape, len(ids))
    return Session(head, ids, kv)


def _causal_4d(mask: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """(batch, 1, query, key) boolean mask for the prefill of the positions after `prefix_len`.

    Built here rather than by transformers because the cascade attention needs it explicit
    (transformers does not build masks for custom attention functions reliably across versions).
    """
    total = mask.shape[1]
    q = torch.arange(prefix_len, total, device=mask.device)[:, None]
    causal = torch.arange(total, device=mask.device)[None, :] <= q
    return causal[None, None] & mask.bool()[:, None, None, :]
