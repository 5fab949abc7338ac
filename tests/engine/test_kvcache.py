"""Shared-prefix cascade attention and the buffered KV layer against plain attention."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

from trace_lib.engine.kvcache import (
    MATMUL_MAX_QUERIES,
    SPLIT_OVERHEAD_KEYS,
    BufferedLayer,
    cascade_attention,
    history_split,
    shared_prefix,
)


class _Layer:
    layer_idx = 0
    num_key_value_groups = 2  # read by transformers' sdpa path


def _cascade_matches_concatenation(q, pk, pv, k, v, mask, dtype) -> torch.Tensor:
    """Cascade attention's output, checked against sdpa over [prefix | suffix] with the same mask."""
    b, h, d, hkv = q.shape[0], q.shape[1], q.shape[-1], k.shape[1]
    with shared_prefix([(pk, pv)]):
        out, _ = cascade_attention(_Layer(), q, k, v, mask, scaling=d**-0.5)
    keys = repeat_kv(torch.cat([pk.expand(b, -1, -1, -1), k], 2), h // hkv)
    values = repeat_kv(torch.cat([pv.expand(b, -1, -1, -1), v], 2), h // hkv)
    ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), ref.transpose(1, 2).float(), atol=tol)
    return out


@pytest.mark.parametrize("lq", [1, 4, MATMUL_MAX_QUERIES + 4])  # matrix products, and the flash kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_equals_attention_over_the_concatenation(lq, dtype):
    torch.manual_seed(0)
    b, h, hkv, plen, d = 3, 6, 2, 7, 16
    s = lq + 4
    q = torch.randn(b, h, lq, d, dtype=dtype)
    pk, pv = torch.randn(1, hkv, plen, d, dtype=dtype), torch.randn(1, hkv, plen, d, dtype=dtype)
    k, v = torch.randn(b, hkv, s, d, dtype=dtype), torch.randn(b, hkv, s, d, dtype=dtype)
    mask = torch.ones(b, 1, lq, plen + s, dtype=torch.bool)
    for i in range(lq):  # causal over the suffix: query i is the suffix's (s - lq + i)-th position
        mask[:, :, i, plen + s - lq + i + 1:] = False
    mask[1, :, :, plen:plen + 2] = False  # row 1: two padding slots between prefix and suffix
    if lq > 1:
        mask[2, :, 0, plen:] = False  # a query that is itself padding sees only the prefix
    out = _cascade_matches_concatenation(q, pk, pv, k, v, mask, dtype)
    assert out.shape == (b, lq, h, d)


def test_history_split_reads_a_long_rows_early_keys_apart():
    # one row 4.8k positions long, seven at 1k, in a 4.8k buffer: from column 3.8k on, all rows together
    assert history_split([0] + [3800] * 7, 4800) == 3800
    # rows of one length: the whole buffer, read contiguously (a slice from column 200 costs twice per key)
    assert history_split([200] * 8, 1200) == 0
    # a short difference is not worth a row's separate product
    assert history_split([0, 100, 100, 100], 1000) == 0
    assert SPLIT_OVERHEAD_KEYS > 100 * 3


