"""The shared-prompt GRPO pass equals the row-by-row computation: log-probs and LoRA gradients."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trace_lib.engine.policy import load_policy
import trace_lib.training.shared_prompt as shared_prompt
from trace_lib.training.shared_prompt import SharedPrefix, Span, grouped_logps, leaf_batches, shared_spans


@pytest.fixture(scope="module")
def lora_model(tiny_model_dir):
    torch.manual_seed(0)
    model = load_policy(tiny_model_dir, attn_implementation="sdpa").model
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, cfg).train()


def _batch():
    """Two groups of three rows (prompts of 7 and 6 tokens sharing their first 4, left-padded), completions
    right-padded."""
    g = torch.Generator().manual_seed(1)
    p1 = torch.randint(10, 1000, (7,), generator=g)
    p2 = torch.cat([p1[:4], torch.randint(10, 1000, (2,), generator=g)])
    lengths, width = [6, 3, 5, 4, 6, 2], 6
    ids, mask = torch.zeros(6, 7 + width, dtype=torch.long), torch.zeros(6, 7 + width, dtype=torch.long)
    for i, n in enumerate(lengths):
        p = p1 if i < 3 else p2
        ids[i, 7 - len(p):7], mask[i, 7 - len(p):7] = p, 1
        ids[i, 7:7 + n], mask[i, 7:7 + n] = torch.randint(10, 1000, (n,), generator=g), 1
    score = (torch.rand(6, width, generator=g) > 0.3).long() * mask[:, 7:]
    return ids, mask, width, score


def _row_by_row(model, ids, mask, width, detach_prompt=False):
    """Each row's completion log-probs from its own forward pass; with `detach_prompt`, the prompt but its last
    token runs first without gradient and the rest continues from its cache."""
    from transformers.cache_utils import DynamicCache

    out = []
    for i in range(ids.shape[0]):
        row = ids[i][mask[i].bool()][None]
        n = int(mask[i, -width:].sum())
        plen = row.shape[1] - n
        cut = plen - 1 if detach_prompt else 0
        cache = DynamicCache()
        if cut:
            with torch.no_grad():
                model(input_ids=row[:, :cut], past_key_values=cache, use_cache=True)
        logits = model(input_ids=row[:, cut:], past_key_values=cache, use_cache=True).logits.float().log_softmax(-1)
        picked = logits[0, plen - 1 - cut:-1].gather(-1, row[0, plen:, None]).squeeze(-1)
        out.append(torch.cat([picked, picked.new_zeros(width - n)]))
    return torch.stack(out)


def test_shared_spans_form_a_prefix_tree():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [1, 2, 9], [1, 2, 3, 4], [8], []]
    assert shared_spans(seqs) == [
        Span((0, 1, 2, 3), 0, 2, -1),  # all of rows 0-3 start with 1, 2
        Span((0, 1, 3), 2, 4, 0),  # row 3 ends here: its tokens are all shared
        Span((0,), 4, 5, 1), Span((1,), 4, 6, 1),
        Span((2,), 2, 3, 0),
        Span((4,), 0, 1, -1)]  # row 5 has no tokens, hence no span
    assert shared_spans([[], []]) == []


def test_shared_spans_stop_sharing_where_told():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4]]
    assert shared_spans(seqs, share_until=[2, 2, 2]) == [
        Span((0, 1, 2), 0, 2, -1), Span((0,), 2, 4, 0), Span((1,), 2, 4, 0), Span((2,), 2, 4, 0)]
    # every row's tokens are covered once, parents first
    for spans in (shared_spans(seqs), shared_spans(seqs, [2, 3, 1])):
        for r, seq in enumerate(seqs):
            path = [s for s in spans if r in s.rows]
            assert [t for s in path for t in range(s.start, s.end)] == list(range(len(seq)))
            assert all(spans.index(s) > s.parent for s in path)


def test_grouped_logps_and_gradients_equal_the_row_by_row_pass(lora_model):
    ids, mask, width, score = _batch()
    weights = torch.linspace(-1, 1, ids.shape[0])[:, None]  # like advantages: both signs
    params = [p for p in lora_model.parameters() if p.requires_grad]

    logps, ent = grouped_logps(lora_model, ids, mask, width, score, compute_entropy=True)
    grads = torch.autograd.grad((logps * score * weights).sum(), params)
    ref = _row_by_row(lora_model, ids, mask, width)
    ref_grads = torch.autograd.grad((ref * score * weights).sum(), params)

    assert torch.allclose(logps * score, ref * score, atol=1e-5)
    assert bool((logps[score == 0] == 0).all())  # unscored positions are not computed
    assert ent is not None and bool((ent[score.bool()] > 0).all())
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert any(float(g.abs().sum()) > 0 for g in grads)


def test_bf16_base_weights_run_under_autocast_and_stay_close(tiny_model_dir):
    torch.manual_seed(0)
    model = load_policy(tiny_model_dir, dtype="bfloat16", attn_implementation="sdpa").model
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(model, cfg).train()
    ids, mask, width, score = _batch()
    logps, _ = grouped_logps(model, ids, mask, width, score)
    with torch.no_grad():
        ref = _row_by_row(model, ids, mask, width)
    assert logps.dtype == torch.float32
    assert torch.allclose(logps * score, ref * score, atol=0.1)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 for p in lora)  # fp32 master weights
    (logps * score).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lora)


def test_a_prefix_of_bf16_weights_collects_the_passes_gradients_in_fp32(tiny_model_dir):
    """bf16 base weights: the prefix's leaves are fp32 and sum the passes' gradients there, and the passes backward
    through the one cast to bf16 again and again; the gradients stay close to one pass's."""
    torch.manual_seed(0)
    model = load_policy(tiny_model_dir, dtype="bfloat16", attn_implementation="sdpa").model
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(model, cfg).train()
    ids, mask, width, score = _batch()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    ref = torch.autograd.grad((grouped_logps(model, ids, mask, width, score)[0] * score).sum(), lora)
    prefix = SharedPrefix(ids[0][mask[0].bool()][:4].tolist())
    for rows in ([0, 3], [1, 2], [4, 5]):
        part, _ = grouped_logps(model, ids[rows], mask[rows], width, score[rows], prefix=prefix)
        (part * score[rows]).sum().backward()
    assert prefix.cache.layers[1].keys.dtype == torch.bfloat16
    assert all(leaf.dtype == torch.float32 for leaf in prefix._leaves)
    prefix.backward()
    for p, want in zip(lora, ref):
        assert p.grad.dtype == torch.float32
        assert float((p.grad - want).norm()) <= 0.05 * float(want.norm()) + 1e-6


