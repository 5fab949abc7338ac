"""Discovery: batches, rules proposals, merging, the LLM path through a fake Messages API, and the
discover + score stages on scripted retail rollouts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from retail_play import play_retail, retail_kinds, retail_tasks
from fake_anthropic import FakeMessagesAPI, text_reply

from trace_lib.analyst.discover import (
    Proposal,
    failure_batches,
    merge_capabilities,
    merge_proposals,
    proposal_records,
    proposal_rows,
    propose_all,
    propose_llm,
    propose_rules,
    slug,
)
from trace_lib.llm import LLMClient, ledger_totals
from trace_lib.analyst.render import cut, render_for_analyst, tools_block
from trace_lib.config import DiscoverConfig, params_from_dict
from trace_lib.io import read_jsonl, write_jsonl
from trace_lib.paths import Paths
from trace_lib.records import Capability, Label, Trajectory
from trace_lib.stages.discover import run_discover
from trace_lib.stages.score import run_score


@pytest.fixture(scope="module")
def retail_runs():
    tasks = retail_tasks(2)
    trajs = play_retail(tasks, "gold") + play_retail(tasks, "no_confirm") + play_retail(tasks, "silent")
    return tasks, trajs


def test_failure_batches_are_seeded_and_order_free(retail_runs):
    _, trajs = retail_runs
    fails = [t for t in trajs if not t.success]
    a = failure_batches(fails, 5, seed=1)
    assert [[t.id for t in b] for b in a] == [[t.id for t in b] for b in failure_batches(fails[::-1], 5, seed=1)]
    assert [len(b) for b in a] == [5] * (len(fails) // 5) + ([len(fails) % 5] if len(fails) % 5 else [])
    assert sorted(t.id for b in a for t in b) == sorted(t.id for t in fails)
    assert [t.id for t in failure_batches(fails, 5, seed=2)[0]] != [t.id for t in a[0]]
    assert len(failure_batches(fails, 5, seed=1, max_batches=1)) == 1
    assert failure_batches([], 5, seed=0) == []


def test_rules_proposals_are_the_detectors_that_fire_on_failures(retail_runs):
    tasks, trajs = retail_runs
    by_id = {t.id: t for t in tasks}
    fails = [t for t in trajs if not t.success]
    caps = {c.id: c for c in propose_rules(fails, by_id, retail_kinds())}
    assert {"confirmation_before_write", "communicate_result"} <= set(caps)
    assert all(e.endswith("-no_confirm") for e in caps["confirmation_before_write"].evidence)
    assert all(e.endswith("-silent") for e in caps["communicate_result"].evidence)
    assert "tool_call_precision" not in caps  # the scripted agent's calls are all well-formed
    strict = propose_rules(fails, by_id, retail_kinds(), min_evidence=len(fails) + 1)
    assert strict == []


def test_discover_with_rules_pools_runs_and_keeps_evidence(retail_runs):
    tasks, trajs = retail_runs
    cfg = DiscoverConfig(batch_size=4, runs=3)
    proposals, errors = propose_all(trajs, tasks, retail_kinds(), cfg, None, seed=0)
    assert errors == [] and {p.run for p in proposals} == {0, 1, 2}
    caps = merge_proposals(proposals, cfg, None)
    ids = [c.id for c in caps]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    conf = next(c for c in caps if c.id == "confirmation_before_write")
    assert conf.evidence == sorted(t.id for t in trajs if t.id.endswith("-no_confirm") and not t.success)
    assert conf.source == "rules" and conf.recognition


def _fake_embed(texts):
    # Texts sharing their first word point the same way; others are orthogonal.
    words = sorted({t.split()[0].lower() for t in texts})
    return np.array([[1.0 if t.split()[0].lower() == w else 0.0 for w in words] for t in texts])


def test_merge_groups_near_duplicates_and_unions_evidence():
    caps = [Capability(id="verify_status", name="Verify status", description="d1", evidence=["t1"]),
            Capability(id="verify_order_state", name="Verify order state", description="d2", evidence=["t2", "t3"]),
            Capability(id="confirm_first", name="Confirm first", description="d3", evidence=["t4"]),
            Capability(id="verify_status", name="Verify status", description="d1", evidence=["t5"])]
    merged = merge_capabilities(caps, "embedding", 0.9, embed=_fake_embed)
    assert [c.id for c in merged] == ["confirm_first", "verify_order_state"]
    assert merged[1].evidence == ["t1", "t2", "t3", "t5"]  # best-supported wording represents the group
    by_name = merge_capabilities(caps, "name")
    assert [c.id for c in by_name] == ["confirm_first", "verify_order_state", "verify_status"]
    assert by_name[2].evidence == ["t1", "t5"]


def test_merge_keeps_distinct_skills_with_colliding_ids_apart():
    caps = [Capability(id="a", name="Check!", description="x", evidence=["1"]),
            Capability(id="a", name="Check?", description="y", evidence=["2"])]
    out = merge_capabilities(caps, "embedding", 0.99, embed=lambda ts: np.eye(len(ts)))
    assert [c.id for c in out] == ["a"]  # same id always merges first
    assert slug("  Verify the Order's Status!! ") == "verify_the_order_s_status"


def test_merge_with_minilm_embeddings():
    caps = [Capability(id="a", name="Verify order status before cancelling",
                       description="Check that the order is pending before cancelling it.", evidence=["1", "2"]),
            Capability(id="b", name="Check the order's status before a cancellation",
                       description="Look up whether the order is still pending before you cancel.", evidence=["3"]),
            Capability(id="c", name="Tell the user the gift card balance",
                       description="Report the numeric balance returned by the tool.", evidence=["4"])]
    out = merge_capabilities(caps, "embedding", 0.7)
    assert [c.id for c in out] == ["a", "c"] and out[0].evidence == ["1", "2", "3"]


LLM_REPLY = {"capabilities": [
    {"name": "Confirmation before writes", "description": "Ask before changing an order.",
     "recognition": "PRESENT when ...", "evidence": ["ID0", "not-in-batch"]},
    {"name": "Say the result", "description": "Tell the user what was found.",
     "recognition": "LACKING when ...", "evidence": []}]}


def test_propose_llm_through_the_messages_api(tmp_path, retail_runs):
    tasks, trajs = retail_runs
    batch = [t for t in trajs if not t.success][:3]
    reply = json.loads(json.dumps(LLM_REPLY).replace("ID0", batch[0].id))
    cfg = DiscoverConfig(batch_size=3)
    by_id = {t.id: t for t in tasks}

    def client(url):
        return LLMClient("anthropic", "claude-sonnet-4-5", tmp_path / "cache", tmp_path / "ledger.jsonl",
                         base_url=url, api_key="k", max_retries=0)

    with FakeMessagesAPI([(200, text_reply(json.dumps(reply)))]) as api:
        caps = propose_llm(batch, by_id, retail_kinds(), cfg, client(api.url))
    assert [c.id for c in caps] == ["confirmation_before_writes", "say_the_result"]
    assert caps[0].evidence == [batch[0].id] and caps[0].source == "anthropic:claude-sonnet-4-5"
    prompt = api.requests[0]["messages"][0]["content"]
    assert all(t.id in prompt for t in batch) and "Task: " in prompt
    assert "cancel_pending_order: write" in api.requests[0]["system"][0]["text"]
    with FakeMessagesAPI([]) as api2:
        again = propose_llm(batch, by_id, retail_kinds(), cfg, client(api2.url))
    assert again == caps and api2.requests == []
    assert ledger_totals(tmp_path / "ledger.jsonl")["discover"]["calls"] == 2


class FakeMerger:
    backend, model = "fake", "fake"

    def complete_json(self, system, messages, schema, *, max_tokens, temperature=0.0, stage=""):
        return {"groups": [{"name": "Order status check", "description": "merged", "recognition": "r",
                            "members": ["a", "b", "ghost"]}]}


def test_merge_with_the_analyst_keeps_forgotten_proposals():
    caps = [Capability(id=i, name=i.upper() * 3, description="d", evidence=[i]) for i in "abc"]
    out = merge_capabilities(caps, "analyst", client=FakeMerger())
    assert [(c.id, c.evidence) for c in out] == [("c", ["c"]), ("order_status_check", ["a", "b"])]
    assert out[1].description == "merged"


def _params(tmp_path):
    return params_from_dict({"env": {"families": [], "tasks_per_family": 2}, "analyst": {"backend": "rules"},
                             "discover": {"batch_size": 10, "runs": 2}, "score": {"n_boot": 200, "max_kept": None}})


def test_discover_and_score_stages_on_retail(tmp_path, retail_runs):
    _, trajs = retail_runs
    params = _params(tmp_path)
    paths = Paths(tmp_path)
    write_jsonl(paths.rollouts(params.rollout.split), trajs)
    d = run_discover(params, tmp_path)
    assert d["analyst"] == "rules" and d["failures"] == sum(not t.success for t in trajs) and d["candidates"] >= 2
    assert json.loads(paths.metrics("discover").read_text()) == d
    proposals = proposal_rows(read_jsonl(paths.proposals, Capability))
    assert len(proposals) == d["proposals"] and set(proposals["run"]) == {0, 1}
    assert {c.id for c in read_jsonl(paths.capabilities, Capability)} == set(proposals["capability"])
    s = run_score(params, tmp_path)
    assert s["kept"] == ["communicate_result", "confirmation_before_write"]
    assert json.loads(paths.metrics("score").read_text()) == s
    n_tags = len({tag for t in retail_tasks(2) for tag in t.capability_tags})
    assert s["ground_truth"]["precision"] == 1.0 and s["ground_truth"]["recall"] == pytest.approx(2 / n_tags)
    kept = read_jsonl(paths.kept, Capability)
    assert [c.id for c in kept] == s["kept"] and all(c.evidence for c in kept)
    assert len(read_jsonl(paths.labels, Label)) == len(trajs) * d["candidates"]
    written = [paths.proposals, paths.capabilities, paths.labels, paths.scores, paths.score_runs, paths.kept,
               paths.metrics("discover"), paths.metrics("score")]
    assert not paths.discover_ledger.exists() and not paths.score_ledger.exists()  # the rules analyst calls no LLM
    before = {p: p.read_bytes() for p in written}
    run_discover(params, tmp_path)
    run_score(params, tmp_path)
    assert {p: p.read_bytes() for p in before} == before


def test_discover_stage_without_failures(tmp_path, retail_runs):
    _, trajs = retail_runs
    params = _params(tmp_path)
    write_jsonl(Paths(tmp_path).rollouts(params.rollout.split), [t for t in trajs if t.success])
    d = run_discover(params, tmp_path)
    assert d["candidates"] == 0 and d["note"] == "no failures: nothing to discover"
    s = run_score(params, tmp_path)
    assert s["kept"] == [] and s["ground_truth"]["precision"] is None


def test_trajectories_round_trip_for_the_stage(retail_runs):
    _, trajs = retail_runs
    assert Trajectory.model_validate_json(trajs[0].model_dump_json()) == trajs[0]


def test_proposal_records_keep_run_and_batch_in_the_source():
    cap = Capability(id="confirm_first", name="Confirm first", description="d", evidence=["t1", "t2"],
                     source="anthropic:claude-sonnet-4-5")
    records = proposal_records([Proposal(0, 3, cap), Proposal(11, 0, cap.model_copy(update={"evidence": []}))])
    assert [r.source for r in records] == ["anthropic:claude-sonnet-4-5 run 0 batch 3",
                                           "anthropic:claude-sonnet-4-5 run 11 batch 0"]
    assert records[0].model_copy(update={"source": cap.source}) == cap  # only the source changes
    rows = proposal_rows(records + [cap])
    assert list(rows.columns) == ["capability", "evidence", "source", "run", "batch"]
    assert rows[["capability", "evidence"]].values.tolist() == [["confirm_first", 2], ["confirm_first", 0],
                                                                ["confirm_first", 2]]
    assert rows["run"].tolist()[:2] == [0, 11] and rows["batch"].tolist()[:2] == [3, 0]
    assert rows[["run", "batch"]].iloc[2].isna().all()  # a source without 'run R batch B'
    empty = proposal_rows([])
    assert empty.empty and list(empty.columns) == list(rows.columns)


def test_analyst_view_of_a_trajectory(retail_runs):
    tasks, trajs = retail_runs
    traj = next(t for t in trajs if not t.success)
    task = next(t for t in tasks if t.id == traj.task_id)
    text = render_for_analyst(traj, task, 50)
    assert text.startswith(f"Task: {task.instruction}\n[{traj.id}] family=")
    assert len(text) <= len(f"Task: {task.instruction}\n") + 400 + len("\n…[99999 chars cut]")
    assert "chars cut]" in text and render_for_analyst(traj, None, 50).startswith(f"[{traj.id}]")
    assert cut("abcdef", 6) == "abcdef" and cut("abcdef", 4) == "abcd\n…[2 chars cut]"
    assert tools_block({"b": "write", "a": "read"}) == "- a: read\n- b: write" and tools_block({}) == "- (none)"
