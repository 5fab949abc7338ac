"""The shared-prompt GRPO pass equals the row-by-row computation: log-probs and LoRA gradients."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trace_lib.agent.policy import load_policy
from trace_lib.training.shared_prompt import grouped_logps, prompt_groups


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


def _row_by_row(model, ids, mask, width):
    out = []
    for i in range(ids.shape[0]):
        keep = mask[i].bool()
        row = ids[i][keep][None]
        logits = model(input_ids=row).logits.float().log_softmax(-1)
        n = int(mask[i, -width:].sum())
        plen = row.shape[1] - n
        picked = logits[0, plen - 1:-1].gather(-1, row[0, plen:, None]).squeeze(-1)
        out.append(torch.cat([picked, picked.new_zeros(width - n)]))
    return torch.stack(out)


def test_prompt_groups_ignore_padding():
    ids = torch.tensor([[0, 5, 6], [5, 6, 7], [0, 5, 6], [9, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    assert prompt_groups(ids, mask) == [[0, 2], [1], [3]]


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


def test_grouped_logps_skip_groups_with_nothing_to_score(lora_model):
    ids, mask, width, score = _batch()
    score[:3] = 0
    logps, _ = grouped_logps(lora_model, ids, mask, width, score)
    assert bool((logps[:3] == 0).all()) and bool((logps[3:][score[3:].bool()] != 0).all())