@pytest.mark.parametrize("lq", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_over_histories_of_different_lengths_equals_attention_over_the_concatenation(lq, dtype):
    torch.manual_seed(3)
    b, h, hkv, plen, s, d = 4, 6, 2, 5, 6000, 16
    q = torch.randn(b, h, lq, d, dtype=dtype)
    pk, pv = torch.randn(1, hkv, plen, d, dtype=dtype), torch.randn(1, hkv, plen, d, dtype=dtype)
    kt = torch.randn(b, hkv, d, s, dtype=dtype)  # keys stored transposed, as BufferedLayer does
    k, v = kt.transpose(-1, -2), torch.randn(b, hkv, s, d, dtype=dtype)
    mask = torch.zeros(b, 1, lq, plen + s, dtype=torch.bool)
    mask[..., :plen] = True
    for row, start in enumerate([0, 5500, 5600, 5700]):  # row 0's history is 5.5k positions longer
        mask[row, ..., plen + start:] = True
    mask[2, ..., plen + 5620:plen + 5640] = False  # padding inside a row's history
    for i in range(lq):
        mask[..., i, plen + s - lq + i + 1:] = False
    assert history_split([0, 5500, 5600, 5700], s) == 5500  # the case under test: row 0 read apart
    _cascade_matches_concatenation(q, pk, pv, k, v, mask, dtype)


def test_split_histories_keep_queries_that_see_nothing_in_one_part():
    torch.manual_seed(4)
    b, h, hkv, plen, s, d, lq = 3, 4, 2, 3, 10000, 8, 3
    q = torch.randn(b, h, lq, d)
    pk, pv = torch.randn(1, hkv, plen, d), torch.randn(1, hkv, plen, d)
    k, v = torch.randn(b, hkv, d, s).transpose(-1, -2), torch.randn(b, hkv, s, d)
    mask = torch.zeros(b, 1, lq, plen + s, dtype=torch.bool)
    mask[..., :plen] = True
    mask[0, ..., plen:] = True  # row 0: the whole history
    mask[0, :, 1, plen + 9500:] = False  # ... but its query 1 sees only the early part
    mask[1, :, :, plen + 9600:] = True  # row 1: the late part only
    mask[1, :, 0, plen:] = False  # ... and its query 0 is padding: the prefix only
    mask[2, :, :, plen + 9800:] = True
    assert history_split([0, 9600, 9800], s) == 9600
    out = _cascade_matches_concatenation(q, pk, pv, k, v, mask, torch.float32)
    assert torch.isfinite(out).all()


def test_without_a_shared_prefix_it_is_plain_sdpa():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    out, _ = cascade_attention(_Layer(), q, k, v, None, scaling=8**-0.5, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-6)


@pytest.mark.parametrize("lq", [1, 3, MATMUL_MAX_QUERIES + 2])
def test_cascade_without_a_mask_is_causal_over_the_suffix(lq):
    torch.manual_seed(2)
    b, h, hkv, plen, s, d = 2, 4, 2, 5, lq + 3, 8
    q = torch.randn(b, h, lq, d)
    pk, pv = torch.randn(1, hkv, plen, d), torch.randn(1, hkv, plen, d)
    k, v = torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    with shared_prefix([(pk, pv)]):
        out, _ = cascade_attention(_Layer(), q, k, v, None, scaling=d**-0.5)
    mask = torch.ones(lq, plen + s, dtype=torch.bool).tril(plen + s - lq)
    keys = repeat_kv(torch.cat([pk.expand(b, -1, -1, -1), k], 2), h // hkv)
    values = repeat_kv(torch.cat([pv.expand(b, -1, -1, -1), v], 2), h // hkv)
    ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=d**-0.5)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-5)


def test_buffered_layer_grows_selects_and_reports_offset():
    layer = BufferedLayer(capacity=2, offset=10)
    k = torch.arange(3 * 1 * 3 * 2, dtype=torch.float32).reshape(3, 1, 3, 2)
    layer.update(k, k + 100)
    assert layer.keys.shape == (3, 1, 3, 2) and torch.equal(layer.keys, k)  # grew past capacity 2
    layer.update(k[:, :, :1], k[:, :, :1])
    assert layer.get_seq_length() == 10 + 4 and layer.keys.shape[2] == 4
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.keys[:, :, :3], k[[2, 0]]) and layer.values.shape[0] == 2


def test_buffered_layer_returns_its_whole_zeroed_buffer_with_an_offset_and_the_filled_part_without():
    k = torch.randn(2, 3, 5, 4)
    whole = BufferedLayer(capacity=8, offset=6)
    keys, values = whole.update(k, k + 1)
    assert keys.shape == values.shape == (2, 3, 8, 4)  # the cascade attention reads the whole buffer
    assert torch.equal(keys[:, :, :5], k) and torch.equal(values[:, :, :5], k + 1)
    assert not keys[:, :, 5:].any() and not values[:, :, 5:].any()  # the unused tail: zeros, finite
    assert torch.equal(whole.keys, k) and whole.get_seq_length() == 6 + 5
    part = BufferedLayer(capacity=8)
    keys, _ = part.update(k, k)
    assert keys.shape == (2, 3, 5, 4) and torch.equal(keys, k)  # plain attention (sdpa): the filled part


