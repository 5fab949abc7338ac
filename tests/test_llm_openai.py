"""The openai backend of the LLM call layer: the real `openai` SDK against a local server that speaks the Chat
Completions API (the faults of `test_llm.py`'s anthropic tests, each retried and then reported)."""

from __future__ import annotations

import json

import pytest
from local_http import JSONReplies
from fake_anthropic import FakeMessagesAPI

from trace_lib.llm import LLMClient, LLMError, analyst_client, ledger_totals, request_key
from trace_lib.config import AnalystConfig

KEY = "sk-openai-test-secret-0123456789"
MODEL = "smollm2-served"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
MSGS = [{"role": "user", "content": "What is 6 x 7?"}]


def _completion(text: str | None, finish: str = "stop") -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 13, "completion_tokens": 5, "total_tokens": 18}}


def _error(status: int, message: str = "fake error") -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": "server_error", "code": status}}


def _client(tmp_path, url: str, max_retries: int = 2, timeout: float = 10, **kw) -> LLMClient:
    return LLMClient("openai", MODEL, tmp_path / "cache", tmp_path / "ledger.jsonl", base_url=url, api_key=KEY,
                     max_retries=max_retries, timeout=timeout, **kw)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_reply_through_the_sdk_is_cached_ledgered_and_priced_as_set(tmp_path):
    with FakeMessagesAPI([(200, _completion("42"))]) as api:
        client = _client(tmp_path, api.url + "/v1", prices={"smollm2": (1.0, 2.0)})
        reply = client.complete("be brief", MSGS, max_tokens=8, temperature=0.5, stage="discover")
    assert reply.text == "42" and not reply.cached and len(api.requests) == 1
    sent = api.requests[0]
    assert sent["model"] == MODEL and sent["max_tokens"] == 8 and sent["temperature"] == 0.5
    assert sent["messages"] == [{"role": "system", "content": "be brief"}, *MSGS] and "response_format" not in sent
    assert api.headers[0]["authorization"] == f"Bearer {KEY}"
    (row,) = _rows(tmp_path / "ledger.jsonl")
    assert (row["backend"], row["input_tokens"], row["output_tokens"], row["retries"]) == ("openai", 13, 5, 0)
    assert row["cost_usd"] == pytest.approx((13 * 1.0 + 5 * 2.0) / 1e6)
    with FakeMessagesAPI([_error(500)]) as api2:  # a rerun sends nothing
        again = _client(tmp_path, api2.url + "/v1").complete("be brief", MSGS, max_tokens=8, temperature=0.5,
                                                              stage="discover")
    assert again.cached and again.text == "42" and api2.requests == []


def test_a_model_without_a_price_gets_no_cost(tmp_path):
    with FakeMessagesAPI([(200, _completion("42"))]) as api:
        _client(tmp_path, api.url).complete("s", MSGS, max_tokens=8, stage="discover")
    (row,) = _rows(tmp_path / "ledger.jsonl")
    assert row["cost_usd"] is None


def test_schema_replies_ask_for_the_schema_and_are_validated(tmp_path):
    with FakeMessagesAPI([(200, _completion('{"answer": 42}'))]) as api:
        assert _client(tmp_path, api.url).complete_json("s", MSGS, SCHEMA, max_tokens=32, stage="label") == {
            "answer": 42}
    assert api.requests[0]["response_format"] == {"type": "json_schema",
                                                  "json_schema": {"name": "reply", "schema": SCHEMA}}
    # a server without structured output: plain text, validated, re-asked once with the reason
    with FakeMessagesAPI([(200, _completion('{"answer": "forty-two"}')), (200, _completion('{"answer": 42}'))]) as api:
        client = _client(tmp_path / "b", api.url, response_format="text")
        assert client.complete_json("s", MSGS, SCHEMA, max_tokens=32, stage="label") == {"answer": 42}
    assert "response_format" not in api.requests[0] and len(api.requests) == 2
    assert "Answer again with only one JSON value" in api.requests[1]["messages"][-1]["content"]


def test_a_reply_that_breaks_the_schema_twice_names_stage_and_request(tmp_path):
    with FakeMessagesAPI([(200, _completion('{"answer": "forty-two"}'))]) as api:
        with pytest.raises(LLMError) as info:
            _client(tmp_path, api.url).complete_json("s", MSGS, SCHEMA, max_tokens=32, stage="label")
    key = request_key("openai", MODEL, "s", MSGS, 32, 0.0, SCHEMA)
    assert str(info.value).startswith(f"openai/{MODEL} stage label request {key[:16]}: reply ")
    assert len(api.requests) == 2


