"""Per-row LoRA routes: one decoding batch whose rows run under different adapters or merges.

Reads the named PEFT LoRA adapters loaded into a policy's model; writes nothing. Used by
`Policy.play_turns(routes=...)`, which the evaluate stage uses to decode every method's episodes (the base
model, each baseline adapter, each capability adapter, the linear merge: the paper's Table 1 rows) in one
batch instead of one batch per method.

Why: a decoding step on a 2-core CPU costs about the same for 1 row as for 16 (it streams every weight
once; `benchmarks/README.md`, linear_dtype.py), so a stage that decodes seven methods' 14 tasks as seven
batches pays seven times the steps it needs. PEFT can mix adapters in one batch (`adapter_names`), but it
loops over the adapters in every LoRA layer (a gather, two products and a scatter per adapter and layer:
~5 ops x adapters x 210 layers a step) and cannot give a row a weighted merge. Here every LoRA layer
computes its adapters' deltas as one concatenated adapter (PEFT's `cat` combination, `engine.adapters`):

    y = W x + B_cat · ((A_cat x) ⊙ s_row),   s_row = α_c · scaling_c on adapter c's rank slice, 0 elsewhere

two products per layer whatever the number of adapters, and a row's route may be the base model (s = 0),
one adapter (α = 1) or any α-weighted merge (Σ_c α_c ΔW_c exactly, in float32 as PEFT computes LoRA).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from trace_lib.engine.adapters import active_weights, lora_layers
from trace_lib.engine.kvcache import RowRoutes, current_row_routes

__all__ = ["RoutedLora", "supports_routes"]


def supports_routes(model: Any) -> str | None:
    """None when every LoRA layer of `model` is a plain linear LoRA (routes per row work); else why not."""
    from peft.tuners.lora import Linear

    for layer in lora_layers(model):
        if not isinstance(layer, Linear):
            return f"{type(layer).__name__} LoRA layers (only linear layers route per row)"
        if getattr(layer, "lora_variant", None):
            return "a LoRA variant (e.g. DoRA)"
        if getattr(layer, "merged", False):
            return "an adapter merged into the base weights"
        if any(getattr(layer, "lora_bias", {}).values()):
            return "LoRA bias"
    return None


class RoutedLora:
    """Context manager: inside, every LoRA layer of `model` adds to each row the delta of that row's route
    (`routes[k]`, {adapter: α}; {} is the base model), the row's route read from `kvcache.row_routes`.

    PEFT's own adapter state (active adapter, disabled adapters) is ignored inside and back on exit."""

    def __init__(self, model: Any, routes: Sequence[Mapping[str, float]]) -> None:
        why = supports_routes(model)
        if why:
            raise NotImplementedError(f"routes per row need plain LoRA layers; this model has {why}")
        self.routes = [active_weights(r) for r in routes]
        loaded = set(getattr(model, "peft_config", {}) or {})
        unknown = sorted({n for r in self.routes for n in r} - loaded)
        if unknown:
            raise ValueError(f"unknown adapter(s) {unknown}; loaded: {sorted(loaded) or 'none'}")
        names = sorted({n for r in self.routes for n in r})
        tables: dict[tuple, tuple[torch.Tensor, frozenset[int]]] = {}
        self._plan: list[tuple[Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor, frozenset[int]] | None]] = []
        with torch.no_grad():
            for layer in lora_layers(model):
                present = [n for n in names if n in layer.lora_A]
                if not present:
                    self._plan.append((layer, None))
                    continue
                a = torch.cat([layer.lora_A[n].weight for n in present])  # (Σ r, in)
                b = torch.cat([layer.lora_B[n].weight for n in present], dim=1)  # (out, Σ r)
                shape = (a.device, a.dtype,
                         *((n, layer.lora_A[n].weight.shape[0], float(layer.scaling[n])) for n in present))
                if shape not in tables:  # layers with the same adapters, ranks and scalings share one table
                    scale = torch.zeros(len(self.routes), a.shape[0], dtype=a.dtype)  # built on the CPU, sent once
                    start = 0
                    for n, r, scaling in shape[2:]:
                        for k, route in enumerate(self.routes):
                            scale[k, start:start + r] = route.get(n, 0.0) * scaling
                        start += r
                    used = frozenset(k for k in range(len(self.routes)) if bool(scale[k].any()))
                    tables[shape] = (scale.to(a.device), used)
                self._plan.append((layer, (a, b, *tables[shape])))

    def __enter__(self) -> RoutedLora:
        self._saved = [layer.__dict__.get("forward") for layer, _ in self._plan]  # e.g. another library's hook
        for layer, parts in self._plan:
            layer.forward = _routed_forward(layer, parts)  # an instance attribute shadows the class's forward
        return self

    def __exit__(self, *exc) -> bool:
        for (layer, _), saved in zip(self._plan, self._saved):
            if saved is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = saved
        return False


def _routed_forward(layer: Any, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor, frozenset[int]] | None):
    base = layer.base_layer

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = base(x, *args, **kwargs)
        if parts is None:
            return result
        a, b, scale, used = parts
        rows = current_row_routes()
        if rows is None:
            raise RuntimeError("a routed LoRA layer ran without the rows' routes (kvcache.row_routes)")
        if len(rows.routes) != x.shape[0]:
            raise ValueError(f"routes for {len(rows.routes)} rows, the batch has {x.shape[0]}")
        if not (rows.present & used):  # every row here is on the base model for this layer
            return result
        # A decoding step is ~210 small LoRA layers, where each tensor op's fixed cost is most of its time: the
        # rows' scales are gathered once per table and batch (not per layer), the input is cast to float32
        # once for the projections that share it (q/k/v, gate/up), and the delta is added in place, in
        # float32 and rounded once, as PEFT's `result + delta` then `.to(result.dtype)` does.
        h = F.linear(_as_dtype(rows.memo, x, a.dtype), a)
        h.mul_(_row_scales(rows, scale, x.dim()))
        return result.add_(F.linear(h, b))

    return forward


def _row_scales(rows: RowRoutes, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """`scale`'s row for each batch row, shaped to broadcast over an input of `dim` dimensions; gathered once
    per (table, batch) and kept in the batch's `RowRoutes.memo`."""
    key = ("scale", id(scale), dim)
    held = rows.memo.get(key)
    if held is None or held[0] is not scale:  # the table itself is held: its id cannot be reused meanwhile
        held = rows.memo[key] = (scale, scale[rows.index].view(len(rows.routes), *([1] * (dim - 2)), -1))
    return held[1]


def _as_dtype(memo: dict, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`. In a decoding step (one position per row) the last input's cast is kept, so the
    projections that read one input cast it once; a prefill's inputs are cast each time and not held (they
    are large, and their products, not the casts' fixed costs, are most of their time)."""
    if x.dtype == dtype:
        return x
    held = memo.pop("input", None)  # dropped before a new cast: never two held at once
    if held is not None and held[0] is x and held[1].dtype == dtype:
        memo["input"] = held
        return held[1]
    cast = x.to(dtype)
    if x.dim() >= 2 and x.shape[-2] == 1:
        memo["input"] = (x, cast)
    return cast
