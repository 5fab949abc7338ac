"""The GEPA baseline: reflective prompt evolution over real episodes of the tiny model, hard rollout cap,
the anthropic reflection model through the real SDK (local Messages server), and the evaluate-stage row."""

from __future__ import annotations

import importlib.util
import json

import pytest
from fake_anthropic import KEY, FakeMessagesAPI, text_reply
from toy import KVEnv, kv_task

from trace_lib.engine.policy import load_policy
from trace_lib.llm import LLMClient
from trace_lib.config import Params, RolloutConfig
from trace_lib.evaluation.gepa import (
    REFLECTION_SYSTEM,
    RULES_REASON,
    STAGE,
    gepa_status,
    llm_reflection,
    optimize_system_prompt,
)
from trace_lib.budget import RolloutLedger

CFG = RolloutConfig(samples_per_task=1, temperature=0.0, max_new_tokens=6, batch_size=4, constrained=False)
SEED_PROMPT = "You look up values."


class PromptKV(KVEnv):
    """The toy key-value env, scored on the system prompt the episode opened with (contains 'LOOKUP'),
    so a reflected prompt can win on the tiny random model deterministically."""

    def _score(self):
        ok = "LOOKUP" in self.state.messages[0].content
        return float(ok), {"prompt_ok": ok}


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(tiny_model_dir, policy_id="tiny")


def train(n: int = 6):
    return {"toy": (PromptKV, [kv_task(i) for i in range(n)])}


class FakeReflection:
    def __init__(self) -> None:
        self.prompts: list[str] = []

    def __call__(self, prompt):
        self.prompts.append(prompt)
        n = len(self.prompts)
        return f"Here is the new prompt:\n```\nLOOKUP the key with get_value, then say its value. (v{n})\n```"


def test_optimizer_uses_reflection_and_stays_in_budget(policy, tmp_path):
    ledger = RolloutLedger(tmp_path / "gepa.jsonl")
    reflect = FakeReflection()
    run = optimize_system_prompt(policy, train(), reflect, CFG, budget=20, ledger=ledger, seed=0, minibatch=2)
    assert reflect.prompts and SEED_PROMPT in reflect.prompts[0]
    assert "USER: What is the value of k" in reflect.prompts[0]  # transcripts reach the reflection model
    assert run.prompts["toy"] == "LOOKUP the key with get_value, then say its value. (v1)"
    rec = run.record
    assert rec["best_train_score"] == 1.0 and rec["seed_train_score"] == 0.0 and rec["candidates"] == 2
    assert rec["rollouts_used"] == ledger.used(STAGE) <= 20
    assert {r["stage"] for r in ledger.rows()} == {STAGE}


def test_budget_is_a_hard_cap(policy, tmp_path):
    """7 episodes: seed on 3 Pareto tasks + parent and child minibatches of 2 = 7; scoring the accepted
    child on the Pareto tasks would pass the cap, so it is not run and the seed prompt stays best."""
    ledger = RolloutLedger(tmp_path / "gepa.jsonl")
    reflect = FakeReflection()
    run = optimize_system_prompt(policy, train(), reflect, CFG, budget=7, ledger=ledger, seed=0, minibatch=2)
    assert ledger.used(STAGE) == run.record["rollouts_used"] == 7
    assert len(reflect.prompts) == 1 and run.prompts["toy"] == SEED_PROMPT and run.record["stopped_by"] == "budget"


def test_anthropic_reflection_through_the_sdk(policy, tmp_path):
    reply = "```\nLOOKUP values with the tool before answering.\n```"
    with FakeMessagesAPI([(200, text_reply(reply))]) as api:
        client = LLMClient("anthropic", "claude-sonnet-4-5", tmp_path / "cache", tmp_path / "llm.jsonl",
                           base_url=api.url, api_key=KEY, max_retries=0, timeout=10)
        run = optimize_system_prompt(policy, train(4), llm_reflection(client), CFG, budget=12,
                                     ledger=RolloutLedger(tmp_path / "gepa.jsonl"), minibatch=2)
    assert len(api.requests) == 1
    body = api.requests[0]
    assert body["system"][0]["text"] == REFLECTION_SYSTEM and SEED_PROMPT in body["messages"][0]["content"]
    assert run.prompts["toy"] == "LOOKUP values with the tool before answering."
    assert run.record["rollouts_used"] <= 12
    rows = [json.loads(x) for x in (tmp_path / "llm.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == [STAGE]


def test_gepa_status_reasons(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    assert gepa_status(Params().analyst, Params().evaluate) == RULES_REASON
    assert gepa_status(Params().analyst, Params().evaluate, budget_total=100) == RULES_REASON
    anthropic = Params.model_validate({"analyst": {"backend": "anthropic"}})
    assert gepa_status(anthropic.analyst, anthropic.evaluate, 0).startswith("TRACE's rollout budget is 0")
    assert gepa_status(anthropic.analyst, anthropic.evaluate, 5) is None
    assert gepa_status(anthropic.analyst, anthropic.evaluate) is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gepa" else real(name, *a))
    assert "pip install gepa==0.1.4" in gepa_status(anthropic.analyst, anthropic.evaluate, 5)


def test_run_evaluate_gepa_row(tmp_path, tiny_model_dir, monkeypatch):
    """The stage with an anthropic analyst (local server via ANTHROPIC_BASE_URL): GEPA spends at most
    TRACE's budget (6 band-check rollouts here), writes its prompt and ledger, and its row is evaluated."""
    from trace_lib.stages.evaluate import run_evaluate

    RolloutLedger(tmp_path / "data" / "envs" / "rollouts.jsonl").add("synthesize", 6, "band")
    params = Params.model_validate({
        "model": {"out_dir": str(tiny_model_dir), "dtype": "float32"},
        "analyst": {"backend": "anthropic", "cache_dir": str(tmp_path / "cache"), "max_retries": 0},
        "env": {"tasks_per_family": 1, "families": ["order_total", "refuse_cancel"], "max_steps": 2},
        "rollout": {"max_new_tokens": 6, "constrained": False, "batch_size": 4},
        "evaluate": {"interference_seeds": 0, "n_boot": 50, "methods": ["base", "gepa"], "gepa_tasks": 2,
                     "gepa_minibatch": 1},
    })
    with FakeMessagesAPI([(200, text_reply("```\nBe precise.\n```"))]) as api:
        monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.url)
        metrics = run_evaluate(params, tmp_path, progress=False)
    assert len(api.requests) == metrics["gepa"]["reflections"] >= 1
    gepa = metrics["methods"]["gepa"]
    assert gepa["status"] == "run" and gepa["rollouts"] == metrics["gepa"]["rollouts_used"] <= 6
    assert RolloutLedger(tmp_path / "data" / "evaluate" / "gepa_rollouts.jsonl").used(STAGE) == gepa["rollouts"]
    out = tmp_path / "data" / "evaluate"
    prompt = (out / "gepa_prompt.md").read_text()
    trajs = [json.loads(x) for x in (out / "trajectories" / "gepa.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 and all(t["messages"][0]["content"] == prompt.rstrip("\n") for t in trajs)