@pytest.mark.parametrize("lq", [1, 3, MATMUL_MAX_QUERIES + 4])
def test_cascade_over_whole_buffers_equals_attention_over_the_filled_part(lq):
    torch.manual_seed(5)
    b, h, hkv, plen, d, filled = 3, 6, 2, 4, 8, 20
    q = torch.randn(b, h, lq, d)
    pk, pv = torch.randn(1, hkv, plen, d), torch.randn(1, hkv, plen, d)
    layer = BufferedLayer(capacity=filled + 7, offset=plen)
    k, v = torch.randn(b, hkv, filled, d), torch.randn(b, hkv, filled, d)
    keys, values = layer.update(k, v)
    assert keys.shape[2] == filled + 7
    mask = torch.ones(b, 1, lq, plen + filled, dtype=torch.bool)
    for i in range(lq):
        mask[:, :, i, plen + filled - lq + i + 1:] = False
    mask[1, :, :, plen:plen + 3] = False
    with shared_prefix([(pk, pv)]):
        out, _ = cascade_attention(_Layer(), q, keys, values, mask, scaling=d**-0.5)
    ref = _cascade_matches_concatenation(q, pk, pv, k, v, mask, torch.float32)
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_buffers_with_a_long_rows_early_keys_read_apart_equal_attention_over_the_filled_part(dtype):
    torch.manual_seed(6)
    b, h, hkv, plen, s, d = 4, 6, 2, 5, 6000, 16
    q = torch.randn(b, h, 1, d, dtype=dtype)
    pk, pv = torch.randn(1, hkv, plen, d, dtype=dtype), torch.randn(1, hkv, plen, d, dtype=dtype)
    layer = BufferedLayer(capacity=s + 50, offset=plen)
    k, v = torch.randn(b, hkv, s, d, dtype=dtype), torch.randn(b, hkv, s, d, dtype=dtype)
    keys, values = layer.update(k, v)
    mask = torch.zeros(b, 1, 1, plen + s, dtype=torch.bool)
    mask[..., :plen] = True
    for row, start in enumerate([0, 5500, 5600, 5700]):
        mask[row, ..., plen + start:] = True
    assert history_split([0, 5500, 5600, 5700], s + 50) == 5500  # the late part includes the free tail
    with shared_prefix([(pk, pv)]):
        out, _ = cascade_attention(_Layer(), q, keys, values, mask, scaling=d**-0.5)
    ref = _cascade_matches_concatenation(q, pk, pv, k, v, mask, dtype)
    assert torch.allclose(out.float(), ref.float(), atol=1e-6 if dtype == torch.float32 else 2e-2)


def test_whole_buffers_without_a_mask_see_only_the_filled_part():
    torch.manual_seed(7)
    b, hkv, plen, filled, d = 2, 2, 3, 9, 8
    q = torch.randn(b, 4, 1, d)
    pk, pv = torch.randn(1, hkv, plen, d), torch.randn(1, hkv, plen, d)
    layer = BufferedLayer(capacity=filled + 6, offset=plen)
    k, v = torch.randn(b, hkv, filled, d), torch.randn(b, hkv, filled, d)
    keys, values = layer.update(k, v)
    with shared_prefix([(pk, pv)]):
        out, _ = cascade_attention(_Layer(), q, keys, values, None, scaling=d**-0.5)
        ref, _ = cascade_attention(_Layer(), q, k, v, None, scaling=d**-0.5)
        with pytest.raises(ValueError, match="the attention mask covers 10 positions; the shared prefix and the "
                                             "cache hold 12"):
            cascade_attention(_Layer(), q, keys, values, torch.ones(b, 1, 1, plen + filled - 2, dtype=torch.bool))
    assert torch.allclose(out, ref, atol=1e-6)


def test_matmul_attention_without_keys_sees_nothing_and_fp16_sums_stay_finite():
    from trace_lib.engine.kvcache import _matmul_attention

    q = torch.randn(2, 4, 1, 8)
    out, lse = _matmul_attention(q, torch.zeros(2, 2, 0, 8), torch.zeros(2, 2, 0, 8))
    assert not out.any() and torch.isneginf(lse).all() and out.shape == (2, 4, 1, 8)
    # 5k keys of equal score and values near fp16's limit / 100: unnormalised sums would overflow
    k = torch.zeros(1, 1, 5000, 8, dtype=torch.float16)
    v = torch.full((1, 1, 5000, 8), 600.0, dtype=torch.float16)
    out, _ = _matmul_attention(torch.zeros(1, 2, 1, 8, dtype=torch.float16), k, v)
    assert torch.isfinite(out).all() and torch.allclose(out.float(), torch.full_like(out.float(), 600.0), rtol=1e-2)


