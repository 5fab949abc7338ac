"""prepare_model: GGUF conversion (slow), pointers to local folders, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trace_lib.engine.model import (
    resolve_model,
    sha256_file,
    smollm2_gguf_path,
    weights_sha256,
)
from trace_lib.config import params_from_dict
from trace_lib.stages.prepare_model import run_prepare_model


def test_gguf_is_found():
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 10_000_000


def test_local_folder_gets_a_pointer(tiny_model_dir, tmp_path):
    out = resolve_model(str(tiny_model_dir), tmp_path / "model", "float32")
    info = json.loads((out / "model.json").read_text())
    assert info["source"] == "local" and info["path"] == str(tiny_model_dir.resolve())
    assert info["dtype"] == "float32"
    assert info["weights_sha256"] == {"model.safetensors": sha256_file(tiny_model_dir / "model.safetensors")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp folders left behind
    again = resolve_model(str(tiny_model_dir), tmp_path / "model", "float32")
    assert (again / "model.json").read_bytes() == (out / "model.json").read_bytes()


def test_pointer_loads_as_a_policy(tiny_model_dir, tmp_path):
    from trace_lib.engine.policy import load_policy

    out = resolve_model(str(tiny_model_dir), tmp_path / "model", "float32")
    assert load_policy(out).policy_id == tiny_model_dir.name


def test_prepare_model_reads_params(tiny_model_dir, tmp_path):
    params = params_from_dict({"model": {"id": str(tiny_model_dir), "out_dir": "m", "dtype": "float32"}})
    metrics = run_prepare_model(params, tmp_path)
    assert metrics["model_dir"] == str(tmp_path / "m") and (tmp_path / "m" / "model.json").is_file()
    assert metrics["model"]["source"] == "local" and metrics["model"]["dtype"] == "float32"


def test_the_tool_format_is_recorded_and_every_policy_loaded_from_the_folder_renders_with_it(tiny_model_dir, tmp_path):
    from trace_lib.engine.chat import tool_chat_template
    from trace_lib.engine.policy import load_policy, prepared_tool_format
    from trace_lib.records import Message

    params = params_from_dict({"model": {"id": str(tiny_model_dir), "out_dir": "m", "dtype": "float32",
                                         "tool_format": "signature"}})
    out = Path(run_prepare_model(params, tmp_path)["model_dir"])
    assert json.loads((out / "model.json").read_text())["tool_format"] == "signature"
    assert prepared_tool_format(out) == "signature" and prepared_tool_format(tiny_model_dir) == "json"
    policy = load_policy(out)
    assert policy.tool_format == "signature" and policy.tokenizer.chat_template == tool_chat_template("signature")
    tools = [{"name": "ping", "description": "Check.", "parameters": {"type": "object", "properties": {}}}]
    assert "- ping(): Check." in policy.render([Message(role="user", content="hi")], tools)
    assert load_policy(out, tool_format="json").tool_format == "json"  # a caller's choice wins
    params = params_from_dict({"model": {"id": str(tiny_model_dir), "out_dir": "m", "dtype": "float32",
                                         "tool_format": "json"}})
    run_prepare_model(params, tmp_path)  # the setting changed: the record follows
    assert prepared_tool_format(out) == "json" and load_policy(out).tool_format == "json"


def test_unreachable_hub_id_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="hub could not provide it"):
        resolve_model("nobody/not-a-model-xyz", tmp_path / "model", "float32")
    assert not (tmp_path / "model").exists()


def test_bad_inputs_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_model("smollm2-135m", tmp_path / "m", "int4")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"), tmp_path / "m", "float32")


@pytest.mark.slow
def test_gguf_round_trip_is_reproducible(smollm2_dir, tmp_path):
    from trace_lib.engine.chat import tool_chat_template
    from trace_lib.engine.policy import load_policy
    from trace_lib.records import Message

    info = json.loads((smollm2_dir / "model.json").read_text())
    assert info["model_id"] == "smollm2-135m" and info["path"] == "."
    assert info["source_sha256"] == sha256_file(smollm2_gguf_path())
    assert info["weights_sha256"] == weights_sha256(smollm2_dir)
    assert (smollm2_dir / "chat_template.jinja").read_text() == tool_chat_template()
    second = resolve_model("smollm2-135m", tmp_path / "again", "float32", force=True)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "model.json"):
        assert sha256_file(second / name) == sha256_file(smollm2_dir / name), name
    policy = load_policy(smollm2_dir, threads=2)
    gen = policy.generate([[Message(role="user", content="What is the capital of France?")]], [],
                          temperature=0.0, max_new_tokens=16, seed=0)[0]
    assert "Paris" in gen.text and gen.finish_reason == "stop"