def test_grouped_logps_skip_groups_with_nothing_to_score(lora_model):
    ids, mask, width, score = _batch()
    score[:3] = 0
    logps, _ = grouped_logps(lora_model, ids, mask, width, score)
    assert bool((logps[:3] == 0).all()) and bool((logps[3:][score[3:].bool()] != 0).all())


def _batch_with_common_starts():
    """`_batch`, but each group's completions start alike: group 1's three rows share their first 3 tokens
    (row 1, 3 long, is all shared), group 2's share 2 tokens, and row 5 of group 2 is only 3 long."""
    ids, mask, width, score = _batch()
    ids[1, 7:10] = ids[0, 7:10]
    ids[2, 7:10] = ids[0, 7:10]
    ids[4, 7:9] = ids[3, 7:9]
    ids[5, 7:9] = ids[3, 7:9]
    mask[5, 7:10], ids[5, 9] = 1, 77
    score[5] = mask[5, 7:]
    score[:3, 1] = torch.tensor([1, 0, 0])  # a common position only one row scores
    return ids, mask, width, score


def test_leaf_batches_join_siblings_whose_padding_costs_less_than_a_call():
    spans = [Span((0, 1, 2, 3), 0, 10, -1), Span((0,), 10, 400, 0), Span((1,), 10, 50, 0), Span((2,), 10, 300, 0),
             Span((3,), 10, 20, 0), Span((4,), 0, 30, -1)]
    assert leaf_batches(spans, call_cost=128) == [[1, 3], [2, 4], [5]]
    assert leaf_batches(spans, call_cost=0) == [[1], [3], [2], [4], [5]]
    assert leaf_batches(spans, call_cost=10**6) == [[1, 3, 2, 4], [5]]


