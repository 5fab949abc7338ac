"""bf16 linear layers with oneDNN-packed weights (engine/packed.py): the same outputs as `F.linear`, the plain
path wherever a gradient is recorded, and packed copies rebuilt when weights change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trace_lib.engine import packed
from trace_lib.engine.packed import PackedForward, install_packed_linears, packed_layers, packing_available
from trace_lib.engine.policy import load_policy
from trace_lib.records import Message
from trace_lib.engine.compose import merged_adapters

needs_packing = pytest.mark.skipif(not packing_available(), reason="this torch build or CPU has no oneDNN bf16 "
                                   "packed linear ops (engine/packed.py falls back to F.linear there)")


def bf16_linear(n_in: int, n_out: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16)


@needs_packing
@pytest.mark.parametrize("shape", [(1, 64), (16, 64), (3, 7, 64), (2, 40, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_is_f_linear_to_the_bit(shape, bias):
    layer = bf16_linear(64, 96, bias)
    plain = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    plain.load_state_dict(layer.state_dict())
    assert install_packed_linears(layer) == 1
    x = torch.randn(*shape, dtype=torch.bfloat16)
    with torch.inference_mode():
        got, want = layer(x), plain(x)
    assert isinstance(layer.forward, PackedForward) and layer.forward.packed is not None  # the packed path ran
    assert got.shape == want.shape and torch.equal(got, want)
    with torch.inference_mode():  # a non-contiguous input too: every row's last position, as a prefill's logits take
        xt = torch.randn(*shape[:-1], 3, shape[-1], dtype=torch.bfloat16)[..., -1, :]
        assert not xt.is_contiguous() or xt.shape[0] == 1
        assert torch.equal(layer(xt), plain(xt))  # (with a bias, a strided input takes F.linear: see packed.py)


@needs_packing
def test_packed_product_is_f_linear_at_two_threads_too():
    """The pipeline decodes at 2 threads (the tests run at 1): the bits do not depend on the thread count."""
    layer = bf16_linear(576, 1536, bias=False)
    want = {}
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            install_packed_linears(layer)
            x = torch.randn(16, 576, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(n))
            with torch.inference_mode():
                want[n] = (layer(x), F.linear(x, layer.weight))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in want.values())


@needs_packing
def test_a_packed_model_copies_and_pickles_without_its_packed_copies():
    import copy
    import io

    model = nn.Sequential(bf16_linear(16, 8, bias=True))
    install_packed_linears(model)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)  # builds the (unpicklable) packed copy
    twin = copy.deepcopy(model)
    assert twin[0].forward.layer is twin[0] and twin[0].forward.packed is None
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(twin(x), want) and torch.equal(loaded(x), want)


@needs_packing
def test_a_dropped_packed_model_is_freed_without_the_cyclic_collector():
    import gc
    import weakref

    model = nn.Sequential(bf16_linear(16, 8, bias=False), bf16_linear(8, 4, bias=True))
    assert install_packed_linears(model) == 2
    with torch.no_grad():
        model(torch.randn(2, 16, dtype=torch.bfloat16))  # builds the packed copies
    layers = [weakref.ref(m) for m in model]
    weight = weakref.ref(model[0].weight)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del model
        assert all(ref() is None for ref in layers) and weight() is None  # freed by reference counting alone
    finally:
        if enabled:
            gc.enable()


@needs_packing
def test_gradients_take_the_plain_path():
    layer = bf16_linear(32, 16, bias=True)
    plain = bf16_linear(32, 16, bias=True)
    install_packed_linears(layer)
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    layer(x).float().sum().backward()
    plain(x2).float().sum().backward()
    assert layer.forward.packed is None  # never packed: every call recorded a gradient
    assert torch.equal(x.grad, x2.grad) and torch.equal(layer.weight.grad, plain.weight.grad)


@needs_packing
def test_a_weight_changed_in_place_is_packed_again():
    layer = bf16_linear(32, 16, bias=False)
    install_packed_linears(layer)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        first = layer(x)
        layer.weight.mul_(2)  # an optimizer-style write: the version moves
        assert torch.equal(layer(x), F.linear(x, layer.weight))
        assert not torch.equal(layer(x), first)
        layer.weight.data.add_(1)  # through .data: no version bump, so the copy is stale until invalidate()
        stale = layer(x)
        assert not torch.equal(stale, F.linear(x, layer.weight))
        packed.invalidate()
        assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_only_bf16_cpu_linears_are_given_the_packed_forward(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), bf16_linear(8, 8, bias=False), nn.Embedding(4, 8).to(torch.bfloat16))
    if packing_available():
        assert install_packed_linears(model) == 1
        assert install_packed_linears(model) == 0  # installing twice wraps nothing twice
        assert packed_layers(model) == 1 and not isinstance(model[0].__dict__.get("forward"), PackedForward)
    monkeypatch.setattr(packed, "packing_available", lambda: False)
    fresh = nn.Sequential(bf16_linear(8, 8, bias=False))
    assert install_packed_linears(fresh) == 0 and packed_layers(fresh) == 0


def test_fp32_and_unpacked_policies_have_no_packed_layers(tiny_model_dir):
    assert packed_layers(load_policy(tiny_model_dir).model) == 0  # fp32 weights keep F.linear
    assert packed_layers(load_policy(tiny_model_dir, dtype="bfloat16", packed=False).model) == 0


@needs_packing
def test_bf16_policy_decodes_the_same_tokens_packed_or_not(tiny_model_dir):
    """Sampled multi-turn episodes with kept sessions, packed against `F.linear`: the same text."""
    texts = {}
    for use in (False, True):
        pol = load_policy(tiny_model_dir, dtype="bfloat16", packed=use)
        assert (packed_layers(pol.model) > 0) == use
        convs = [[Message(role="system", content="You help customers with their orders. " * 8),
                  Message(role="user", content=f"Where is order #W{i}00{i}?")] for i in range(4)]
        out = []
        for turn in range(2):
            gens = pol.generate(convs, [], temperature=0.8, max_new_tokens=12, seed=turn, sessions=list(range(4)))
            for conv, g in zip(convs, gens):
                out.append(g.text)
                conv += [Message(role="assistant", content=g.text), Message(role="user", content="And then?")]
        texts[use] = out
        built = [m.forward.packed is not None for m in pol.model.modules() if isinstance(m.__dict__.get("forward"),
                                                                                         PackedForward)]
        assert (bool(built) and all(built)) == use  # every packed layer ran its packed product
    assert texts[True] == texts[False]


@needs_packing
def test_a_merge_is_seen_by_the_packed_layers_and_undone_after(tiny_model_dir, tmp_path):
    """`merged_adapters` rewrites weights through `.data` (no version bump): the packed copies follow it in and out."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "a")
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])

    def run(pol, merged: bool) -> torch.Tensor:
        with torch.inference_mode():
            if merged:
                with merged_adapters(pol.model, {"a": 1.0}):
                    return pol.model(input_ids=ids).logits
            with pol.model.disable_adapter():
                return pol.model(input_ids=ids).logits

    pol = load_policy(tiny_model_dir, dtype="bfloat16", adapters={"a": str(tmp_path / "a")})
    ref = load_policy(tiny_model_dir, dtype="bfloat16", adapters={"a": str(tmp_path / "a")}, packed=False)
    before = run(pol, merged=False)  # packs the base weights
    assert torch.equal(before, run(ref, merged=False))
    inside = run(pol, merged=True)
    assert torch.equal(inside, run(ref, merged=True)) and not torch.equal(inside, before)
    assert torch.equal(run(pol, merged=False), before)
