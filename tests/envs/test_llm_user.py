"""The LLM user (τ²'s user simulator through the cached LLM call): τ²'s own constants, its prompt and
flipped roles, an episode through `build_env`, the stop token, and an OpenAI-compatible server, all against
a local server through the real SDK."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from local_http import JSONReplies

from trace_lib.config import EnvConfig
from trace_lib.envs.llm_user import LLMUser, agent_greeting, stop_token, tau2_constant, user_guidelines
from trace_lib.envs.tau2.env import build_env, tau2_tasks, to_task
from trace_lib.llm import LLMClient
from trace_lib.records import Message

KEY = "sk-ant-test-0000-never-stored"
ALL = [(d, t) for d in ("retail", "airline") for t in tau2_tasks(d, "base")]

# --- τ² constants -------------------------------------------------------------------------------
def test_constants_come_from_tau2_source():
    assert agent_greeting() == "Hi! How can I help you today?"
    assert tau2_constant("agent/llm_agent.py", "AGENT_INSTRUCTION").startswith("You are a customer service agent")
    assert "{global_user_sim_guidelines}" in tau2_constant("user/user_simulator.py", "SYSTEM_PROMPT")
    assert user_guidelines().startswith("# User Simulation Guidelines")
    assert stop_token("fine ###TRANSFER###") == "###TRANSFER###" and stop_token("thanks") is None
    with pytest.raises(ValueError, match="no top-level assignment to NOPE"):
        tau2_constant("agent/llm_agent.py", "NOPE")


# --- the LLM user -------------------------------------------------------------------------------
def messages_server(answer: Callable[[dict], str]) -> JSONReplies:
    """A local POST /v1/messages endpoint; `answer(request_body)` gives each reply's text."""
    def reply(body: dict, path: str) -> tuple[int, dict]:
        return (200 if path == "/v1/messages" else 404), {
            "id": "msg_1", "type": "message", "role": "assistant", "model": body.get("model"),
            "stop_reason": "end_turn", "stop_sequence": None, "content": [{"type": "text", "text": answer(body)}],
            "usage": {"input_tokens": 50, "output_tokens": 9}}

    return JSONReplies(reply)


def chat_completions_server(answer: Callable[[dict], str]) -> JSONReplies:
    """A local POST /v1/chat/completions endpoint (its `url` ends in /v1); `answer(request_body)` gives each reply's
    text."""
    def reply(body: dict, path: str) -> tuple[int, dict]:
        return (200 if path == "/v1/chat/completions" else 404), {
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body.get("model"),
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer(body)}}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 9, "total_tokens": 59}}

    return JSONReplies(reply, "/v1")


def customer(body: dict) -> str:
    """A stand-in for Claude playing the customer of retail task 10."""
    last = body["messages"][-1]["content"]
    if last == "Hi! How can I help you today?":
        return "Hi, I'd like to return some items from my orders."
    if "email" in last.lower():
        return "Sure, it's mia.garcia2723@example.com."
    return "That's all, thanks! ###STOP###"


@pytest.fixture
def api(monkeypatch):
    with messages_server(customer) as server:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
        yield server


def test_llm_user_follows_tau2_prompt_and_flips_roles(api, tmp_path):
    task = next(t for d, t in ALL if d == "retail" and t.id == "10")
    client = LLMClient("anthropic", "claude-sonnet-4-5", tmp_path / "cache", tmp_path / "ledger.jsonl")
    user = LLMUser.for_task(client, task)
    assert user.opening() == "Hi, I'd like to return some items from my orders."
    turn = user.reply("Can I have your email address?")
    assert turn.content == "Sure, it's mia.garcia2723@example.com." and not turn.stop
    assert user.reply("Anything else?").stop
    first, last = api.requests[0], api.requests[-1]
    system = "".join(block["text"] for block in first["system"])
    assert system.startswith(user_guidelines().strip()) and "<scenario>" in system
    assert str(task.user_scenario) in system and first["temperature"] == 0.0
    assert first["messages"] == [{"role": "user", "content": "Hi! How can I help you today?"}]
    assert [m["role"] for m in last["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert set(api.api_keys) == {KEY}
    cached = "".join(p.read_text() for p in (tmp_path / "cache").rglob("*.json"))
    assert KEY not in cached and KEY not in (tmp_path / "ledger.jsonl").read_text()


def test_llm_user_episode_through_build_env(api, tmp_path):
    cfg = EnvConfig(name="tau2-retail", user="llm", max_steps=200, max_errors=10,
                    user_cache_dir=str(tmp_path / "user_cache"))
    t2 = next(t for d, t in ALL if d == "retail" and t.id == "10")
    task = to_task(t2, "retail", "base")

    def run() -> tuple[float, dict, list[Message]]:
        env = build_env(cfg)
        env.reset(task)
        env.step(Message(role="assistant", content="Could you tell me your email address?"))
        for i, gold in enumerate(task.gold_actions):
            if not env.done:
                env.step(Message(role="assistant", tool_calls=[gold.model_copy(update={"id": f"g{i}"})]))
        reward, info = env.reward()
        return reward, info, env.state.messages

    reward, info, messages = run()
    assert reward == 1.0 and info["user_mode"] == "llm" and info["termination"] == "transfer"
    assert messages[2].content == "Hi, I'd like to return some items from my orders."
    assert messages[4].content == "Sure, it's mia.garcia2723@example.com."
    sent = len(api.requests)
    assert run()[2] == messages and len(api.requests) == sent  # second run: every reply from the cache
    ledger = (tmp_path / "user_cache" / "ledger.jsonl").read_text().splitlines()
    assert {json.loads(row)["stage"] for row in ledger} == {"tau2_user"}


def test_llm_user_stop_token_ends_episode(api, tmp_path):
    cfg = EnvConfig(name="tau2-retail", user="llm", max_steps=200, user_cache_dir=str(tmp_path / "c"))
    task = to_task(next(t for d, t in ALL if d == "retail" and t.id == "10"), "retail", "base")
    env = build_env(cfg)
    env.reset(task)
    result = env.step(Message(role="assistant", content="Your order is on its way."))
    assert result.done and result.termination == "user_stop"
    assert result.observations[0].content.endswith("###STOP###")


def test_llm_user_on_an_openai_compatible_server(tmp_path, monkeypatch):
    """`env.user_backend: openai`: the same τ² user, its turns sent to a Chat Completions server."""
    monkeypatch.setenv("USER_SERVER_KEY", KEY)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with chat_completions_server(customer) as server:
        cfg = EnvConfig(name="tau2-retail", user="llm", max_steps=200, user_backend="openai",
                        user_base_url=server.url, user_api_key_env="USER_SERVER_KEY", user_model="served-user",
                        user_cache_dir=str(tmp_path / "user_cache"))
        task = to_task(next(t for d, t in ALL if d == "retail" and t.id == "10"), "retail", "base")
        env = build_env(cfg)
        env.reset(task)
        env.step(Message(role="assistant", content="Could you tell me your email address?"))
    messages = env.state.messages
    assert messages[2].content == "Hi, I'd like to return some items from my orders."
    assert messages[4].content == "Sure, it's mia.garcia2723@example.com."
    first = server.requests[0]
    assert first["model"] == "served-user" and first["messages"][0]["role"] == "system"
    assert "<scenario>" in first["messages"][0]["content"] and set(server.api_keys) == {KEY}
    rows = [json.loads(r) for r in (tmp_path / "user_cache" / "ledger.jsonl").read_text().splitlines()]
    assert {(r["stage"], r["backend"]) for r in rows} == {("tau2_user", "openai")}
