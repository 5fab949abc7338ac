"""LoRA adapter files: the name of a weighted merge, and a merge as one concatenated adapter.

Reads saved PEFT adapters (`adapter_config.json`, `adapter_model.safetensors`); writes the concatenated
adapter a server loads to serve an α-weighted route (`engine.remote.OpenAIPolicy.use_route`). No base
weights are read. The in-process merge is `engine.compose`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


def active_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """The adapters a route actually uses: nonzero weights as floats, in the given order."""
    return {n: float(a) for n, a in weights.items() if float(a) != 0.0}


def sole_adapter(weights: Mapping[str, float]) -> str | None:
    """The adapter's name when the (active) `weights` are one adapter at α = 1; None otherwise."""
    return next(iter(weights)) if len(weights) == 1 and next(iter(weights.values())) == 1.0 else None


def merge_label(weights: Mapping[str, float]) -> str:
    """A stable name for a weighted merge, e.g. 'merge[a=0.6,b=0.25]' (6 significant digits)."""
    return "merge[" + ",".join(f"{n}={float(w):.6g}" for n, w in sorted(weights.items())) + "]"


def canonical_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """A route's weights in one form: nonzero, as floats, sorted by adapter name (equal routes, equal dicts)."""
    return active_weights(dict(sorted(weights.items())))


def route_label(weights: Mapping[str, float]) -> str | None:
    """What a route's trajectories and caches call it: None (the base model), the adapter's name (one
    adapter at α = 1), or `merge_label` (any other weights)."""
    weights = canonical_weights(weights)
    return (sole_adapter(weights) or merge_label(weights)) if weights else None


