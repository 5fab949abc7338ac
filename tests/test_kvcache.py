"""Shared-prefix cascade attention and the buffered KV layer against plain attention."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

from trace_lib.agent.kvcache import (
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
    # rows of one length: nothing apart
    assert history_split([200] * 8, 1200) == 200
    # a short difference is not worth a row's separate product
    assert history_split([0, 100, 100, 100], 1000) == 0
    assert SPLIT_OVERHEAD_KEYS > 100 * 3


@pytest.mark.parametrize("lq", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_over_histories_of_different_lengths_equals_attention_over_the_concatenation(lq, dtype):
    torch.manual_seed(3)
    b, h, hkv, plen, s, d = 4, 6, 2, 5, 4000, 16
    q = torch.randn(b, h, lq, d, dtype=dtype)
    pk, pv = torch.randn(1, hkv, plen, d, dtype=dtype), torch.randn(1, hkv, plen, d, dtype=dtype)
    kt = torch.randn(b, hkv, d, s, dtype=dtype)  # keys stored transposed, as BufferedLayer does
    k, v = kt.transpose(-1, -2), torch.randn(b, hkv, s, d, dtype=dtype)
    mask = torch.zeros(b, 1, lq, plen + s, dtype=torch.bool)
    mask[..., :plen] = True
    for row, start in enumerate([0, 3000, 3100, 3500]):  # row 0's history is 3k positions longer
        mask[row, ..., plen + start:] = True
    mask[2, ..., plen + 3200:plen + 3300] = False  # padding inside a row's history
    for i in range(lq):
        mask[..., i, plen + s - lq + i + 1:] = False
    assert history_split([0, 3000, 3100, 3500], s) == 3000  # the case under test: row 0 read apart
    _cascade_matches_concatenation(q, pk, pv, k, v, mask, dtype)


def test_split_histories_keep_queries_that_see_nothing_in_one_part():
    torch.manual_seed(4)
    b, h, hkv, plen, s, d, lq = 3, 4, 2, 3, 3000, 8, 3
    q = torch.randn(b, h, lq, d)
    pk, pv = torch.randn(1, hkv, plen, d), torch.randn(1, hkv, plen, d)
    k, v = torch.randn(b, hkv, d, s).transpose(-1, -2), torch.randn(b, hkv, s, d)
    mask = torch.zeros(b, 1, lq, plen + s, dtype=torch.bool)
    mask[..., :plen] = True
    mask[0, ..., plen:] = True  # row 0: the whole history
    mask[0, :, 1, plen + 2500:] = False  # ... but its query 1 sees only the early part
    mask[1, :, :, plen + 2600:] = True  # row 1: the late part only
    mask[1, :, 0, plen:] = False  # ... and its query 0 is padding: the prefix only
    mask[2, :, :, plen + 2800:] = True
    assert history_split([0, 2600, 2800], s) == 2600
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
    keys, _ = layer.update(k, k + 100)
    assert keys.shape == (3, 1, 3, 2) and torch.equal(keys, k)  # grew past capacity 2
    keys, values = layer.update(k[:, :, :1], k[:, :, :1])
    assert layer.get_seq_length() == 10 + 4 and keys.shape[2] == 4
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.keys[:, :, :3], k[[2, 0]]) and layer.values.shape[0] == 2
