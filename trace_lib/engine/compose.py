"""Adapter composition: run a task with one adapter, or with an α-weighted merge of several.

Reads a model with named PEFT LoRA adapters loaded (a `Policy` from `load_policy(..., adapters=...)`)
and a routing decision; writes nothing to disk. Implements the composition half of the paper's §3.4:
for one task the base weights become W + Σ_c α_c·ΔW_c with ΔW_c = B_c A_c · scaling_c, and the
cached base weights come back afterwards.

Two paths, both exact:

* one adapter at full weight: `use_adapter` activates it through PEFT (the LoRA forward path, no
  weight change);
* anything else: `merged_adapters` adds Σ α_c ΔW_c into the base weights of every LoRA-targeted
  module, with the adapter layers disabled inside so no delta counts twice, and copies the cached
  originals back on exit — also when the body raises — so the base weights are bit-identical
  afterwards. Only touched weights are cached (for a 7-module LoRA that is most of a transformer's
  matmul weights: budget one extra copy of them, on the same device).

Why not PEFT's `add_weighted_adapter`: its 'linear' combination mixes the A's and the B's separately
((Σ√α B)(Σ√α A) has cross terms, not Σ α BA) and needs equal ranks; its 'cat' combination is exact
but registers a new adapter of summed rank per task (to be deleted afterwards) and keeps the extra
low-rank matmuls at every decoding step, whereas a merge costs one addition per weight per task and
decodes at base-model speed. PEFT's own `merge`/`unmerge` would do the arithmetic per adapter but
restore by subtraction, which is not bit-exact in floating point. So the merge here uses PEFT's
public per-layer `get_delta_weight` (which handles scaling and fan_in_fan_out) and its
`disable_adapter` context, and keeps the restore exact by caching.

A server cannot have its base weights edited per task; there a merge is served as one adapter of
summed rank, PEFT's `cat` combination computed on the adapters' files (`engine.adapters.cat_adapter`),
which the server loads by name (`engine.remote.OpenAIPolicy.use_route`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from trace_lib.engine import packed
from trace_lib.engine.adapters import active_weights, lora_layers, merge_label, sole_adapter

__all__ = ["apply_route", "is_merged", "merge_label", "merged_adapters", "use_adapter", "use_weights"]

_MERGED = "_trace_merged"
"""Attribute set on a model while its base weights hold a merge (checked by the router and here)."""


def is_merged(model: Any) -> bool:
    """Whether `model`'s base weights currently hold a merge (inside `merged_adapters`)."""
    return bool(getattr(model, _MERGED, False))


def _has_adapter(layer: Any, name: str) -> bool:
    return name in layer.lora_A or name in getattr(layer, "lora_embedding_A", {})


@contextmanager
def merged_adapters(model: Any, weights: Mapping[str, float]) -> Iterator[Any]:
    """Inside: base weights W + Σ α·ΔW of the named adapters, adapter layers off. Exact restore on exit."""
    if not hasattr(model, "peft_config"):
        raise ValueError("merged_adapters needs a PEFT model with named adapters loaded")
    if is_merged(model):
        raise RuntimeError("merged_adapters is already active on this model (merges do not nest)")
    unknown = sorted(set(weights) - set(model.peft_config))
    if unknown:
        raise ValueError(f"unknown adapter(s) {unknown}; loaded: {sorted(model.peft_config)}")
    active = {n: float(a) for n, a in weights.items() if float(a) != 0.0}
    layers = lora_layers(model)
    plan = []  # (layer, adapters present in it), checked before any weight is touched
    for layer in layers:
        names = [n for n in active if _has_adapter(layer, n)]
        if not names:
            continue
        variants = [n for n in names if n in getattr(layer, "lora_variant", {})]
        if variants:  # DoRA and friends rescale the merged weight; Σ α ΔW is not their merge
            raise NotImplementedError(f"adapter(s) {variants} use a LoRA variant (e.g. DoRA); only plain LoRA merges")
        if not layer.get_base_layer().weight.dtype.is_floating_point:
            raise NotImplementedError("merging into quantized base weights is not supported")
        plan.append((layer, names))

    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    with model.disable_adapter():
        setattr(model, _MERGED, True)
        try:
            with torch.no_grad():
                for layer, names in plan:
                    saved.extend(_merge_into(layer, names, active))
            packed.invalidate()  # the weights were rewritten through `.data`: no version bump tells the packed copies
            yield model
        finally:
            with torch.no_grad():
                for target, original in reversed(saved):
                    target.copy_(original)
            packed.invalidate()
            setattr(model, _MERGED, False)


def _merge_into(layer: Any, names: list[str], alpha: Mapping[str, float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Add Σ α·ΔW (and α·bias for lora_bias adapters) into one layer's base; returns (tensor, copy) to restore."""
    base = layer.get_base_layer()
    # Sum the deltas in float32 and round once: a bf16 model would otherwise lose small α·ΔW terms
    # to repeated rounding.
    delta = sum(alpha[n] * layer.get_delta_weight(n).float() for n in names)
    saved = [(base.weight.data, base.weight.data.clone())]
    base.weight.data.copy_((base.weight.data.float() + delta).to(base.weight.dtype))
    bias_names = [n for n in names if getattr(layer, "lora_bias", {}).get(n)]
    if bias_names:
        saved.append((base.bias.data, base.bias.data.clone()))
        extra = sum(alpha[n] * layer.lora_B[n].bias.float() * layer.scaling[n] for n in bias_names)
        base.bias.data.copy_((base.bias.data.float() + extra).to(base.bias.dtype))
    return saved


@contextmanager
def use_adapter(policy: Any, name: str | None) -> Iterator[Any]:
    """Run `policy` with adapter `name` (None: base model); the previous adapter comes back on exit."""
    if is_merged(policy.model):
        raise RuntimeError("use_adapter inside merged_adapters: the merge already replaced the adapters")
    prev = policy.adapter
    prev_active = policy.model.active_adapter if policy.adapters else None
    policy.set_adapter(name)
    try:
        yield policy
    finally:
        if prev_active is not None:
            policy.model.set_adapter(prev_active)
        policy.adapter = prev


@contextmanager
def use_weights(policy: Any, weights: Mapping[str, float]) -> Iterator[Any]:
    """Run `policy` on base + Σ α·ΔW. Its adapter name becomes `merge_label(weights)`, which keeps the
    Policy's prefix KV cache (keyed by adapter) apart from the base model's and shows in policy_id."""
    prev = policy.adapter
    with merged_adapters(policy.model, weights):
        # Not set_adapter: the label is no PEFT adapter. With a non-None name the Policy does not
        # disable adapters itself, and merged_adapters keeps them off.
        policy.adapter = merge_label(weights)
        try:
            yield policy
        finally:
            policy.adapter = prev


@contextmanager
def apply_route(policy: Any, route: Any) -> Iterator[Any]:
    """Run `policy` as a routing decision says: a `RouteDecision` or an {adapter: α} dict.

    Empty -> base model; one adapter at α = 1 -> that adapter (PEFT path); otherwise a merge. A served
    policy (`engine.remote.OpenAIPolicy`) serves the route itself (`use_route`: a merge is one `cat` adapter).
    """
    weights = active_weights(dict(getattr(route, "weights", route)))
    if hasattr(policy, "use_route"):
        with policy.use_route(weights):
            yield policy
        return
    if not weights or sole_adapter(weights):
        with use_adapter(policy, sole_adapter(weights)):
            yield policy
    else:
        with use_weights(policy, weights):
            yield policy
