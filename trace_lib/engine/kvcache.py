"""KV cache for batched agent turns: a preallocated per-row buffer and a shared prompt prefix.

Reads and writes nothing on disk; used by policy.py (the rollout engine behind the paper's
trajectory collection, §2, and the GRPO rollouts of §3.3).

Every episode of an environment opens with the same system turn (~1–3k tokens). Its keys and
values are computed once (batch 1) and never copied into the rows: each row's buffer holds only
its own suffix, and `cascade_attention` attends to the shared prefix with all rows' queries folded
into one matrix product, then to each row's suffix, and merges the two softmax parts exactly by
their log-sum-exp. That removes the per-row prefix from both memory and memory traffic, which is
what bounds decoding on a CPU once the prompt is long. Rows' own histories differ in length (one
episode's tool results can be thousands of tokens); a decoding step reads the late keys of all
rows together and a long row's early keys apart (`_ragged_matmul_attention`), not every row's
padding up to the longest.

The attention function is registered with transformers as `trace_cascade` (mask semantics of
`sdpa`); without a shared prefix set it is plain sdpa.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

CASCADE = "trace_cascade"
FILLED = "trace_filled"
"""Attribute of the keys a `BufferedLayer` returns as its whole buffer: the filled length."""
_SHARED: ContextVar[list[tuple[torch.Tensor, torch.Tensor]] | None] = ContextVar("trace_shared_prefix", default=None)


class RowRoutes:
    """Which route (index into a mixed batch's routes: base model, one adapter or a merge) each row of one
    forward runs under. Read by `cascade_attention` (each route's rows attend to that route's shared prefix)
    and by `engine.row_lora`'s LoRA layers (each row gets its route's low-rank delta)."""

    def __init__(self, routes: list[int], device: torch.device | str = "cpu") -> None:
        self.routes = list(routes)
        self.index = torch.tensor(self.routes, dtype=torch.long, device=device)
        members: dict[int, list[int]] = {}
        for i, g in enumerate(self.routes):
            members.setdefault(g, []).append(i)
        self.present = set(members)
        # The rows laid out route by route, each route padded to the largest route's rows (`width`; the pads
        # repeat the route's first row): `cascade_attention` computes every route's prefix part as one batched
        # product, route g's queries against route g's prefix.
        order = sorted(members)
        self.width = max((len(rows) for rows in members.values()), default=0)
        self.present_index = torch.tensor(order, dtype=torch.long, device=device)
        gather, slot = [], [0] * len(self.routes)
        for k, g in enumerate(order):
            rows = members[g]
            for j, i in enumerate(rows):
                slot[i] = k * self.width + j
            gather += rows + [rows[0]] * (self.width - len(rows))
        self.gather = torch.tensor(gather, dtype=torch.long, device=device)
        self.slot = torch.tensor(slot, dtype=torch.long, device=device)
        self.prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per layer, the shared prefixes of the routes present (picked once for these rows, not every step)."""
        self.memo: dict[Any, Any] = {}
        """Scratch the routed LoRA layers share while these rows run (`engine.row_lora`)."""


_ROWS: ContextVar[RowRoutes | None] = ContextVar("trace_row_routes", default=None)


def current_row_routes() -> RowRoutes | None:
    """The `RowRoutes` of the forward running now (set by `row_routes`), or None (one route for all rows)."""
    return _ROWS.get()


