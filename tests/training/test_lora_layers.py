"""`train.lora_layers`: LoRA on the top k decoder layers only, trained, saved, then loaded, merged, routed and
served (as a `cat` adapter) by the code that applies adapters, on the tiny random model (2 layers)."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from lora_files import LLAMA_PROJECTIONS, explicit_model, logits, save_lora
from tiny_training import FAST, ParityEnv, kv_tasks

from trace_lib.engine.adapters import cat_adapter, write_cat_adapter
from trace_lib.engine.policy import load_policy
from trace_lib.config import TrainConfig
from trace_lib.engine.compose import merged_adapters, use_adapter
from trace_lib.budget import RolloutLedger
from trace_lib.training.grpo import TrainSource
from trace_lib.training.trainer import lora_config, train_adapter_mixture


def _layers(tensors) -> set[int]:
    """The decoder layer indices the saved LoRA tensors belong to."""
    return {int(k.split(".layers.")[1].split(".")[0]) for k in tensors}


def _train(tiny_model_dir, tmp_path, **kw):
    cfg = TrainConfig(**{**FAST, "iterations": 1, "group_size": 4, **kw})
    return train_adapter_mixture(tiny_model_dir, [TrainSource("cap", lambda: ParityEnv(max_steps=3), kv_tasks)], cfg,
                                 tmp_path / "adapter", seed=0, ledger=RolloutLedger(tmp_path / "ledger.jsonl"),
                                 name="cap")


def _peft(model_dir, folder):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), folder).eval()


def test_lora_layers_picks_the_top_layers_and_all_where_the_model_has_no_more(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # 2 decoder layers
    assert lora_config(TrainConfig(), base).layers_to_transform is None  # default: every layer
    assert lora_config(TrainConfig(lora_layers=1), base).layers_to_transform == [1]
    # as many as the model has, or more (a profile sized for a deeper model): every layer
    assert lora_config(TrainConfig(lora_layers=2), base).layers_to_transform is None
    assert lora_config(TrainConfig(lora_layers=8), base).layers_to_transform is None
    with pytest.raises(ValidationError, match="lora_layers"):
        TrainConfig(lora_layers=0)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """An adapter trained one iteration with `lora_layers: 1`."""
    tmp = tmp_path_factory.mktemp("top_layer")
    manifest = _train(tiny_model_dir, tmp, lora_layers=1)
    return tmp / "adapter", manifest


def test_a_top_layer_adapter_saves_weights_of_the_last_layer_only(trained):
    folder, manifest = trained
    tensors = load_file(folder / "adapter_model.safetensors")
    assert _layers(tensors) == {1}
    assert {k.split(".")[-3] for k in tensors} == set(LLAMA_PROJECTIONS)  # every targeted module of that layer
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in tensors.items())  # it trained (B starts at zero)
    assert json.loads((folder / "adapter_config.json").read_text())["layers_to_transform"] == [1]
    assert manifest.config["train"]["lora_layers"] == 1 and manifest.rollouts_used == 8


def test_the_engine_applies_a_trained_top_layer_adapter_as_peft_does(trained, tiny_model_dir):
    folder, _ = trained
    policy = load_policy(tiny_model_dir, adapters={"top": str(folder)})
    ids = torch.tensor([policy.encode("Hello, I need to cancel order #W123 please.")])
    loaded = {n.split(".layers.")[1].split(".")[0] for n, _ in policy.model.named_parameters() if "lora_" in n}
    assert loaded == {"1"}  # PEFT wrapped the last layer's modules only
    with use_adapter(policy, "top"):
        got = logits(policy.model, ids)
    ref = logits(_peft(tiny_model_dir, folder), ids)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with merged_adapters(policy.model, {"top": 1.0}):  # the training's folded sampling path
        torch.testing.assert_close(logits(policy.model, ids), ref, atol=1e-5, rtol=1e-5)
    with policy.model.disable_adapter():
        assert not torch.equal(logits(policy.model, ids), got)  # the adapter does change the model


# --- a top-layer adapter beside a whole-model one ----------------------------------------------------------
@pytest.fixture(scope="module")
def mixed_dirs(tiny_model_dir, tmp_path_factory):
    """Random adapters (A and B nonzero): 'top' on the last layer only, 'wide' on every layer. 'top' sorts first,
    so a `cat` config copied from the first adapter would leave out 'wide''s first layer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("mixed_loras")
    torch.manual_seed(3)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_PROJECTIONS, layers_to_transform=[1],
                                      init_lora_weights=False))
    model.save_pretrained(root / "top")
    return {"top": root / "top", "wide": save_lora(tiny_model_dir, root / "wide", 4, r=2, alpha=6, targets=LLAMA_PROJECTIONS)}


@pytest.fixture(scope="module")
def mixed(tiny_model_dir, mixed_dirs):
    return load_policy(tiny_model_dir, adapters={k: str(v) for k, v in mixed_dirs.items()}, policy_id="tiny")