def lora_layers(model: Any) -> list[Any]:
    """The PEFT LoRA layers of `model` (none without PEFT adapters loaded)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_REFUSED = {"use_dora": "DoRA", "lora_bias": "LoRA bias", "modules_to_save": "modules_to_save",
            "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
            "trainable_token_indices": "trainable tokens"}


def _adapter_scaling(config: Mapping[str, Any]) -> float:
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / r ** 0.5 if config.get("use_rslora") else alpha / r


def _read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(f"{folder} is not a saved PEFT adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config = json.loads(config_path.read_text())
    if config.get("peft_type") != "LORA":
        raise NotImplementedError(f"adapter {folder} is {config.get('peft_type')!r}, not LoRA")
    refused = [what for key, what in _REFUSED.items() if config.get(key) not in (None, False, {}, [], "none")]
    if config.get("bias", "none") != "none":
        refused.append(f"bias {config['bias']!r}")
    if refused:
        raise NotImplementedError(f"adapter {folder} uses {', '.join(refused)}: only plain LoRA concatenates")
    tensors = load_file(str(weights_path))
    if any("lora_embedding" in k for k in tensors):
        raise NotImplementedError(f"adapter {folder} adapts embeddings: only linear LoRA layers concatenate")
    return config, tensors


def adapter_is_identity(folder: Path) -> bool:
    """Whether a saved LoRA adapter leaves the base model unchanged: every `lora_B` matrix is all zeros.

    PEFT starts B at zero, and an adapter whose GRPO groups never had differing rewards is never moved
    (Adam's first step needs a nonzero gradient), so such a snapshot is the base model exactly. False
    when the folder holds no safetensors weights or no B matrix."""
    from safetensors import safe_open

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        return False
    seen = False
    with safe_open(str(path), framework="pt") as fh:
        for key in fh.keys():
            if "lora_B" in key:
                seen = True
                if bool(fh.get_tensor(key).any()):
                    return False
    return seen


def cat_adapter(folders: Mapping[str, Path], weights: Mapping[str, float]
                ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config, tensors) of one LoRA adapter whose delta is exactly Σ α_c·s_c·B_c·A_c.

    PEFT's `cat` combination (`add_weighted_adapter(combination_type="cat")`), computed on the saved
    adapters' tensors: per module, A is the adapters' A_c·α_c·s_c stacked along the rank (in the order
    of the sorted names; adapters without the module leave zero rows at the end) and B their B_c side
    by side; rank Σ r_c, lora_alpha Σ r_c, so its scaling is 1. Done on the files rather than with
    PEFT so that no base weights are loaded: a server may hold a model the evaluating machine cannot.
    `tests/engine/test_compose.py` checks the tensors equal PEFT's `cat` adapter's."""
    active = active_weights(weights)
    missing = sorted(set(active) - set(folders))
    if missing or not active:
        raise ValueError(f"no adapter folder for {missing}" if missing else "a merge needs a nonzero weight")
    read = {n: _read_adapter(Path(folders[n])) for n in sorted(active)}
    bases = {c.get("base_model_name_or_path") for c, _ in read.values()}
    if len(bases) > 1:
        raise ValueError(f"the adapters were trained on different base models: {sorted(map(str, bases))}")
    rank = sum(int(c["r"]) for c, _ in read.values())
    modules = sorted({k[: -len(".lora_A.weight")] for _, t in read.values() for k in t if k.endswith(".lora_A.weight")})
    tensors: dict[str, torch.Tensor] = {}
    for module in modules:
        # in float32 (PEFT upcasts adapter weights when it loads them) and A·α·s in this order, as PEFT's
        # cat computes it, so the tensors are PEFT's to the bit
        parts = [(t[f"{module}.lora_A.weight"].float() * active[n] * _adapter_scaling(c),
                  t[f"{module}.lora_B.weight"].float())
                 for n, (c, t) in read.items() if f"{module}.lora_A.weight" in t]
        a = torch.cat([p[0] for p in parts], dim=0)
        b = torch.cat([p[1] for p in parts], dim=1)
        tensors[f"{module}.lora_A.weight"] = torch.cat([a, a.new_zeros(rank - a.shape[0], a.shape[1])])
        tensors[f"{module}.lora_B.weight"] = torch.cat([b, b.new_zeros(b.shape[0], rank - b.shape[1])], 1)
    first = next(iter(read.values()))[0]
    targets = sorted({m for c, _ in read.values() for m in (
        [c["target_modules"]] if isinstance(c["target_modules"], str) else c["target_modules"])})
    config = {**first, "r": rank, "lora_alpha": rank, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {},
              "target_modules": targets[0] if len(targets) == 1 and isinstance(first["target_modules"], str)
              else targets, "inference_mode": True, **_cat_layers([c for c, _ in read.values()])}
    return config, tensors


def _cat_layers(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """The `layers_to_transform` and `layers_pattern` of the concatenation: None when any adapter covers every
    layer (`train.lora_layers` unset), else the union of the layers they cover, so that a loader does not drop the
    modules of an adapter whose layers the first one's config leaves out."""
    layers = [c.get("layers_to_transform") for c in configs]
    if any(v is None for v in layers):
        return {"layers_to_transform": None, "layers_pattern": None}
    union = sorted({i for v in layers for i in ([v] if isinstance(v, int) else v)})
    patterns = {json.dumps(c.get("layers_pattern")) for c in configs}
    if len(patterns) > 1:
        raise ValueError(f"the adapters name their layers differently (layers_pattern {sorted(patterns)})")
    return {"layers_to_transform": union, "layers_pattern": configs[0].get("layers_pattern")}


def adapter_digest(folders: Mapping[str, Path], weights: Mapping[str, float]) -> str:
    """A name for the concatenated adapter of `weights`: the weights and each adapter's file bytes, hashed."""
    active = active_weights(weights)
    h = hashlib.sha256(json.dumps({n: repr(a) for n, a in active.items()}, sort_keys=True).encode())
    for name in sorted(active):
        for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            h.update(hashlib.sha256((Path(folders[name]) / file).read_bytes()).digest())
    return "route-" + h.hexdigest()[:16]


def write_cat_adapter(folders: Mapping[str, Path], weights: Mapping[str, float], root: Path) -> Path:
    """The `cat_adapter` of `weights` saved under `root/<adapter_digest>` (reused when it is there)."""
    from safetensors.torch import save_file

    out = Path(root) / adapter_digest(folders, weights)
    if (out / ADAPTER_WEIGHTS).is_file():
        return out
    config, tensors = cat_adapter(folders, weights)
    Path(root).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=root))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS))
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / ADAPTER_WEIGHTS).is_file():  # another process did not win the race either
            raise
    return out