@contextmanager
def _set_within(var: ContextVar, value: Any) -> Iterator[None]:
    """`var` holds `value` inside the block, and what it held before after it (also on an exception)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def row_routes(routes: RowRoutes | None) -> AbstractContextManager[None]:
    """Context manager: the model calls inside run their rows under these routes (`RowRoutes`); None: no
    per-row routes."""
    return _set_within(_ROWS, routes)


class BufferedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in a preallocated buffer (views, no per-step cat).

    With `offset` > 0 the first `offset` positions are the shared prefix, held outside the layer;
    the layer stores (and returns) only the positions after it but reports the full length.

    Keys are stored transposed, (batch, heads, dim, capacity): the decode step's scores q @ K^T then
    read a plain strided slice; with keys stored (…, capacity, dim) the bf16 batched product over the sliced
    view takes a much slower path.

    With `offset` > 0 (the cascade attention) `update` returns the whole buffers, not the filled
    part: a bf16 product over a slice of a buffer (rows `capacity` apart) takes a slow path on the
    CPU, 2-3x the time of the same product over the contiguous buffer (`benchmarks/ragged_history.py`).
    The unused tail is zeros; the keys carry the filled length (attribute `FILLED`), from which
    `cascade_attention` masks the tail. `keys` and `values` stay the filled part.
    """

    def __init__(self, capacity: int, offset: int = 0) -> None:
        super().__init__()
        self.capacity = capacity
        self.offset = offset
        self._n = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self._kt = key_states.new_zeros(b, h, d, self.capacity)  # zeros: the unused tail is read (and masked)
        self._v = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])
        self._n = 0
        self._refresh()
        self.is_initialized = True

    def _refresh(self) -> None:
        self.keys, self.values = self._kt[..., : self._n].transpose(-1, -2), self._v[:, :, : self._n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self._n, key_states.shape[-2]
        if n + q > self._v.shape[-2]:  # grow geometrically; only hit when the caller underestimates
            cap = max(2 * self._v.shape[-2], n + q)
            kt, v = self._kt, self._v
            self._kt = kt.new_zeros(*kt.shape[:3], cap)
            self._v = v.new_zeros(*v.shape[:2], cap, v.shape[-1])
            self._kt[..., :n], self._v[:, :, :n] = kt[..., :n], v[:, :, :n]
        self._kt[..., n : n + q] = key_states.transpose(-1, -2)
        self._v[:, :, n : n + q] = value_states
        self._n = n + q
        self._refresh()
        if self.offset:  # the cascade attention: the whole buffers
            keys, values = self._kt.transpose(-1, -2), self._v
            setattr(keys, FILLED, self._n)  # how much of the buffer is filled, for cascade_attention
            return keys, values
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.offset + self._n

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._kt, self._v = self._kt[indices], self._v[indices]
            self._refresh()

    def reset(self) -> None:
        self._n = 0
        super().reset()

    def select_and_trim(self, indices: torch.Tensor, lead: int) -> None:
        """Keep rows `indices` and drop the first `lead` stored positions (padding on every kept row), in
        one copy into contiguous buffers."""
        if self.is_initialized:
            self._kt, self._v = self._kt[indices, :, :, lead:], self._v[indices, :, lead:]
            self._n -= lead
            self._refresh()


def select_rows(cache: DynamicCache, mask: torch.Tensor, indices: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Keep the batch rows `indices` of `cache` and of its 2D `mask`; returns the new mask.

    When the shared prefix lies outside a buffered cache (or there is none), the columns after it
    that are padding on every kept row are dropped too: a long episode that left the batch no longer
    makes the others read its history's width at every decoding step (the cascade attention reads
    whole buffers). Masked columns add nothing to attention, so the result is the same computation.
    """
    mask = mask[indices]
    layers = cache.layers
    if not (layers and mask.shape[0] and all(isinstance(x, BufferedLayer) and x.offset == prefix_len for x in layers)):
        cache.batch_select_indices(indices)
        return mask
    used = mask[:, prefix_len:].any(dim=0)
    lead = int(used.int().argmax()) if bool(used.any()) else 0
    for layer in layers:
        layer.select_and_trim(indices, lead)
    return torch.cat([mask[:, :prefix_len], mask[:, prefix_len + lead:]], dim=1)


def append_rows(cache: DynamicCache, mask: torch.Tensor, other: DynamicCache, other_mask: torch.Tensor,
                spare: int, prefix_len: int = 0) -> tuple[DynamicCache, torch.Tensor]:
    """`other`'s rows after `cache`'s, in one cache with room for `spare` more positions per row.

    Both hold rows laid out as [shared prefix | padding, the row's own positions] with 2D masks over
    that whole layout; the prefix is either outside the caches (their `offset`, the cascade attention)
    or stored in every row. Each part stays right-aligned: the shorter one gets zero padding (masked)
    right after the prefix, which leaves every row's positions, and so its computation, as they were.
    Continuous batching (policy.py) joins rows starting a new turn to a batch decoding this way.
    """
    first, second = cache.layers[0], other.layers[0]
    offset = first.offset
    if (second.offset != offset or mask.shape[1] != offset + first._n or other_mask.shape[1] != offset + second._n
            or prefix_len < offset or prefix_len > min(mask.shape[1], other_mask.shape[1])):
        raise ValueError("caches to merge must share their offset and prefix and match their masks")
    n = max(first._n, second._n)
    p = prefix_len - offset  # prefix positions stored in the rows

    def padded(m: torch.Tensor, filled: int) -> torch.Tensor:
        return torch.cat([m[:, :prefix_len], m.new_zeros(m.shape[0], n - filled), m[:, prefix_len:]], dim=1)

    merged = DynamicCache()
    merged.layer_class_to_replicate = cache.layer_class_to_replicate
    for a, b in zip(cache.layers, other.layers, strict=True):
        layer = BufferedLayer(n + spare, offset)
        rows = a._kt.shape[0] + b._kt.shape[0]
        layer.dtype, layer.device = a.dtype, a.device
        layer._kt = a._kt.new_zeros(rows, *a._kt.shape[1:3], n + spare)
        layer._v = a._v.new_zeros(rows, a._v.shape[1], n + spare, a._v.shape[-1])
        for part, lo in ((a, 0), (b, a._kt.shape[0])):
            hi, start = lo + part._kt.shape[0], n - part._n + p
            layer._kt[lo:hi, ..., :p], layer._v[lo:hi, :, :p] = part._kt[..., :p], part._v[:, :, :p]
            layer._kt[lo:hi, ..., start:n] = part._kt[..., p : part._n]
            layer._v[lo:hi, :, start:n] = part._v[:, :, p : part._n]
        layer._n = n
        layer._refresh()
        layer.is_initialized = True
        merged.layers.append(layer)
    return merged, torch.cat([padded(mask, first._n), padded(other_mask, second._n)])


def new_cache(model: Any, capacity: int, offset: int = 0) -> DynamicCache:
    """An empty KV cache; buffered when every layer is plain full attention.

    `offset` (shared prefix positions kept outside the cache) needs the cascade attention.
    """
    if not buffered(model):  # sliding-window/hybrid: transformers' own layers
        if offset:
            raise ValueError("a shared prefix outside the cache needs a model with only full-attention layers")
        return DynamicCache(config=model.config)
    cache = DynamicCache()
    cache.layer_class_to_replicate = lambda: BufferedLayer(capacity, offset)
    return cache


def buffered(model: Any) -> bool:
    """Whether `new_cache` gives this model `BufferedLayer`s (every layer plain full attention)."""
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
    return all(t == "full_attention" for t in layer_types)


def supports_cascade(model: Any) -> bool:
    return model.config._attn_implementation == CASCADE and buffered(model)


def shared_prefix(kv: list[tuple[torch.Tensor, torch.Tensor]] | None) -> AbstractContextManager[None]:
    """Context manager: attention layers see `kv` (per-layer (1, kv_heads, P, dim)) as a prefix of every row.

    A mixed-route batch passes one prefix per route, stacked (per-layer (routes, kv_heads, P, dim)): a row
    attends to the prefix of its route (`row_routes`)."""
    return _set_within(_SHARED, kv)


def _flash(q, k, v, mask=None, causal=False, scale=None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )


MATMUL_MAX_QUERIES = 8
"""Up to this many query positions per row (decoding), attention is two small matrix products.

The CPU flash kernel is built for long query blocks: for one decoded token per row it is many times slower than
the plain products, for a prefill block of hundreds of queries it wins (`benchmarks/rollout_throughput.py`)."""


def _matmul_attention(q, k, v, mask=None, scale=None):
    """(out, lse) like the flash kernel, for few queries; grouped-query heads without repeat_kv.

    q: (b, h, lq, d); k, v: (b or 1, hkv, L, d); mask: bool (b, 1, lq, L) or None.
    """
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    rep = h // hkv
    if k.shape[-2] == 0:  # no keys (a split whose late part is empty): nothing seen
        return q.new_zeros(b, h, lq, v.shape[-1]), q.new_full((b, h, lq), float("-inf"), dtype=torch.float32)
    qg = q.reshape(b, hkv, rep * lq, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(d**-0.5 if scale is None else scale)
    if mask is not None:
        keep = mask.expand(b, 1, lq, -1)[:, :, None].expand(b, 1, rep, lq, -1).reshape(b, 1, rep * lq, -1)
        scores.masked_fill_(~keep, float("-inf"))
    # softmax by hand, normalised after the product: one pass over the scores fewer than logsumexp and
    # then exp(scores - lse), which cost a large share of a decoding step's attention
    top = scores.amax(dim=-1, keepdim=True).clamp_(min=-1e30)  # a fully masked row: finite, its sum 0
    weights = scores.sub_(top).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    lse = (top + total.log()).squeeze(-1)  # -inf where the row sees nothing
    norm = total.clamp_(min=1e-30)
    if v.dtype == torch.float16:  # unnormalised sums can pass fp16's range (65504): normalise first
        out = torch.matmul(weights.div_(norm).to(v.dtype), v)
    else:
        out = torch.matmul(weights.to(v.dtype), v).float().div_(norm).to(v.dtype)
    return out.reshape(b, h, lq, d), lse.reshape(b, h, lq)


SPLIT_OVERHEAD_KEYS = 2048
"""What computing one row's early history apart costs, in keys x rows of the batched product."""

WHOLE_READ_COST = 0.5
"""Cost of a key of one row when the product reads the whole key buffer, per key of a slice of it.

A bf16 product over a slice of the buffers takes a slow path on the CPU, about twice the cost per key of a
product over the whole buffer (`benchmarks/ragged_history.py`)."""


def history_split(starts: list[int], length: int) -> int:
    """The column from which every row's keys are read together (see `_ragged_matmul_attention`).

    Rows whose history starts before it read their earlier keys apart, one row at a time. Chosen to
    minimise `rows x (length - cut) + sum over earlier rows of (cut - start + SPLIT_OVERHEAD_KEYS)`,
    where cut 0 (the whole buffer, no slice) costs `WHOLE_READ_COST x rows x length`.
    """
    def cost(cut: int) -> float:
        if cut == 0:
            return WHOLE_READ_COST * len(starts) * length
        return len(starts) * (length - cut) + sum(cut - s + SPLIT_OVERHEAD_KEYS for s in starts if s < cut)

    return min(sorted({0, *starts}), key=cost)


def _ragged_matmul_attention(q, k, v, mask=None, scale=None):
    """`_matmul_attention` over a batch whose rows hold histories of very different lengths.

    A row's keys sit at the end of the buffer, after padding up to the longest row's history, and a
    decoding step reads every row's padded keys, so one long episode makes every row pay for its length.
    Here the keys from `history_split`'s column on are read for all rows at once, the earlier
    keys only by the rows that have any, one row at a time, and the parts are merged by their
    log-sum-exp (exact up to float rounding, as the prefix merge).
    """
    if mask is None or q.shape[0] == 1:
        return _matmul_attention(q, k, v, mask, scale=scale)
    valid = mask[:, 0].any(dim=1)  # (b, L): positions any query of the row sees
    starts = torch.where(valid.any(dim=-1), valid.int().argmax(dim=-1), valid.shape[-1]).tolist()
    cut = history_split(starts, valid.shape[-1])
    if cut == 0:
        return _matmul_attention(q, k, v, mask, scale=scale)
    out, lse = _matmul_attention(q, k[:, :, cut:], v[:, :, cut:], mask[..., cut:], scale=scale)
    for i, start in enumerate(starts):
        if start >= cut:
            continue
        o_i, l_i = _matmul_attention(q[i:i + 1], k[i:i + 1, :, start:cut], v[i:i + 1, :, start:cut],
                                     mask[i:i + 1, ..., start:cut], scale=scale)
        both = torch.logaddexp(lse[i], l_i[0])
        keep = torch.isfinite(both)
        w_late = torch.where(keep, torch.exp(lse[i] - both), 0.0).to(out.dtype)[..., None]
        w_early = torch.where(keep, torch.exp(l_i[0] - both), 0.0).to(out.dtype)[..., None]
        out[i] = out[i] * w_late + o_i[0] * w_early
        lse[i] = both
    return out, lse


def _prefix_attention(query, pk, pv, scaling, few):
    """(out, lse) of every row's queries over one shared prefix (1, kv_heads, P, dim): every query sees every
    prefix position, so all rows' queries share one product."""
    b, h, lq, d = query.shape
    hkv = pk.shape[1]
    rep = h // hkv
    qg = query.reshape(b, hkv, rep, lq, d).transpose(0, 1).reshape(1, hkv, b * rep * lq, d)
    out_p, lse_p = (_matmul_attention if few else _flash)(qg, pk, pv, scale=scaling)
    out_p = out_p.reshape(hkv, b, rep, lq, d).transpose(0, 1).reshape(b, h, lq, d)
    return out_p, lse_p.reshape(hkv, b, rep, lq).transpose(0, 1).reshape(b, h, lq).float()


def _routed_prefix_attention(query, pk, pv, rows: RowRoutes, scaling, few, layer_idx: int = 0):
    """`_prefix_attention` where each route has its own prefix (pk, pv: (routes, kv_heads, P, dim)): the rows
    laid out route by route (`RowRoutes.gather`), one batched product over the routes present, the rows picked
    back (`RowRoutes.slot`). One product instead of one per route: a loop over the routes pays each product's
    fixed cost once per route and layer."""
    b, h, lq, d = query.shape
    hkv = pk.shape[1]
    rep, m = h // hkv, rows.width
    if len(rows.present) < pk.shape[0]:
        if layer_idx not in rows.prefixes:
            rows.prefixes[layer_idx] = pk.index_select(0, rows.present_index), pv.index_select(0, rows.present_index)
        pk, pv = rows.prefixes[layer_idx]
    g = pk.shape[0]
    qg = query.reshape(b, hkv, rep * lq, d).index_select(0, rows.gather)
    qg = qg.reshape(g, m, hkv, rep * lq, d).transpose(1, 2).reshape(g, hkv, m * rep * lq, d)
    out, lse = (_matmul_attention if few else _flash)(qg, pk, pv, scale=scaling)
    out = out.reshape(g, hkv, m, rep * lq, d).transpose(1, 2).reshape(g * m, h, lq, d).index_select(0, rows.slot)
    lse = lse.reshape(g, hkv, m, rep * lq).transpose(1, 2).reshape(g * m, h, lq).index_select(0, rows.slot)
    return out, lse.float()


def cascade_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention over [shared prefix | row suffix]; exact up to float rounding."""
    shared = _SHARED.get()
    if shared is None or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    pk, pv = shared[module.layer_idx]
    b, h, lq, d = query.shape
    plen, rep = pk.shape[2], h // pk.shape[1]
    few = lq <= MATMUL_MAX_QUERIES
    if pk.shape[0] == 1:
        out_p, lse_p = _prefix_attention(query, pk, pv, scaling, few)
    else:  # one prefix per route: each route's rows against its own, one product per route
        rows = _ROWS.get()
        if rows is None or len(rows.routes) != b:
            raise ValueError(f"{pk.shape[0]} shared prefixes (one per route) need the routes of the {b} rows "
                             "(kvcache.row_routes)")
        out_p, lse_p = _routed_prefix_attention(query, pk, pv, rows, scaling, few, module.layer_idx)
    mask = None if attention_mask is None else attention_mask[..., plen:]
    filled = getattr(key, FILLED, key.shape[-2])  # a BufferedLayer's whole buffer is longer than its filled part
    if mask is not None and mask.shape[-1] != filled:
        raise ValueError(f"the attention mask covers {plen + mask.shape[-1]} positions; the shared prefix and "
                         f"the cache hold {plen + filled}")
    if filled == 0:
        out = out_p
    else:
        if mask is None and (lq > 1 or key.shape[-2] > filled):  # causal: the queries are the last lq positions
            mask = torch.ones(lq, filled, dtype=torch.bool).tril(filled - lq)[None, None]
        products = few and (mask is None or mask.dtype == torch.bool)  # else the flash kernel
        if key.shape[-2] > filled and products:  # read the whole buffer (fast), its unused tail masked
            mask = torch.cat([mask, mask.new_zeros(*mask.shape[:-1], key.shape[-2] - filled)], dim=-1)
        elif key.shape[-2] > filled:  # long query blocks: the filled part only
            key, value = key[:, :, :filled], value[:, :, :filled]
        if products:
            out_s, lse_s = _ragged_matmul_attention(query, key, value, mask, scale=scaling)
        else:
            ks, vs = repeat_kv(key, rep), repeat_kv(value, rep)
            if mask is not None and mask.dtype == torch.bool:
                visible = mask.any(dim=-1)  # (b, 1, lq): a query that sees none of the suffix (a pad)
                mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, float("-inf"))
            else:
                visible = None
            out_s, lse_s = _flash(query, ks, vs, mask, scale=scaling)
            lse_s = lse_s.float()
            if visible is not None:
                lse_s = lse_s.masked_fill(~visible, float("-inf"))
                out_s = out_s.masked_fill(~visible[..., None], 0.0)
        w = torch.sigmoid(lse_p - lse_s).to(out_p.dtype)[..., None]  # share of the prefix in the softmax
        out = out_p * w + out_s * (1 - w)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(CASCADE, cascade_attention)
AttentionMaskInterface.register(CASCADE, sdpa_mask)
