"""The synthesize stage: template and LLM synthesizers, attempts and verdicts kept, only valid modules installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_anthropic import FakeMessagesAPI, text_reply

from trace_lib.llm import LLMClient
from trace_lib.analyst.render import render_task
from trace_lib.config import params_from_dict
from trace_lib.io import read_json, write_jsonl
from trace_lib.records import Capability, Task, ToolCall, UserScenario
from trace_lib.stages.synthesize import run_synthesize
from trace_lib.synth.synthesize import (
    extract_module,
    feedback_message,
    resolve_synth_backend,
    synthesize_env,
    valid_envs,
)

FIXTURES = Path(__file__).parents[1] / "synth_fixtures"
GOOD = (FIXTURES / "good_lookup.py").read_text()


NO_CALIBRATION = {"calibration": {"enabled": False}}
"""The cpu profile calibrates each environment with the prepared model; these tests have none."""


def _synthesize(cap, backend, params, root, **kw):
    """`synthesize_env` with the sections the synthesize stage passes it."""
    return synthesize_env(cap, backend, params.synthesize, params.env, params.rollout.split, root, **kw)


def _params(**synth):
    return params_from_dict({"analyst": {"backend": "rules"}, "synthesize": {**NO_CALIBRATION, **synth}})


def _cap(cid: str) -> Capability:
    return Capability(id=cid, name=cid.replace("_", " "), description=f"the {cid} skill", evidence=[])


def test_template_stage_installs_valid_envs_and_records_the_rest(tmp_path):
    write_jsonl(tmp_path / "data/score/kept.jsonl", [_cap("communicate_result"), _cap("say_hello")])
    metrics = run_synthesize(_params(), tmp_path)
    assert metrics["backend"] == "template" and metrics["kept"] == 2 and metrics["valid"] == 1
    assert metrics["envs"]["communicate_result"]["valid"]
    assert "no template for 'say_hello'" in metrics["envs"]["say_hello"]["reason"]
    env_py = tmp_path / "data/envs/communicate_result/env.py"
    assert env_py.is_file() and not (tmp_path / "data/envs/say_hello/env.py").exists()
    verdict = read_json(tmp_path / "data/envs/communicate_result/attempts/01.json")
    assert verdict["valid"] and [c["name"] for c in verdict["checks"]][:4] == ["static", "loads", "contract", "interface"]
    (installed,) = valid_envs(tmp_path)
    assert installed.path == "data/envs/communicate_result/env.py" and installed.attempts == 1
    env_py.write_text(env_py.read_text() + "\n# edited after validation\n")
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        valid_envs(tmp_path)


def _failed_on_first_three(params, root):
    """The target's train tasks, written as the rollout stage writes them, and failed base episodes of the first three
    (the evidence a capability cites), written too."""
    from trace_lib.envs import make_tasks
    from trace_lib.records import Trajectory

    tasks = make_tasks(params.env, "train")
    write_jsonl(root / "data/rollouts/tasks-train.jsonl", tasks)
    evidence = [Trajectory(id=f"{t.id}#0", task_id=t.id, env="retail", family=t.family, split="train", policy_id="p",
                           seed=0, messages=[], reward=0.0, success=False, termination="user_stop", tool_calls=0,
                           invalid_actions=0, tool_errors=0, turns=0, prompt_tokens=0, completion_tokens=0)
                for t in tasks[:3]]
    write_jsonl(root / "data/rollouts/train.jsonl", evidence)
    return tasks, evidence


def test_template_env_draws_the_kinds_its_evidence_failed_on(tmp_path):
    """The failed target episodes behind communicate_result asked a total and a tracking number: its module draws
    those kinds, by those weights; `kinds` given outright replaces what the evidence says."""
    params = params_from_dict({"analyst": {"backend": "rules"}, "synthesize": NO_CALIBRATION,
                               "env": {"families": ["order_total", "order_tracking"], "tasks_per_family": 2}})
    _, evidence = _failed_on_first_three(params, tmp_path)
    cap = _cap("communicate_result").model_copy(update={"evidence": [e.id for e in evidence]})
    write_jsonl(tmp_path / "data/score/kept.jsonl", [cap])
    assert run_synthesize(params, tmp_path)["valid"] == 1
    (manifest,) = valid_envs(tmp_path)
    assert 'KINDS = {"total": 2, "tracking": 1}' in (tmp_path / manifest.path).read_text()
    manifest = _synthesize(cap, "template", params, tmp_path, evidence=evidence, kinds={"refusal": 1})
    assert manifest.valid and 'KINDS = {"refusal": 1}' in (tmp_path / manifest.path).read_text()


def test_an_environment_no_setting_calibrates_is_dropped_and_its_rollouts_charged(tmp_path, tiny_model_dir):
    """A random tiny model never succeeds: every setting tried is out of band, so the environment is not installed,
    its manifest says why, and the episodes it played are in the synthesize ledger (TRACE's budget)."""
    from trace_lib.budget import total_rollouts

    params = params_from_dict({"analyst": {"backend": "rules"},
                               "model": {"out_dir": str(tiny_model_dir), "dtype": "float32"},
                               "train": {"max_new_tokens": 8, "max_steps_per_episode": 2, "reference_samples": 0},
                               "synthesize": {"difficulty": 1, "calibration": {
                                   "enabled": True, "seeds": 2, "samples": 2, "max_attempts": 3}}})
    write_jsonl(tmp_path / "data/score/kept.jsonl", [_cap("communicate_result")])
    metrics = run_synthesize(params, tmp_path)
    env = metrics["envs"]["communicate_result"]
    assert metrics["valid"] == 0 and not env["valid"] and env["reason"].startswith("calibration: no setting in band")
    assert [(a["difficulty"], a["start"]) for a in env["calibration"]["attempts"]] == [
        (1, "opening"), (1, "reads played"), (0, "opening")]
    assert not (tmp_path / "data/envs/communicate_result/env.py").exists() and valid_envs(tmp_path) == []
    spent = total_rollouts([tmp_path / "data/envs/rollouts.jsonl"])
    assert spent["by_key"] == {"synthesize/communicate_result": 12} and env["calibration"]["rollouts"] == 12


def test_a_calibrated_environment_records_its_transfer_check_and_charges_it(tmp_path, tiny_model_dir):
    """A band every rate is in: the first setting fits; the base model then plays the failed target tasks behind the
    capability (two of its three, by `transfer_tasks`) from that start, and those episodes are charged too."""
    from trace_lib.budget import total_rollouts

    params = params_from_dict({"analyst": {"backend": "rules"},
                               "model": {"out_dir": str(tiny_model_dir), "dtype": "float32"},
                               "env": {"families": ["order_total", "order_tracking"], "tasks_per_family": 2},
                               "train": {"max_new_tokens": 8, "max_steps_per_episode": 2},
                               "synthesize": {"difficulty": 0, "calibration": {
                                   "enabled": True, "seeds": 2, "samples": 2, "success_lo": 0.0,
                                   "min_mixed": 0.0, "transfer_tasks": 2}}})
    tasks, evidence = _failed_on_first_three(params, tmp_path)
    write_jsonl(tmp_path / "data/score/kept.jsonl",
                [_cap("communicate_result").model_copy(update={"evidence": [e.id for e in evidence]})])
    env = run_synthesize(params, tmp_path)["envs"]["communicate_result"]
    transfer = env["calibration"]["transfer"]
    assert env["valid"] and env["calibration"]["rollouts"] == 4
    assert transfer["start"] == "opening" and transfer["rollouts"] == 4 and len(transfer["tasks"]) == 2
    assert {t.family for t in tasks if t.id in transfer["tasks"]} == {"order_total", "order_tracking"}
    assert sum(int(kn.split("/")[1]) for kn in transfer["by_family"].values()) == 4
    spent = total_rollouts([tmp_path / "data/envs/rollouts.jsonl"])
    assert spent["by_key"] == {"synthesize/communicate_result": 8}
    (manifest,) = valid_envs(tmp_path)
    assert manifest.calibration["transfer"] == transfer


def test_with_reference_samples_the_kinds_the_base_solves_are_not_drawn_and_references_are_checked(
        tmp_path, tiny_model_dir):
    """The base model solved 4 of its 5 status episodes: with reference samples the environment draws only the total
    and the tracking number its other failures asked; every calibration seed's reference earns full reward, and the
    tiny model's zero success is in band (the references bring the successes)."""
    from trace_lib.envs import make_tasks
    from trace_lib.records import Trajectory

    params = params_from_dict({"analyst": {"backend": "rules"},
                               "model": {"out_dir": str(tiny_model_dir), "dtype": "float32"},
                               "env": {"families": ["order_status", "order_total", "order_tracking"],
                                       "tasks_per_family": 2},
                               "train": {"max_new_tokens": 8, "max_steps_per_episode": 2, "group_size": 8,
                                         "reference_samples": 2},
                               "synthesize": {"difficulty": 2, "calibration": {
                                   "enabled": True, "seeds": 2, "samples": 2, "transfer_tasks": 3}}})
    tasks = make_tasks(params.env, "train")
    write_jsonl(tmp_path / "data/rollouts/tasks-train.jsonl", tasks)
    status = [t for t in tasks if t.family == "order_status"]
    outcomes = [(t, t.family == "order_status") for t in tasks for _ in range(2)] + [(status[0], False)]
    evidence = [Trajectory(id=f"{t.id}#{i}", task_id=t.id, env="retail", family=t.family, split="train",
                           policy_id="p", seed=0, messages=[], reward=float(ok), success=ok, termination="user_stop",
                           tool_calls=0, invalid_actions=0, tool_errors=0, turns=0, prompt_tokens=0,
                           completion_tokens=0) for i, (t, ok) in enumerate(outcomes)]
    write_jsonl(tmp_path / "data/rollouts/train.jsonl", evidence)
    write_jsonl(tmp_path / "data/score/kept.jsonl", [_cap("communicate_result").model_copy(
        update={"evidence": [e.id for e in evidence if not e.success]})])
    env = run_synthesize(params, tmp_path)["envs"]["communicate_result"]
    kinds = env["calibration"]["kinds"]
    assert kinds["asked"] == {"status": 1, "total": 2, "tracking": 2} and kinds["drawn"] == {"total": 2, "tracking": 2}
    assert kinds["base_solved"] == {"status": "4/5", "total": "0/4", "tracking": "0/4"}
    assert 'KINDS = {"total": 2, "tracking": 2}' in (tmp_path / "data/envs/communicate_result/env.py").read_text()
    (attempt,) = env["calibration"]["attempts"]
    assert env["valid"] and attempt["references_full"] == 2 and attempt["in_band"]
    # the transfer check plays the failed tasks of the kinds drawn, not the status task behind the capability
    assert sorted(env["calibration"]["transfer"]["by_family"]) == ["order_total", "order_tracking"]


def test_template_synthesizer_refuses_targets_it_has_no_tools_for(tmp_path):
    params = params_from_dict({"analyst": {"backend": "rules"}, "env": {"name": "tau2-airline"},
                               "synthesize": NO_CALIBRATION})
    manifest = _synthesize(_cap("communicate_result"), "template", params, tmp_path)
    assert not manifest.valid and "not 'tau2-airline'" in manifest.reason


def test_llm_synthesizer_feeds_validation_errors_back_until_valid(tmp_path):
    bad = "import os\n" + GOOD
    replies = [(200, text_reply(f"Here it is:\n```python\n{bad}```")), (200, text_reply(f"```python\n{GOOD}```"))]
    params = _params(backend="anthropic", max_attempts=3)
    with FakeMessagesAPI(replies) as api:
        client = LLMClient("anthropic", "claude-sonnet-4-5", tmp_path / "cache", tmp_path / "ledger.jsonl",
                           base_url=api.url, api_key="k", max_retries=0)
        manifest = _synthesize(_cap("communicate_result"), "anthropic", params, tmp_path, client=client)
    assert manifest.valid and manifest.attempts == 2 and manifest.source == "anthropic"
    first = read_json(tmp_path / "data/envs/communicate_result/attempts/01.json")
    assert not first["valid"] and first["failed"] == "static"
    feedback = api.requests[1]["messages"][-1]["content"]
    assert "rejected by validation" in feedback and "static" in feedback and "'os'" in feedback
    assert "communicate_result" in api.requests[0]["system"][0]["text"]
    assert (tmp_path / "data/envs/communicate_result/env.py").read_text() == GOOD.strip() + "\n"


def test_llm_synthesizer_on_the_phone_gets_the_phone_sdk_and_its_module_validates(tmp_path):
    """The phone target has no database: the prompt describes its worlds, dependencies and milestones, and
    a module written against the SDK's phone part (phone_world / phone_call / phone_rubric) is installed."""
    phone_module = (FIXTURES / "phone_blocked_text.py").read_text()
    params = params_from_dict({"analyst": {"backend": "rules"}, "env": {"name": "phone"},
                               "synthesize": {"backend": "anthropic", "max_attempts": 1}})
    with FakeMessagesAPI([(200, text_reply(f"```python\n{phone_module}```"))]) as api:
        client = LLMClient("anthropic", "claude-sonnet-4-5", tmp_path / "cache", tmp_path / "ledger.jsonl",
                           base_url=api.url, api_key="k", max_retries=0)
        manifest = _synthesize(_cap("state_dependency_resolution"), "anthropic", params, tmp_path, client=client)
    assert manifest.valid and manifest.target_env == "phone", manifest.reason
    system = api.requests[0]["system"][0]["text"]
    assert "an assistant acting on the user's phone" in system and "phone_rubric(trajectory, meta)" in system
    assert "sending a message needs cellular on" in system and "target_db" not in system
    assert "{{" not in system
    assert "set_cellular_service_status" in api.requests[0]["messages"][0]["content"]  # the phone's tools


def test_the_retail_prompt_keeps_the_database_sdk():
    from trace_lib.synth.synthesize import llm_prompt

    system, _ = llm_prompt(_cap("communicate_result"), {"name": "retail", "tools": "core"},
                           {"get_order_details": "read"}, "policy", [])
    assert "a customer-service agent" in system and "target_db(TARGET)" in system and "phone_rubric" not in system
    assert "{{" not in system


def test_phone_rubric_names_what_a_task_lacks():
    from trace_lib import synth_sdk

    with pytest.raises(ValueError, match=r"lacks \['world'\]"):
        synth_sdk.phone_rubric({"messages": []}, {"milestones": []})


def test_llm_synthesizer_gives_up_after_max_attempts_with_the_reason(tmp_path):
    broken = "```python\ndef generate_task(:\n```"
    params = _params(backend="anthropic", max_attempts=2)
    with FakeMessagesAPI([(200, text_reply(broken))]) as api:
        client = LLMClient("anthropic", "claude-sonnet-4-5", tmp_path / "cache", tmp_path / "ledger.jsonl",
                           base_url=api.url, api_key="k", max_retries=0)
        manifest = _synthesize(_cap("communicate_result"), "anthropic", params, tmp_path, client=client)
    assert not manifest.valid and manifest.attempts == 2 and "static" in manifest.reason
    assert len(api.requests) == 2 and not (tmp_path / "data/envs/communicate_result/env.py").exists()
    assert sorted(p.name for p in (tmp_path / "data/envs/communicate_result/attempts").iterdir()) == [
        "01.json", "01.py", "02.json", "02.py"]


def test_extract_module_and_feedback():
    assert extract_module("text\n```python\nx = 1\n```\nmore") == "x = 1\n"
    assert extract_module("x = 2") == "x = 2\n"
    report = {"checks": [{"name": "static", "ok": True, "detail": ""},
                         {"name": "interface", "ok": False, "detail": "missing 'order_id'"}]}
    assert "- interface: missing 'order_id'" in feedback_message(report)
    assert "static" not in feedback_message(report)


def test_auto_backend_follows_the_analyst(monkeypatch):
    from trace_lib.config import AnalystConfig

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    assert resolve_synth_backend(_params().synthesize, AnalystConfig()) == "template"
    served = AnalystConfig(base_url="http://localhost:8000/v1")
    assert resolve_synth_backend(_params().synthesize, served) == "openai"
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    assert resolve_synth_backend(_params().synthesize, served) == "anthropic"
    assert resolve_synth_backend(_params(backend="template").synthesize, AnalystConfig(backend="anthropic")) == "template"


def test_no_kept_capabilities_is_a_clear_empty_result(tmp_path):
    write_jsonl(tmp_path / "data/score/kept.jsonl", [])
    metrics = run_synthesize(_params(), tmp_path)
    assert metrics["valid"] == 0 and "nothing to synthesize" in metrics["note"]
    assert json.loads((tmp_path / "reports/metrics/synthesize.json").read_text())["kept"] == 0


def test_render_task_shows_what_agent_and_customer_see():
    task = Task(id="communicate_result-train-3", env="synthetic", split="train", family="communicate_result",
                instruction="Help the customer.", difficulty=2,
                user=UserScenario(reason_for_call="What is my balance?", known_info={"user_id": "u1"}),
                gold_actions=[ToolCall(name="get_user", arguments={"user_id": "u1", "full": True}),
                              ToolCall(name="list_orders")],
                required_outputs=["42.00"])
    assert render_task(task).splitlines() == [
        "=== communicate_result-train-3 (difficulty 2)",
        "instruction: Help the customer.",
        "customer opens: What is my balance?",
        "customer knows: {'user_id': 'u1'}",
        "gold actions: get_user(user_id='u1', full=True); list_orders()",
        "must say: ['42.00']",
    ]
    bare = task.model_copy(update={"gold_actions": [], "required_outputs": []})
    assert "gold actions: (none)" in render_task(bare) and render_task(bare).endswith("must say: []")