def test_429_with_retry_after_then_success(tmp_path):
    slow_down = (*_error(429, "rate limited"), {"retry-after-ms": None, "retry-after": "1"})
    with FakeMessagesAPI([slow_down, (200, _completion("ok"))]) as api:
        reply = _client(tmp_path, api.url).complete("s", MSGS, max_tokens=8, stage="discover")
    assert reply.text == "ok" and len(api.requests) == 2 and api.times[1] - api.times[0] >= 0.9
    assert [r["retries"] for r in _rows(tmp_path / "ledger.jsonl")] == [1]


@pytest.mark.parametrize("fault", ["500", "timeout", "short body", "cut body", "empty reply", "no choices"])
def test_each_fault_is_retried_then_reported_and_caches_nothing(tmp_path, fault):
    full = json.dumps(_completion("never seen")).encode()
    entry, delays = {
        "500": (_error(500), []),
        "timeout": ((200, _completion("late")), [1.0] * 2),
        "short body": ((200, full[:40], {"content-length": str(len(full))}), []),
        "cut body": ((200, full[:40]), []),
        "empty reply": ((200, _completion("", finish="length")), []),
        "no choices": ((200, {"id": "x", "object": "chat.completion", "choices": []}), []),
    }[fault]
    with FakeMessagesAPI([entry], delays=delays) as api:
        with pytest.raises(LLMError) as info:
            _client(tmp_path, api.url, max_retries=1, timeout=0.3 if fault == "timeout" else 10).complete(
                "s", MSGS, max_tokens=8, stage="synthesize")
    key = request_key("openai", MODEL, "s", MSGS, 8, 0.0)
    msg = str(info.value)
    assert msg.startswith(f"openai/{MODEL} stage synthesize request {key[:16]}: ") and "after 1 retries" in msg
    assert {"500": "HTTP 500", "timeout": "timed out (0.3 s)", "short body": "connection failed",
            "cut body": "not valid JSON", "empty reply": "empty reply (finish_reason 'length')",
            "no choices": "not a completion"}[fault] in msg
    assert len(api.requests) == 2 and KEY not in msg
    assert not list((tmp_path / "cache").rglob("*.json"))
    (row,) = _rows(tmp_path / "ledger.jsonl")
    assert row["retries"] == 1 and row["error"] and row["cost_usd"] == 0.0
    assert ledger_totals(tmp_path / "ledger.jsonl")["synthesize"]["errors"] == 1


def test_a_cut_body_then_a_whole_one_succeeds(tmp_path):
    full = json.dumps(_completion("whole")).encode()
    with FakeMessagesAPI([(200, full[:40]), (200, _completion("whole"))]) as api:
        assert _client(tmp_path, api.url).complete("s", MSGS, max_tokens=8).text == "whole"
    assert len(api.requests) == 2 and _rows(tmp_path / "ledger.jsonl")[0]["retries"] == 1


def test_the_key_comes_from_the_named_variable_and_is_redacted_and_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_SERVER_KEY", KEY)
    echo = _error(401, f"bad key {KEY}")
    cfg = AnalystConfig(backend="openai", model=MODEL, api_key_env="MY_SERVER_KEY", max_retries=0,
                        cache_dir=str(tmp_path / "cache"))
    with FakeMessagesAPI([echo]) as api:
        client = analyst_client(cfg.model_copy(update={"base_url": api.url}), tmp_path / "ledger.jsonl")
        with pytest.raises(LLMError, match=r"HTTP 401 \(not retryable\)") as info:
            client.complete("s", MSGS, max_tokens=8, stage="discover")
    assert api.headers[0]["authorization"] == f"Bearer {KEY}" and KEY not in str(info.value)
    assert KEY not in (tmp_path / "ledger.jsonl").read_text() and KEY not in repr(client)