@pytest.fixture(scope="module")
def mixed_ids(mixed):
    rows = [mixed.encode(t) for t in ["Hello, I need to cancel order #W123 please.",
                                      "What is the balance of my gift card?"]]
    n = min(map(len, rows))
    return torch.tensor([r[:n] for r in rows])


def test_a_top_layer_adapter_beside_a_whole_model_one_is_peft_alone_and_merges_exactly(
        mixed, mixed_ids, tiny_model_dir, mixed_dirs):
    with use_adapter(mixed, "top"):
        alone = logits(mixed.model, mixed_ids)
    torch.testing.assert_close(alone, logits(_peft(tiny_model_dir, mixed_dirs["top"]), mixed_ids), atol=1e-5,
                               rtol=1e-5)
    with mixed.model.disable_adapter():
        assert (alone - logits(mixed.model, mixed_ids)).abs().max() > 1e-2  # well above the tolerances
    before = {n: p.detach().clone() for n, p in mixed.model.named_parameters() if "lora_" not in n}
    with merged_adapters(mixed.model, {"top": 1.0}):
        torch.testing.assert_close(logits(mixed.model, mixed_ids), alone, atol=1e-5, rtol=1e-5)
        changed = {n for n, p in mixed.model.named_parameters() if n in before and not torch.equal(p, before[n])}
    assert changed and all(".layers.1." in n for n in changed)  # the first layer's weights stay the base's
    weights = {"wide": 0.7, "top": -0.45}
    with merged_adapters(mixed.model, weights):
        got = logits(mixed.model, mixed_ids)
    torch.testing.assert_close(got, logits(explicit_model(tiny_model_dir, mixed_dirs, weights), mixed_ids),
                               atol=1e-5, rtol=1e-5)
    assert all(torch.equal(p, before[n]) for n, p in mixed.model.named_parameters() if n in before)


def test_routed_rows_under_a_top_layer_adapter_are_each_their_own_route(mixed, mixed_ids):
    from trace_lib.engine.kvcache import RowRoutes, row_routes
    from trace_lib.engine.row_lora import RoutedLora

    routes = [{}, {"top": 1.0}, {"wide": 1.0}, {"wide": 0.4, "top": -1.5}]
    rows = mixed_ids[[0, 1, 1, 0, 0]]
    route_of = [0, 1, 3, 2, 3]
    with RoutedLora(mixed.model, routes), row_routes(RowRoutes(route_of)):
        got = logits(mixed.model, rows)
    for i, k in enumerate(route_of):
        if k == 0:
            with mixed.model.disable_adapter():
                want = logits(mixed.model, rows[i:i + 1])
        elif k in (1, 2):
            with use_adapter(mixed, "top" if k == 1 else "wide"):
                want = logits(mixed.model, rows[i:i + 1])
        else:
            with merged_adapters(mixed.model, routes[3]):
                want = logits(mixed.model, rows[i:i + 1])
        torch.testing.assert_close(got[i:i + 1], want, rtol=1e-4, atol=1e-4)


def test_a_served_merge_of_a_top_layer_adapter_keeps_every_layer(mixed, mixed_ids, mixed_dirs, tiny_model_dir,
                                                                 tmp_path):
    config, _ = cat_adapter(mixed_dirs, {"top": 1.0})
    assert config["layers_to_transform"] == [1]  # one top-layer adapter: still only its layer
    weights = {"top": 0.6, "wide": -0.8}
    config, tensors = cat_adapter(mixed_dirs, weights)
    assert config["layers_to_transform"] is None and _layers(tensors) == {0, 1}
    served = _peft(tiny_model_dir, write_cat_adapter(mixed_dirs, weights, tmp_path))
    with merged_adapters(mixed.model, weights):
        merged = logits(mixed.model, mixed_ids)
    torch.testing.assert_close(logits(served, mixed_ids), merged, atol=1e-5, rtol=1e-5)


def test_the_unsloth_backend_is_given_the_top_layers(tiny_model_dir, monkeypatch):
    """Unsloth's `get_peft_model` takes `layers_to_transform` and hands it to PEFT's LoraConfig (its layers without
    LoRA keep the plain forward); the call is checked through `tiny_training.fake_unsloth`, as Unsloth needs CUDA."""
    import sys

    from tiny_training import fake_unsloth

    from trace_lib.training.trainer import load_trainable

    calls: list = []
    monkeypatch.setitem(sys.modules, "unsloth", fake_unsloth(calls))
    policy, _ = load_trainable(tiny_model_dir, TrainConfig(lora_rank=4, lora_layers=1), "unsloth", seed=0)
    assert calls[1][0] == "get_peft_model" and calls[1][1]["layers_to_transform"] == [1]
    assert _layers([n for n, _ in policy.model.named_parameters() if "lora_" in n]) == {1}
    load_trainable(tiny_model_dir, TrainConfig(lora_rank=4), "unsloth", seed=0)
    assert "layers_to_transform" not in calls[3][1]  # unset: Unsloth's own default, every layer
