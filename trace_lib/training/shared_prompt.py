"""Per-token log-probs of GRPO groups with each group's prompt computed once (paper §3.3 training step).

Reads and writes nothing; `trainer.AgentGRPOTrainer` calls `grouped_logps` in place of TRL's
`_get_per_token_logps_and_entropies` for text-only batches.

Why our own: the K rollouts of a GRPO group start with the same prompt (system turn, tool list,
task), ~650 tokens on a synthetic environment and ~1.8k on retail, while each episode's own part is
a few hundred tokens. TRL runs every row's prompt through the forward and backward pass again;
here each distinct prompt runs once (batch 1) with its gradient, and the group's completions
attend to its keys and values, so the gradient through the prompt is the sum over the group, exactly
as in the row-by-row computation. Log-probs (and entropies) are computed only at the positions the
loss reads (the agent's tokens), not at the environment's tokens or padding; elsewhere they are 0,
which the loss multiplies by a zero mask anyway. `benchmarks/train_step.py` measures it against TRL.
"""

from __future__ import annotations

from typing import Any

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


def _expand(cache: DynamicCache, k: int) -> DynamicCache:
    """A cache whose k rows all start with `cache`'s single row (views; gradients flow back)."""
    out = DynamicCache()
    for idx, layer in enumerate(cache.layers):
        out.update(layer.keys.expand(k, -1, -1, -1), layer.values.expand(k, -1, -1, -1), idx)
    return out


def _low_precision(model: Any):
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


def grouped_logps(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    score_mask: torch.Tensor | None = None,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropies), each (rows, logits_to_keep), of the completion tokens.

    `input_ids` rows are [left-padded prompt | right-padded completion] as TRL builds them;
    `score_mask` (rows, logits_to_keep) marks the positions to score (default: the completion's
    attention mask); other positions are 0. The tokens all prompts share (the system turn and tool
    list) run once for the whole batch, each group's own rest of the prompt once per group.
    """
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
    with _low_precision(model):
        shared_len = _common_length(unpadded) if len(groups) > 1 else 0
        shared = DynamicCache()
        if shared_len:
            decoder(input_ids=unpadded[0][None, :shared_len], past_key_values=shared, use_cache=True)
        for rows, prompt in zip(groups, unpadded):
            k, plen = len(rows), prompt.shape[0]
            cache = _expand(shared, 1) if shared_len else DynamicCache()
            hidden_p = decoder(input_ids=prompt[None, shared_len:], past_key_values=cache, use_cache=True,
                               position_ids=torch.arange(shared_len, plen, device=prompt.device)[None],
                               ).last_hidden_state
            length = int(c_mask[rows].sum(-1).max())  # completions are right-padded
            mask = torch.cat([c_mask.new_ones(k, plen), c_mask[rows, :length]], dim=1)
            positions = torch.arange(plen, plen + length, device=input_ids.device)[None].expand(k, -1)
            hidden_c = decoder(input_ids=completions[rows, :length], attention_mask=mask, position_ids=positions,
                               past_key_values=_expand(cache, k), use_cache=True).last_hidden_state
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
