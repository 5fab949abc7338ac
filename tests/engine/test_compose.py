"""Adapter composition: single adapter, exact weighted merges, bit-exact restore (tiny random model)."""

from __future__ import annotations

import json

import pytest
import torch
from lora_files import LLAMA_PROJECTIONS, explicit_model, logits, save_lora

from trace_lib.engine.policy import load_policy
from trace_lib.records import Message, RouteDecision
from trace_lib.engine.adapters import adapter_digest, cat_adapter, write_cat_adapter
from trace_lib.engine.compose import (
    apply_route,
    is_merged,
    merge_label,
    merged_adapters,
    use_adapter,
    use_weights,
)
from trace_lib.routing.route import label_probabilities, route_labels

@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    # different ranks and target sets: merges must not assume either is shared
    return {"a": save_lora(tiny_model_dir, root / "a", 1, r=4, alpha=8, targets=LLAMA_PROJECTIONS),
            "b": save_lora(tiny_model_dir, root / "b", 2, r=2, alpha=6, targets=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def policy(tiny_model_dir, adapter_dirs):
    return load_policy(tiny_model_dir, adapters={k: str(v) for k, v in adapter_dirs.items()}, policy_id="tiny")


@pytest.fixture(scope="module")
def ids(policy):
    texts = ["Hello, I need to cancel order #W123 please.", "What is the balance of my gift card?"]
    rows = [policy.encode(t) for t in texts]
    n = min(len(r) for r in rows)
    return torch.tensor([r[:n] for r in rows], device=policy.device)


def base_logits(policy, ids) -> torch.Tensor:
    with policy.model.disable_adapter():
        return logits(policy.model, ids)


def base_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_adapters_change_the_model(policy, ids):
    # guards the other tests: random LoRA deltas must move the logits well above the tolerances
    base = base_logits(policy, ids)
    with use_adapter(policy, "a"):
        assert (logits(policy.model, ids) - base).abs().max() > 1e-2
    with use_adapter(policy, "b"):
        assert (logits(policy.model, ids) - base).abs().max() > 1e-2


def test_merged_single_adapter_equals_active_adapter(policy, ids):
    for name in ("a", "b"):
        with use_adapter(policy, name):
            ref = logits(policy.model, ids)
        with merged_adapters(policy.model, {name: 1.0}):
            got = logits(policy.model, ids)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_weighted_merge_equals_explicit_weights(policy, ids, tiny_model_dir, adapter_dirs):
    weights = {"a": 0.7, "b": -0.45}
    with merged_adapters(policy.model, weights):
        got = logits(policy.model, ids)
    ref = logits(explicit_model(tiny_model_dir, adapter_dirs, weights), ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # and it is not just one of the two adapters
    with use_adapter(policy, "a"):
        assert (logits(policy.model, ids) - got).abs().max() > 1e-3


def test_base_weights_bit_identical_after_exit_and_after_exception(policy, ids):
    before = base_weights(policy.model)
    with use_adapter(policy, "a"):
        ref_a = logits(policy.model, ids)
    ref_base = base_logits(policy, ids)
    with merged_adapters(policy.model, {"a": 0.5, "b": 0.5}):
        inside = base_weights(policy.model)
        assert not all(torch.equal(before[n], inside[n]) for n in before)
    after = base_weights(policy.model)
    assert all(torch.equal(before[n], after[n]) for n in before)

    with pytest.raises(RuntimeError, match="boom"):
        with merged_adapters(policy.model, {"a": 0.3, "b": 1.2}):
            raise RuntimeError("boom")
    after = base_weights(policy.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    # adapters are back on, the base is the base again
    with use_adapter(policy, "a"):
        assert torch.equal(logits(policy.model, ids), ref_a)
    assert torch.equal(base_logits(policy, ids), ref_base)


def test_only_targeted_weights_change(policy):
    before = base_weights(policy.model)
    with merged_adapters(policy.model, {"b": 1.0}):  # b targets q, v, down only
        inside = base_weights(policy.model)
    changed = {n for n in before if not torch.equal(before[n], inside[n])}
    assert changed and all(any(t in n for t in ("q_proj", "v_proj", "down_proj")) for n in changed)
    assert len(changed) == 3 * 2  # 3 modules x 2 layers


def test_merge_guards(policy):
    with pytest.raises(ValueError, match="unknown adapter"):
        with merged_adapters(policy.model, {"zzz": 1.0}):
            pass
    with merged_adapters(policy.model, {"a": 0.5}):
        with pytest.raises(RuntimeError, match="do not nest"):
            with merged_adapters(policy.model, {"b": 0.5}):
                pass
        with pytest.raises(RuntimeError, match="merge already replaced"):
            with use_adapter(policy, "b"):
                pass
        with pytest.raises(RuntimeError, match="merged model"):
            label_probabilities(policy, None, ["Answer:"], route_labels(1))
    assert not is_merged(policy.model)


def test_use_adapter_restores_previous_state(policy):
    policy.set_adapter("b")
    with use_adapter(policy, "a"):
        assert policy.adapter == "a" and policy.model.active_adapter == "a"
        with use_adapter(policy, None):
            assert policy.adapter is None and policy.policy_id == "tiny"
        assert policy.adapter == "a"
    assert policy.adapter == "b" and policy.model.active_adapter == "b"
    policy.set_adapter(None)


def test_policy_generation_under_routes(policy):
    convs = [[Message(role="system", content="You are a retail agent. " * 6),
              Message(role="user", content=f"Where is my order #W{i}?")] for i in range(2)]

    def gen():
        return [g.text for g in policy.generate(convs, [], temperature=0.0, max_new_tokens=6, seed=0)]

    base = gen()  # fills the prefix cache for the base model
    with use_adapter(policy, "a"):
        with_a = gen()
    with use_weights(policy, {"a": 1.0}):
        assert policy.adapter == merge_label({"a": 1.0}) and policy.policy_id == "tiny+merge[a=1]"
        assert gen() == with_a  # the merge's own prefix KV, not the cached base one
    assert policy.adapter is None and gen() == base
    decision = RouteDecision(mode="top_p", candidates=["a", "b"], labels=[" A", " B", " C"],
                             probs=[0.5, 0.3, 0.2], weights={"a": 0.5, "b": 0.3})
    with apply_route(policy, decision):
        assert policy.adapter == "merge[a=0.5,b=0.3]"
    with apply_route(policy, {"a": 1.0}):
        assert policy.adapter == "a"
    with apply_route(policy, {}):
        assert policy.adapter is None
    assert policy.adapter is None and gen() == base


def peft_cat_tensors(model_dir, adapter_dirs, weights: dict[str, float]) -> dict[str, torch.Tensor]:
    """PEFT's own `add_weighted_adapter(combination_type="cat")` of the saved adapters, as saved."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    names = sorted(weights)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter_dirs[names[0]],
                                      adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    model.add_weighted_adapter(names, [weights[n] for n in names], "cat", combination_type="cat")
    return get_peft_model_state_dict(model, adapter_name="cat")


def test_cat_adapter_is_peft_cat_to_the_bit_and_serves_the_merge(policy, ids, tiny_model_dir, adapter_dirs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    weights = {"a": 0.7, "b": -0.45}
    config, tensors = cat_adapter(adapter_dirs, weights)
    ref = peft_cat_tensors(tiny_model_dir, adapter_dirs, weights)
    assert sorted(tensors) == sorted(ref) and all(torch.equal(tensors[k], ref[k]) for k in ref)
    assert config["r"] == config["lora_alpha"] == 6 and config["target_modules"] == sorted(LLAMA_PROJECTIONS)
    # loaded as an ordinary adapter, it is the exact merge base + Σ α·B·A
    folder = write_cat_adapter(adapter_dirs, weights, tmp_path)
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), folder).eval()
    with merged_adapters(policy.model, weights):
        merged = logits(policy.model, ids)
    torch.testing.assert_close(logits(served, ids), merged, atol=1e-5, rtol=1e-5)
    # named by the weights and the adapters' bytes, written once
    assert folder.name == adapter_digest(adapter_dirs, weights) and folder.name.startswith("route-")
    stamp = (folder / "adapter_model.safetensors").stat().st_mtime_ns
    assert write_cat_adapter(adapter_dirs, weights, tmp_path) == folder
    assert (folder / "adapter_model.safetensors").stat().st_mtime_ns == stamp
    assert adapter_digest(adapter_dirs, {"a": 0.7, "b": -0.4}) != folder.name
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary folder left behind


def test_cat_adapter_refuses_what_does_not_concatenate(adapter_dirs, tmp_path):
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_model.safetensors").write_bytes((adapter_dirs["b"] / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((adapter_dirs["b"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(NotImplementedError, match="uses DoRA"):
        cat_adapter({"a": adapter_dirs["a"], "d": dora}, {"a": 0.5, "d": 0.5})
    with pytest.raises(ValueError, match=r"no adapter folder for \['z'\]"):
        cat_adapter(adapter_dirs, {"a": 0.5, "z": 0.5})
    with pytest.raises(FileNotFoundError, match="not a saved PEFT adapter"):
        cat_adapter({"a": tmp_path}, {"a": 1.0})


def test_routed_lora_gives_each_row_its_route(policy, ids):
    """One batch whose rows run under the base model, adapter a, adapter b and a weighted merge: each row's
    logits are those of its weights alone (PEFT's adapter path, or the merge in the base weights)."""
    from trace_lib.engine.kvcache import RowRoutes, row_routes
    from trace_lib.engine.row_lora import RoutedLora

    routes = [{}, {"a": 1.0}, {"b": 1.0}, {"a": 0.4, "b": -1.5}]
    rows = ids[[0, 1, 1, 0, 0, 1]]
    row_route = [0, 1, 3, 2, 3, 0]
    with RoutedLora(policy.model, routes), row_routes(RowRoutes(row_route)):
        got = logits(policy.model, rows)
    for i, k in enumerate(row_route):
        if k == 0:
            want = base_logits(policy, rows[i:i + 1])
        elif k in (1, 2):
            with use_adapter(policy, "a" if k == 1 else "b"):
                want = logits(policy.model, rows[i:i + 1])
        else:
            with merged_adapters(policy.model, routes[3]):
                want = logits(policy.model, rows[i:i + 1])
        torch.testing.assert_close(got[i:i + 1], want, rtol=1e-4, atol=1e-4)
    # outside, PEFT's own adapter state is back
    with use_adapter(policy, "a"):
        torch.testing.assert_close(logits(policy.model, rows[1:2]), got[1:2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(base_logits(policy, rows[:1]), got[:1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("positions", [1, None])  # a decoding step (its input's cast kept) and a prefill
def test_routed_lora_in_bf16_is_peft_per_row(tiny_model_dir, adapter_dirs, ids, positions):
    """In a bf16 model each routed row's logits are, within bf16 rounding, those PEFT gives that row alone
    (the delta in float32, added and rounded once)."""
    from trace_lib.engine.kvcache import RowRoutes, row_routes
    from trace_lib.engine.row_lora import RoutedLora

    pol = load_policy(tiny_model_dir, dtype="bfloat16", adapters={k: str(v) for k, v in adapter_dirs.items()},
                      device=str(ids.device))
    rows = ids[[0, 1, 1, 0]][:, :positions]
    route_of = [0, 1, 2, 1]
    with RoutedLora(pol.model, [{}, {"a": 1.0}, {"b": 1.0}]), row_routes(RowRoutes(route_of, ids.device)):
        got = logits(pol.model, rows)
    for i, k in enumerate(route_of):
        if k == 0:
            want = base_logits(pol, rows[i:i + 1])
        else:
            with use_adapter(pol, "a" if k == 1 else "b"):
                want = logits(pol.model, rows[i:i + 1])
        torch.testing.assert_close(got[i:i + 1], want, rtol=0.02, atol=0.02)
    assert (got[1] - got[0]).abs().max() > 0.1  # the adapters move the logits well past that tolerance


def test_routed_lora_refuses_what_it_cannot_route(policy, ids):
    from trace_lib.engine.kvcache import RowRoutes, row_routes
    from trace_lib.engine.row_lora import RoutedLora

    with pytest.raises(ValueError, match=r"unknown adapter\(s\) \['zzz'\]"):
        RoutedLora(policy.model, [{}, {"zzz": 1.0}])
    with RoutedLora(policy.model, [{}, {"a": 1.0}]):
        with pytest.raises(RuntimeError, match="without the rows' routes"):
            logits(policy.model, ids)
        with pytest.raises(ValueError, match="routes for 3 rows, the batch has 2"), row_routes(RowRoutes([0, 1, 1])):
            logits(policy.model, ids)
    with merged_adapters(policy.model, {"a": 0.5}):  # the merge's own path is untouched
        pass
    # a forward another library set on a layer (a hook) is put back on exit
    layer = next(m for m in policy.model.modules() if hasattr(m, "lora_A") and "a" in m.lora_A)
    hook = layer.forward = lambda x, *a, **k: layer.base_layer(x)
    with RoutedLora(policy.model, [{"a": 1.0}]):
        assert layer.forward is not hook
    assert layer.forward is hook
    del layer.forward
