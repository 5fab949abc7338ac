"""bf16 linear layers on the CPU through oneDNN with each weight reordered once, not at every call.

Reads and writes nothing on disk; `load_policy` installs it on the policy's model (CPU, bf16 weights).

torch's bf16 `F.linear` on the CPU hands the weight to oneDNN as a plain row-major matrix, and oneDNN
reorders it into its blocked layout inside every call. At a decoding step's shapes (16 rows, SmolLM2's
576x576 to 576x1536 projections) that reorder is most of the product's time, so the weights are reordered
once (`_reorder_linear_weight`, the packing torch's own inductor uses when it freezes a CPU model;
docs/LOG.md, "packed weights"). The packed product computes the same kernel on the same blocks, so
its outputs are those of `F.linear` (a test checks it). torch.compile would pack the same way but made a
decoding step slower here (benchmarks/compile_decode.py), so the two oneDNN calls are made directly.

The packed copy is used only where no gradient is recorded (`torch.is_grad_enabled()` false: decoding,
the router's label logits, the loss pass's no-gradient prompt) and only for bf16 weights and inputs on
the CPU; anywhere else the layer runs `F.linear` as before. A packed copy is rebuilt when its weight's
storage or version changes, or after `invalidate()`: writes through `tensor.data` bump no version, so
code that rewrites weights that way (`engine.compose.merged_adapters`) calls it. PEFT's own `merge`/`unmerge`
write through `.data` too; trace never calls them on a packed model, and code that does must call `invalidate()`.
Whether packed and plain products agree bit for bit depends on the kernels oneDNN picks for the CPU; runs record
whether packing was available (`engine.model.numerics`, `packed_linears`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROWS_HINT = 16
"""The row count oneDNN is told to pack for (the CPU default's decoding batch); any row count runs."""

_generation = 0


def invalidate() -> None:
    """Mark every packed weight stale (after weights were rewritten in place without a version bump)."""
    global _generation
    _generation += 1


def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear ops and bf16 kernels for this CPU."""
    try:
        ops = torch.ops.mkldnn
        return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                and hasattr(ops, "_linear_pointwise") and bool(ops._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


class PackedForward:
    """A `nn.Linear`'s forward: the packed product where it applies (see the module docstring), else `F.linear`.

    It holds its layer weakly: the layer holds it (as `forward` in its `__dict__`), and a strong reference back
    would make each layer and its packed copy a reference cycle, so a dropped model's weights and their packed
    copies (~270 MB each for SmolLM2 in bf16) would wait for the cyclic garbage collector instead of being freed
    at once."""

    __slots__ = ("_layer", "key", "packed")

    def __init__(self, layer: nn.Linear) -> None:
        self._layer = weakref.ref(layer)
        self.key: tuple[int, int, int] | None = None
        self.packed: torch.Tensor | None = None

    @property
    def layer(self) -> nn.Linear:
        layer = self._layer()
        if layer is None:
            raise ReferenceError("the layer of this packed forward was freed")
        return layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        weight, bias = layer.weight, layer.bias
        if (torch.is_grad_enabled() or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
                or x.device.type != "cpu" or weight.device.type != "cpu"
                or (bias is not None and not x.is_contiguous())):
            # F.linear adds a bias to a strided input's product apart (rounded twice), where oneDNN fuses it
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version, _generation)
        packed = self.packed
        if key != self.key or packed is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
            self.packed, self.key = packed, key
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, packed, None if bias is None else bias.detach(), "none", [], "")

    def __reduce__(self) -> tuple[type, tuple[nn.Linear]]:
        # A packed copy is an opaque oneDNN tensor that neither pickles nor deep-copies: a copied or saved model
        # gets the forward without it and packs again on first use.
        return (PackedForward, (self.layer,))


def install_packed_linears(model: Any) -> int:
    """Give every bf16 CPU `nn.Linear` of `model` the packed forward; returns how many layers got it (0 where
    `packing_available()` is false). Layers whose weights are not bf16 now keep `F.linear` at every call."""
    if not packing_available():
        return 0
    count = 0
    for module in model.modules():
        if (type(module) is nn.Linear and module.weight.dtype == torch.bfloat16
                and module.weight.device.type == "cpu" and not _is_packed(module)):
            module.forward = PackedForward(module)
            count += 1
    return count


def _is_packed(module: nn.Module) -> bool:
    """Whether `module` runs the packed forward (set on the instance by `install_packed_linears`)."""
    return isinstance(module.__dict__.get("forward"), PackedForward)


def packed_layers(model: Any) -> int:
    """How many layers of `model` run the packed forward."""
    return sum(_is_packed(m) for m in model.modules())