def _buffered_cache(rows: list[list[int]], offset: int, layers: int = 2):
    """A cache of BufferedLayers holding each row's positions right-aligned (values = the position's id),
    and its 2D mask over [offset | stored]."""
    from transformers.cache_utils import DynamicCache

    n = max(len(r) for r in rows)
    cache = DynamicCache()
    keys = torch.zeros(len(rows), 1, n, 2)
    mask = torch.zeros(len(rows), offset + n, dtype=torch.long)
    mask[:, :offset] = 1
    for i, r in enumerate(rows):
        keys[i, 0, n - len(r):] = torch.tensor(r, dtype=torch.float)[:, None]
        mask[i, offset + n - len(r):] = 1
    for idx in range(layers):
        layer = BufferedLayer(n + 4, offset)
        layer.update(keys, keys + 0.5)
        cache.layers.append(layer)
    return cache, mask


def _rows_of(cache, mask, offset):
    """Each row's stored values at its valid positions."""
    layer = cache.layers[0]
    assert mask.shape[1] == offset + layer._n
    return [layer.keys[i, 0, mask[i, offset:].bool(), 0].tolist() for i in range(mask.shape[0])]


def test_select_rows_drops_columns_no_kept_row_uses_and_append_rows_right_aligns_both_parts():
    from trace_lib.engine.kvcache import append_rows, select_rows

    cache, mask = _buffered_cache([[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]], offset=3)
    mask = select_rows(cache, mask, torch.tensor([2, 1]), prefix_len=3)
    assert cache.layers[0]._n == 3 and mask.shape == (2, 6)  # the long row left: its 3 extra columns too
    assert _rows_of(cache, mask, 3) == [[9, 10, 11], [7, 8]]
    assert cache.layers[1].values[0, 0, :, 0].tolist() == [9.5, 10.5, 11.5]
    other, other_mask = _buffered_cache([[20, 21, 22, 23, 24]], offset=3)
    merged, merged_mask = append_rows(cache, mask, other, other_mask, spare=2, prefix_len=3)
    assert merged_mask.shape == (3, 8) and merged_mask[:, :3].all()
    assert _rows_of(merged, merged_mask, 3) == [[9, 10, 11], [7, 8], [20, 21, 22, 23, 24]]
    assert merged.layers[0]._v.shape[-2] == 5 + 2  # room for 2 more positions
    # a prefix stored in the rows (no cascade): the padding goes after it, nothing is trimmed before it
    cache, mask = _buffered_cache([[1, 1, 5, 6], [1, 1, 0, 7]], offset=0)
    mask[1, 2] = 0  # columns 0-1: the prefix, stored in both rows; row 1 is padded after it
    other, other_mask = _buffered_cache([[1, 1, 8, 9, 10]], offset=0)
    merged, merged_mask = append_rows(cache, mask, other, other_mask, spare=1, prefix_len=2)
    assert _rows_of(merged, merged_mask, 0) == [[1, 1, 5, 6], [1, 1, 7], [1, 1, 8, 9, 10]]
    assert merged_mask[:, :2].all()
    with pytest.raises(ValueError, match="share their offset"):
        append_rows(cache, mask, *_buffered_cache([[1]], offset=1), spare=1, prefix_len=2)


@pytest.mark.parametrize("lq", [1, 12])  # decoding (the products) and a prefill block (the flash kernel)
@pytest.mark.parametrize("routes", [[2, 0, 2, 1, 0], [1, 1, 1], [0, 2, 2, 0]])
def test_routed_prefix_attention_gives_each_row_its_routes_prefix(lq, routes):
    """Rows under different routes, one shared prefix per route: each row's prefix part is that of its own
    route's prefix alone (routes in any order, some absent, uneven counts)."""
    from trace_lib.engine.kvcache import RowRoutes, _prefix_attention, _routed_prefix_attention

    torch.manual_seed(0)
    b, h, hkv, d, p = len(routes), 6, 2, 8, 40
    q = torch.randn(b, h, lq, d)
    pk, pv = torch.randn(3, hkv, p, d), torch.randn(3, hkv, p, d)
    few = lq <= 8
    out, lse = _routed_prefix_attention(q, pk, pv, RowRoutes(routes), None, few)
    for i, g in enumerate(routes):
        o, l = _prefix_attention(q[i:i + 1], pk[g:g + 1], pv[g:g + 1], None, few)
        torch.testing.assert_close(out[i:i + 1], o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[i:i + 1], l, rtol=1e-5, atol=1e-5)
