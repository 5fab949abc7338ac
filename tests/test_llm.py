"""The LLM call layer: the real anthropic SDK against a local server that speaks the Messages API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_anthropic import KEY, MSGS, FakeMessagesAPI, anthropic_client, error_reply, text_reply

from trace_lib.llm import (
    LLMClient,
    LLMError,
    estimate_cost,
    extract_json,
    ledger_totals,
    request_key,
    resolve_backend,
    schema_errors,
)

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def test_success_uses_cached_system_block_and_records_ledger(tmp_path):
    with FakeMessagesAPI([(200, text_reply("42"))]) as api:
        reply = anthropic_client(tmp_path, api.url).complete("You are terse.", MSGS, max_tokens=16, stage="discover")
    assert (reply.text, reply.input_tokens, reply.output_tokens, reply.cached) == ("42", 11, 7, False)
    body = api.requests[0]
    assert body["system"] == [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    assert body["messages"] == MSGS and body["max_tokens"] == 16 and body["temperature"] == 0.0
    sent = api.headers[0]
    assert KEY in (sent.get("x-api-key"), sent.get("authorization", "").removeprefix("Bearer "))
    totals = ledger_totals(tmp_path / "ledger.jsonl")
    assert totals["discover"]["calls"] == 1 and totals["discover"]["input_tokens"] == 11
    expected = estimate_cost("claude-sonnet-4-5", 11, 7, cache_write=100)
    assert totals["discover"]["cost_usd"] == pytest.approx(expected)


def test_429_then_success_retries(tmp_path):
    with FakeMessagesAPI([error_reply(429, "rate_limit_error"), (200, text_reply("ok"))]) as api:
        reply = anthropic_client(tmp_path, api.url).complete("s", MSGS, max_tokens=8)
    assert reply.text == "ok" and len(api.requests) == 2


def test_timeout_is_retried(tmp_path):
    with FakeMessagesAPI([(200, text_reply("late but fine"))], delays=[1.0]) as api:
        client = LLMClient("anthropic", "claude-sonnet-4-5", tmp_path / "cache", base_url=api.url, api_key=KEY,
                           max_retries=1, timeout=0.3)
        assert client.complete("s", MSGS, max_tokens=8).text == "late but fine"
    assert len(api.requests) == 2


def test_500_forever_gives_clear_error_after_bounded_retries(tmp_path):
    with FakeMessagesAPI([error_reply(500, "api_error")]) as api:
        with pytest.raises(LLMError, match=r"HTTP 500 after 2 retries") as info:
            anthropic_client(tmp_path, api.url, max_retries=2).complete("s", MSGS, max_tokens=8)
    assert len(api.requests) == 3
    assert KEY not in str(info.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.json"))


def test_malformed_json_is_reasked_once(tmp_path):
    with FakeMessagesAPI([(200, text_reply("sure! {answer: 42")), (200, text_reply('```json\n{"answer": 42}\n```'))]) as api:
        value = anthropic_client(tmp_path, api.url).complete_json("s", MSGS, SCHEMA, max_tokens=32)
    assert value == {"answer": 42} and len(api.requests) == 2
    reask = api.requests[1]["messages"]
    assert reask[1] == {"role": "assistant", "content": "sure! {answer: 42"}
    assert "not valid JSON" in reask[2]["content"]


def test_schema_mismatch_twice_is_a_clear_error(tmp_path):
    with FakeMessagesAPI([(200, text_reply('{"answer": "forty-two"}'))]) as api:
        with pytest.raises(LLMError, match=r"does not match the schema at answer: expected integer, got str.*after one re-ask"):
            anthropic_client(tmp_path, api.url).complete_json("s", MSGS, SCHEMA, max_tokens=32)
    assert len(api.requests) == 2


def test_cache_hit_sends_zero_requests_and_same_bytes(tmp_path):
    with FakeMessagesAPI([(200, text_reply('{"answer": 42}'))]) as api:
        first = anthropic_client(tmp_path, api.url).complete_json("s", MSGS, SCHEMA, max_tokens=32, stage="label")
    cache_files = sorted((tmp_path / "cache").rglob("*.json"))
    snapshot = [p.read_bytes() for p in cache_files]
    with FakeMessagesAPI([error_reply(500, "api_error")]) as api2:
        client = anthropic_client(tmp_path, api2.url)
        second = client.complete_json("s", MSGS, SCHEMA, max_tokens=32, stage="label")
    assert first == second == {"answer": 42}
    assert api2.requests == [] and client.requests_sent == 0
    assert [p.read_bytes() for p in cache_files] == snapshot
    for p in (tmp_path / "cache").rglob("*.json"):
        assert KEY not in p.read_text()
    assert KEY not in (tmp_path / "ledger.jsonl").read_text()
    assert KEY not in repr(client)


def test_cache_hit_is_free(tmp_path):
    with FakeMessagesAPI([(200, text_reply("hi"))]) as api:
        anthropic_client(tmp_path, api.url).complete("s", MSGS, max_tokens=8, stage="x")
    with FakeMessagesAPI([error_reply(500, "api_error")]) as api2:
        client = anthropic_client(tmp_path, api2.url)
        reply = client.complete("s", MSGS, max_tokens=8, stage="x")
    assert reply.cached and reply.text == "hi" and api2.requests == [] and client.requests_sent == 0
    rows = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [r["cached"] for r in rows] == [False, True] and rows[1]["cost_usd"] == 0.0


def test_request_key_depends_on_every_field():
    base = dict(backend="anthropic", model="m", system="s", messages=MSGS, max_tokens=8, temperature=0.0, schema=None)
    keys = {request_key(**base)}
    for field, value in [("backend", "local"), ("model", "m2"), ("system", "t"), ("max_tokens", 9),
                         ("temperature", 0.5), ("schema", SCHEMA), ("messages", [{"role": "user", "content": "x"}])]:
        keys.add(request_key(**{**base, field: value}))
    assert len(keys) == 8


def test_resolve_backend_auto(monkeypatch, capsys):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    assert resolve_backend("auto") == "rules"
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    assert resolve_backend("auto") == "anthropic"
    assert resolve_backend("auto", base_url="http://localhost:8000/v1") == "anthropic"  # the key comes first
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    assert resolve_backend("auto", base_url="http://localhost:8000/v1") == "openai"
    err = capsys.readouterr().err
    assert "auto -> rules" in err and "auto -> anthropic" in err and "auto -> openai" in err and KEY not in err
    with pytest.raises(ValueError, match="unknown backend 'gpt'"):
        resolve_backend("gpt")


def test_missing_key_and_rules_backend_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(LLMError, match="ANTHROPIC_API_KEY is not set"):
        LLMClient("anthropic", "claude-sonnet-4-5", tmp_path).complete("s", MSGS, max_tokens=8)
    with pytest.raises(LLMError, match="not an LLM"):
        LLMClient("rules", "rules", tmp_path).complete("s", MSGS, max_tokens=8)


def test_extract_json_variants():
    assert extract_json('{"a": 1}') == {"a": 1}
    assert extract_json('Here:\n```json\n[1, 2]\n```\nDone') == [1, 2]
    assert extract_json('prefix {"a": {"b": 2}} suffix') == {"a": {"b": 2}}
    with pytest.raises(ValueError, match="not valid JSON"):
        extract_json("no json here")


def test_local_backend_through_the_policy(tmp_path, tiny_model_dir):
    client = LLMClient("local", str(tiny_model_dir), tmp_path / "cache", tmp_path / "ledger.jsonl", seed=0)
    first = client.complete("Answer briefly.", MSGS, max_tokens=6, stage="label")
    assert not first.cached and first.output_tokens <= 6 and first.input_tokens > 0
    again = LLMClient("local", str(tiny_model_dir), tmp_path / "cache").complete("Answer briefly.", MSGS, max_tokens=6)
    assert again.cached and again.text == first.text
    with pytest.raises(LLMError, match="after one re-ask"):  # a random tiny model does not write JSON
        client.complete_json("Answer briefly.", MSGS, SCHEMA, max_tokens=4)


def test_schema_errors_subset():
    schema = {"type": "object", "required": ["labels"], "additionalProperties": False,
              "properties": {"labels": {"type": "array", "minItems": 1, "items": {
                  "type": "object", "required": ["id", "label"],
                  "properties": {"id": {"type": "string", "minLength": 1},
                                 "label": {"enum": ["PRESENT", "LACKING", "NA"]},
                                 "n": {"type": "integer"}}}}}}
    assert schema_errors({"labels": [{"id": "a", "label": "NA", "n": 3}]}, schema) == []
    assert schema_errors([], schema) == ["at (top level): expected object, got list"]
    assert schema_errors({}, schema) == ["at (top level): missing required key 'labels'"]
    assert schema_errors({"labels": [], "x": 1}, schema) == ["at labels: fewer than 1 items",
                                                             "at (top level): unexpected key 'x'"]
    assert schema_errors({"labels": [{"id": "", "label": "maybe", "n": True}]}, schema) == [
        "at labels/0/id: shorter than 1 characters",
        "at labels/0/label: 'maybe' is not one of ['PRESENT', 'LACKING', 'NA']",
        "at labels/0/n: expected integer, got bool"]
    assert schema_errors(1.5, {"type": ["number", "null"]}) == [] and schema_errors(None, {"type": ["number", "null"]}) == []


def test_ledger_totals_bill_only_sent_requests(tmp_path):
    with FakeMessagesAPI([(200, text_reply("hi"))]) as api:
        client = anthropic_client(tmp_path, api.url)
        client.complete("s", MSGS, max_tokens=8, stage="score")
        client.complete("s", MSGS, max_tokens=8, stage="score")
    t = ledger_totals(tmp_path / "ledger.jsonl")["score"]
    assert (t["calls"], t["cache_hits"], t["input_tokens"], t["output_tokens"]) == (2, 1, 11, 7)
    assert ledger_totals(tmp_path / "missing.jsonl") == {}


# --- faults: each is retried with backoff, then fails naming the stage and the request ---------------
def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _truncated(kind: str) -> tuple:
    """A 200 whose body stops mid-JSON: the connection closes before `content-length` bytes
    ('short'), or the length matches the cut body ('cut', as a proxy that lost the tail sends it)."""
    full = json.dumps(text_reply("never seen")).encode()
    if kind == "short":
        return 200, full[:40], {"content-length": str(len(full))}
    return 200, full[:40]


def test_429_with_retry_after_waits_then_succeeds_and_reruns_free(tmp_path):
    slow_down = (*error_reply(429, "rate_limit_error"), {"retry-after-ms": None, "retry-after": "1"})
    with FakeMessagesAPI([slow_down, (200, text_reply("ok"))]) as api:
        reply = anthropic_client(tmp_path, api.url).complete("s", MSGS, max_tokens=8, stage="discover")
    assert reply.text == "ok" and len(api.requests) == 2
    assert api.times[1] - api.times[0] >= 0.9  # honoured retry-after: 1 (seconds)
    assert api.headers[1].get("x-stainless-retry-count") == "1"
    assert [r["retries"] for r in _rows(tmp_path / "ledger.jsonl")] == [1]
    assert ledger_totals(tmp_path / "ledger.jsonl")["discover"]["retries"] == 1
    with FakeMessagesAPI([error_reply(500, "api_error")]) as api2:
        client = anthropic_client(tmp_path, api2.url)
        again = client.complete("s", MSGS, max_tokens=8, stage="discover")
    assert again.cached and again.text == "ok" and api2.requests == [] and client.requests_sent == 0
    assert [r["retries"] for r in _rows(tmp_path / "ledger.jsonl")] == [1, 0]


@pytest.mark.parametrize("kind", ["short", "cut"])
def test_truncated_body_is_retried(tmp_path, kind):
    with FakeMessagesAPI([_truncated(kind), (200, text_reply("whole"))]) as api:
        reply = anthropic_client(tmp_path, api.url).complete("s", MSGS, max_tokens=8, stage="score")
    assert reply.text == "whole" and len(api.requests) == 2
    (row,) = _rows(tmp_path / "ledger.jsonl")
    assert row["retries"] == 1 and "error" not in row


@pytest.mark.parametrize("kind", ["short", "cut"])
def test_truncated_body_forever_is_a_clear_error(tmp_path, kind):
    with FakeMessagesAPI([_truncated(kind)]) as api:
        with pytest.raises(LLMError) as info:
            anthropic_client(tmp_path, api.url, max_retries=2).complete("s", MSGS, max_tokens=8, stage="discover")
    assert len(api.requests) == 3
    key = request_key("anthropic", "claude-sonnet-4-5", "s", MSGS, 8, 0.0)
    msg = str(info.value)
    assert "stage discover" in msg and f"request {key[:16]}" in msg and "after 2 retries" in msg
    assert ("complete message body" if kind == "short" else "not valid JSON") in msg
    assert not list((tmp_path / "cache").rglob("*.json"))  # a failure caches nothing
    (row,) = _rows(tmp_path / "ledger.jsonl")
    assert row["request"] == key[:16] and row["retries"] == 2 and row["error"] and row["cost_usd"] == 0.0
    t = ledger_totals(tmp_path / "ledger.jsonl")["discover"]
    assert (t["calls"], t["errors"], t["retries"], t["input_tokens"]) == (1, 1, 2, 0)


@pytest.mark.parametrize("fault", ["500", "timeout"])
def test_exhausted_retries_name_stage_model_and_request(tmp_path, fault):
    script, delays = ([error_reply(500, "api_error")], []) if fault == "500" else ([(200, text_reply("late"))], [1.0] * 2)
    with FakeMessagesAPI(script, delays=delays) as api:
        client = LLMClient("anthropic", "claude-sonnet-4-5", tmp_path / "cache", tmp_path / "ledger.jsonl",
                           base_url=api.url, api_key=KEY, max_retries=1, timeout=0.3)
        with pytest.raises(LLMError) as info:
            client.complete("s", MSGS, max_tokens=8, stage="tau2_user")
    key = request_key("anthropic", "claude-sonnet-4-5", "s", MSGS, 8, 0.0)
    msg = str(info.value)
    assert msg.startswith(f"anthropic/claude-sonnet-4-5 stage tau2_user request {key[:16]}: ")
    assert ("HTTP 500 after 1 retries" if fault == "500" else "timed out (0.3 s) after 1 retries") in msg
    assert len(api.requests) == 2 and KEY not in msg
    assert [(r["retries"], bool(r["error"])) for r in _rows(tmp_path / "ledger.jsonl")] == [(1, True)]


def test_schema_mismatch_error_names_stage_and_request(tmp_path):
    with FakeMessagesAPI([(200, text_reply('{"answer": "forty-two"}'))]) as api:
        with pytest.raises(LLMError) as info:
            anthropic_client(tmp_path, api.url).complete_json("s", MSGS, SCHEMA, max_tokens=32, stage="label")
    key = request_key("anthropic", "claude-sonnet-4-5", "s", MSGS, 32, 0.0, SCHEMA)
    assert str(info.value).startswith(f"anthropic/claude-sonnet-4-5 stage label request {key[:16]}: reply ")
    assert len(api.requests) == 2


def test_key_echoed_by_the_server_is_redacted(tmp_path):
    echo = (401, {"type": "error", "error": {"type": "authentication_error", "message": f"bad key {KEY}"}})
    with FakeMessagesAPI([echo]) as api:
        with pytest.raises(LLMError, match=r"HTTP 401 \(not retryable\)") as info:
            anthropic_client(tmp_path, api.url).complete("s", MSGS, max_tokens=8, stage="discover")
    assert len(api.requests) == 1 and KEY not in str(info.value)
    assert KEY not in (tmp_path / "ledger.jsonl").read_text()
