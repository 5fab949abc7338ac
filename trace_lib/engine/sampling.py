"""Sampling one token per row: each row from its own generator, so a row's tokens never depend on its batch.

Reads and writes nothing. Used by the decoding loop (`engine/decoding.py`); temperature 0 is greedy.
"""

from __future__ import annotations

import torch

from trace_lib.engine.chat import row_seed


def row_generators(seed: int, n: int, device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per row, seeded by the row's index: a row's draws never depend on the other rows.
    CPU generators on the CPU; on an accelerator, generators of that device (`sample_tokens`)."""
    return [torch.Generator(device=torch.device(device)).manual_seed(row_seed(seed, i)) for i in range(n)]


def exponential_draw(probs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """One index per row of `probs`, drawn as `torch.multinomial` draws one sample (the argmax of p / q
    with q ~ Exp(1)), each row's q from its own generator, on the generators' device. Rows that are not
    a distribution (NaN, inf, negative, or all zero) raise, as `torch.multinomial` does."""
    valid = (probs.isfinite() & (probs >= 0)).all(dim=-1) & (probs.sum(dim=-1) > 0)
    if not bool(valid.all()):
        rows = (~valid).nonzero().flatten().tolist()
        raise ValueError(f"rows {rows}: probabilities are not a distribution (NaN, inf, negative or all zero)")
    q = torch.empty_like(probs)
    for i, g in enumerate(gens):
        q[i].exponential_(1.0, generator=g)
    q.clamp_(min=torch.finfo(q.dtype).tiny)  # a 0 draw would make 0 / 0 = NaN, which argmax picks
    return (probs / q).argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float,
                  gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row: greedy at temperature 0, else nucleus sampling with each row's generator.
    `temperature` may be one per row (a 1-D tensor, every value above 0: rows of trainings that sample at
    different temperatures in one batch, `play_turns` with `temperature` per route).

    With CPU generators the probabilities are brought to the CPU for the draw (`torch.multinomial`) and
    the tokens go back to the logits' device. With generators of the logits' own device (a GPU), the draw
    stays there (`exponential_draw`): on a GPU machine the CPU draw (a serial kernel over the vocabulary per row)
    was most of a decoding step, where on the GPU it is one small kernel per row. A GPU's draws differ from the
    CPU's for the same seed (and may differ between GPU models); greedy decoding does not draw."""
    per_row = isinstance(temperature, torch.Tensor)
    if per_row and not bool((temperature > 0).all()):
        raise ValueError("temperatures per row must all be above 0 (greedy decoding is one temperature, 0)")
    if not per_row and temperature <= 0:
        return logits.argmax(dim=-1)
    device = logits.device
    on_device = device.type != "cpu" and bool(gens) and gens[0].device == device
    logits = logits.float() if on_device else logits.float().cpu()
    logits = logits / (temperature.to(logits.device, torch.float32)[:, None] if per_row else temperature)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if on_device:
        return exponential_draw(probs, gens)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gens)]).to(device)