@pytest.mark.parametrize("call_cost", [0, 128, 10**6])
def test_shared_completion_starts_give_the_row_by_row_logps_and_gradients(lora_model, monkeypatch, call_cost):
    monkeypatch.setattr(shared_prompt, "CALL_COST_TOKENS", call_cost)
    ids, mask, width, score = _batch_with_common_starts()
    weights = torch.linspace(-1, 1, ids.shape[0])[:, None]
    params = [p for p in lora_model.parameters() if p.requires_grad]
    ref = _row_by_row(lora_model, ids, mask, width)
    ref_grads = torch.autograd.grad((ref * score * weights).sum(), params)
    for share in (True, False):
        logps, ent = grouped_logps(lora_model, ids, mask, width, score, compute_entropy=True,
                                   share_completions=share)
        grads = torch.autograd.grad((logps * score * weights).sum(), params)
        assert torch.allclose(logps * score, ref * score, atol=1e-5)
        assert bool((logps[score == 0] == 0).all())
        assert ent is not None and bool((ent[score.bool()] > 0).all()) and bool((ent[score == 0] == 0).all())
        # fp32 sums in another order: on a 2-core AMD EPYC the gradients (|g| up to ~3) differed from the row-by-row
        # pass's by up to 4.8e-5, 1.7e-5 past atol 1e-5 + rtol 1e-4; a wrong span or mask moves them by O(1)
        for a, b in zip(grads, ref_grads):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_nothing_to_score_gives_zeros_and_an_empty_prompt_is_refused(lora_model):
    ids, mask, width, score = _batch()
    logps, ent = grouped_logps(lora_model, ids, mask, width, torch.zeros_like(score), compute_entropy=True)
    assert bool((logps == 0).all()) and ent is not None and bool((ent == 0).all())
    mask[0, :7] = 0
    with pytest.raises(ValueError, match="empty prompt"):
        grouped_logps(lora_model, ids, mask, width, score)


def test_shared_spans_end_at_breaks():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 7, 8]]
    spans = shared_spans(seqs, breaks=[3, 3, 1])
    assert spans == [
        Span((0, 1, 2), 0, 1, -1),  # row 2's break cuts the common start; past it, row 2 shares no more
        Span((0, 1), 1, 3, 0), Span((0, 1), 3, 4, 1),  # rows 0 and 1 break at 3 and share on
        Span((0,), 4, 5, 2), Span((1,), 4, 5, 2),
        Span((2,), 1, 4, 0)]
    # a row's own part is cut at its break too, and the part after it is never batched with its siblings
    spans = shared_spans([[1, 2, 3, 4], [1, 5, 6]], breaks=[3, 2])
    assert spans == [Span((0, 1), 0, 1, -1), Span((0,), 1, 3, 0), Span((0,), 3, 4, 1), Span((1,), 1, 2, 0),
                     Span((1,), 2, 3, 3)]
    assert leaf_batches(spans, call_cost=10**6) == [[2], [4]]