def test_a_server_without_a_key_gets_a_placeholder(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    cfg = AnalystConfig(backend="auto", cache_dir=str(tmp_path / "cache"))
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with FakeMessagesAPI([(200, _completion("hi"))]) as api:
        client = analyst_client(cfg.model_copy(update={"base_url": api.url, "model": MODEL}), None)
        assert client.backend == "openai" and client.complete("s", MSGS, max_tokens=8).text == "hi"
    assert api.headers[0]["authorization"] == "Bearer no-key"


# --- the method's LLM parts end to end ----------------------------------------------------------------------
def chat_server(module: str) -> JSONReplies:
    """A local Chat Completions server (its `url` ends in /v1) that plays every LLM part of the pipeline from the
    request alone: discovery (a proposal), labelling (LACKING on a failed trajectory, PRESENT on a solved one), the
    synthesizer (`module`, which validates) and GEPA's reflection (a prompt)."""
    def answer(body: dict) -> str:
        rf = body.get("response_format") or {}
        props = rf.get("json_schema", {}).get("schema", {}).get("properties", {})
        user = body["messages"][-1]["content"]
        if "capabilities" in props:
            return json.dumps({"capabilities": [{
                "name": "Communicate result", "description": "Tell the user the value the lookup returned.",
                "recognition": "a correct lookup, then no answer", "evidence": []}]})
        if "labels" in props:
            ids = props["labels"]["items"]["properties"]["capability_id"]["enum"]
            label = "PRESENT" if "success=True" in user else "LACKING"
            return json.dumps({"labels": [{"capability_id": c, "label": label, "rationale": "r"} for c in ids]})
        if "training environments" in body["messages"][0]["content"]:
            return f"```python\n{module}```"
        return "```\nLook the order up, then say the value it holds.\n```"

    return JSONReplies(lambda body, path: (200, _completion(answer(body))), "/v1")


@pytest.mark.e2e
def test_discover_score_synthesize_and_gepa_on_an_openai_compatible_server(tmp_path, tiny_model_dir, monkeypatch):
    """`analyst.backend: openai` with a `base_url`: the discover, score, synthesize (LLM) and evaluate (GEPA) stages
    all call the server through the SDK, every call is in the cost table, and a rerun is served from the cache."""
    from pathlib import Path

    from retail_play import play_retail, retail_tasks

    from trace_lib.config import params_from_dict
    from trace_lib.io import write_jsonl
    from trace_lib.paths import Paths
    from trace_lib.stages.discover import run_discover
    from trace_lib.stages.evaluate import run_evaluate
    from trace_lib.evaluation.site import llm_costs_markdown
    from trace_lib.stages.score import run_score
    from trace_lib.stages.synthesize import run_synthesize

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    module = (Path(__file__).parent / "synth_fixtures" / "good_lookup.py").read_text()
    tasks = retail_tasks(2)
    paths = Paths(tmp_path)
    write_jsonl(paths.rollouts("train"), play_retail(tasks, "gold") + play_retail(tasks, "silent"))
    with chat_server(module) as server:
        params = params_from_dict({
            "model": {"out_dir": str(tiny_model_dir), "dtype": "float32"},
            "analyst": {"backend": "auto", "base_url": server.url, "model": MODEL, "max_retries": 0,
                        "cache_dir": str(tmp_path / "cache"), "prices": {MODEL: (0.5, 1.5)}},
            "env": {"families": [], "tasks_per_family": 2, "validation_fraction": 0, "test_tasks_per_family": 1,
                    "max_steps": 2},
            "discover": {"runs": 1, "batch_size": 50, "merge": "name"},
            "score": {"n_runs": 2, "k_keep": 2, "n_boot": 50},
            "synthesize": {"max_attempts": 1, "calibration": {"enabled": False}},
            "rollout": {"max_new_tokens": 6, "constrained": False, "batch_size": 4},
            "evaluate": {"router": "knn", "interference_seeds": 0, "n_boot": 50, "methods": ["base", "gepa"],
                         "gepa_tasks": 2, "gepa_minibatch": 1}})
        assert run_discover(params, tmp_path)["analyst"] == f"openai:{MODEL}"
        score = run_score(params, tmp_path)
        assert score["analyst"] == f"openai:{MODEL}" and score["kept"] == ["communicate_result"]
        synth = run_synthesize(params, tmp_path)
        assert synth["backend"] == "openai" and synth["valid"] == 1
        evaluate = run_evaluate(params, tmp_path, progress=False)
        assert evaluate["methods"]["gepa"]["status"] == "run" and evaluate["gepa"]["reflections"] >= 1
        sent = len(server.requests)
        assert run_discover(params, tmp_path)["analyst"] == f"openai:{MODEL}" and len(server.requests) == sent
    assert all(r["model"] == MODEL and r["messages"][0]["role"] == "system" for r in server.requests)
    table = llm_costs_markdown(params.env.user_cache_dir, tmp_path)
    for stage in ("discover", "score", "synthesize", "gepa"):
        assert f"| {stage} | openai | {MODEL} |" in table, table
    assert "| total |" in table and "| no price |" not in table