@pytest.mark.parametrize("share", [True, False])
def test_without_prompt_grad_the_logps_stay_and_the_gradient_is_the_detached_prompts(lora_model, share):
    ids, mask, width, score = _batch_with_common_starts()
    weights = torch.linspace(-1, 1, ids.shape[0])[:, None]
    params = [p for p in lora_model.parameters() if p.requires_grad]
    ref = _row_by_row(lora_model, ids, mask, width, detach_prompt=True)
    ref_grads = torch.autograd.grad((ref * score * weights).sum(), params)
    full_grads = torch.autograd.grad((_row_by_row(lora_model, ids, mask, width) * score * weights).sum(), params)
    logps, _ = grouped_logps(lora_model, ids, mask, width, score, share_completions=share, prompt_grad=False)
    grads = torch.autograd.grad((logps * score * weights).sum(), params)
    assert torch.allclose(logps * score, ref * score, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    # the prompt's part of the gradient is really left out
    assert max(float((a - b).abs().max()) for a, b in zip(grads, full_grads)) > 1e-3


def test_a_prompt_is_never_shared_with_a_row_past_its_own_prompt(lora_model):
    """Row 1's prompt and completion are the start of row 0's prompt: the tokens they have in common are prompt
    for row 0 and completion for row 1, so they run twice, without gradient for row 0 and with it for row 1."""
    assert shared_spans([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4]], breaks=[4, 1]) == [
        Span((0, 1), 0, 1, -1), Span((0,), 1, 4, 0), Span((0,), 4, 6, 1), Span((1,), 1, 4, 0)]
    toks = [11, 12, 13, 14, 15, 16]
    ids, mask = torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long)
    ids[0, :5], mask[0, :6], ids[0, 5] = torch.tensor(toks[:5]), 1, toks[5]  # prompt of 5, completion of 1
    ids[1, 3:5], ids[1, 5:7], mask[1, 3:7] = torch.tensor(toks[:2]), torch.tensor(toks[2:4]), 1  # 2 and 2
    width, score = 2, mask[:, 5:].clone()
    weights = torch.tensor([[1.0], [-0.5]])
    params = [p for p in lora_model.parameters() if p.requires_grad]
    ref = _row_by_row(lora_model, ids, mask, width, detach_prompt=True)
    ref_grads = torch.autograd.grad((ref * score * weights).sum(), params)
    logps, _ = grouped_logps(lora_model, ids, mask, width, score, prompt_grad=False)
    grads = torch.autograd.grad((logps * score * weights).sum(), params)
    assert torch.allclose(logps * score, ref * score, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prompt_grad", [True, False])
def test_a_prefix_computed_once_for_several_passes_gives_the_one_pass_logps_and_gradients(lora_model, prompt_grad):
    """An iteration split in passes, the rows' common start computed once (`SharedPrefix`): each pass's log-probs
    are the one-pass values, and the summed gradients once `backward()` has carried the prefix's part are the
    one-pass gradients. The passes cover both cases: a pass whose common start is the prefix (rows 0 and 3) and
    passes whose rows share more than it."""
    ids, mask, width, score = _batch()
    weights = torch.linspace(-1, 1, ids.shape[0])[:, None]
    params = [p for p in lora_model.parameters() if p.requires_grad]
    logps, _ = grouped_logps(lora_model, ids, mask, width, score, prompt_grad=prompt_grad)
    ref_grads = torch.autograd.grad((logps * score * weights).sum(), params)

    prefix = SharedPrefix(ids[0][mask[0].bool()][:4].tolist(), grad=prompt_grad)  # what all six rows start with
    for p in params:
        p.grad = None
    try:
        for rows in ([0, 3], [1, 2], [4, 5]):
            part, _ = grouped_logps(lora_model, ids[rows], mask[rows], width, score[rows], prompt_grad=prompt_grad,
                                    prefix=prefix)
            assert prefix.cache is not None  # used, not run again
            assert torch.allclose(part * score[rows], logps[rows] * score[rows], atol=1e-5)
            (part * score[rows] * weights[rows]).sum().backward()
        assert prefix.uses == 3
        prefix.backward()
        assert prefix.cache is None and prefix.uses == 0  # spent
        for p, ref in zip(params, ref_grads):
            assert torch.allclose(p.grad, ref, atol=1e-5, rtol=1e-4)
    finally:
        for p in params:
            p.grad = None


def test_a_prefix_some_row_does_not_start_with_is_not_used(lora_model):
    ids, mask, width, score = _batch()
    logps, _ = grouped_logps(lora_model, ids, mask, width, score)
    other = SharedPrefix([5, 6, 7])
    with torch.no_grad():
        assert torch.equal(grouped_logps(lora_model, ids, mask, width, score, prefix=other)[0], logps.detach())
    assert other.cache is None and other.uses == 0
    assert not other.fits([[5, 6, 7, 8]], first_scored=[2])  # a scored position inside the prefix
    assert other.fits([[5, 6, 7, 8], []], first_scored=[3, 0])


def test_a_prefix_computed_by_one_model_is_not_used_by_another(lora_model, tiny_model_dir):
    ids, mask, width, score = _batch()
    prefix = SharedPrefix(ids[0][mask[0].bool()][:4].tolist())
    with torch.no_grad():
        grouped_logps(lora_model, ids, mask, width, score, prefix=prefix)
        assert prefix.uses == 1
        other = load_policy(tiny_model_dir).model
        want = grouped_logps(other, ids, mask, width, score)[0]
        assert torch.equal(grouped_logps(other, ids, mask, width, score, prefix=prefix)[0], want)
    assert prefix.uses == 1
    prefix.backward()


def test_a_decoder_that_keeps_no_cache_is_refused(tiny_model_dir):
    """With activation checkpointing on, a decoder in training mode drops the KV cache the pass continues from: an
    error naming it, not log-probs of children that attended to nothing."""
    model = load_policy(tiny_model_dir, attn_implementation="sdpa").model
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, mask, width, score = _batch()
    with pytest.raises(RuntimeError, match="activation checkpointing"):
        grouped_logps(model, ids, mask, width, score)
    with pytest.raises(RuntimeError, match="activation checkpointing"):
        grouped_logps(model, ids, mask, width, score, prefix=SharedPrefix(ids[0][mask[0].bool()][:4].tolist()))


def test_grouped_logps_refuse_a_temperature_of_zero(tiny_model_dir):
    from trace_lib.training.shared_prompt import grouped_logps

    with pytest.raises(ValueError, match="temperature must be > 0"):
        grouped_logps(None, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), 1,
                      temperature=0.0)
