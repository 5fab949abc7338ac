"""Provenance: each kept capability joined from its evidence to the test tasks it changed, and the pages showing it."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from trace_lib.evaluation.pages import viewer_page, viewer_rows
from trace_lib.evaluation.provenance import changed_tasks, provenance, read_run
from trace_lib.io import write_jsonl
from trace_lib.paths import Paths
from trace_lib.records import (
    AdapterManifest,
    Capability,
    CapabilityScore,
    Label,
    Message,
    SyntheticEnvManifest,
    ToolCall,
    Trajectory,
)

MODULE = '"""Synthetic environment for `say_it`.\n\nEpisodes: the user asks the status of an order."""\nX = 1\n'


def episode(tid: str, task: str, family: str, success: bool, split: str = "test", adapter: str | None = None,
            said: str = "It is pending.") -> Trajectory:
    messages = [Message(role="system", content="policy " * 80), Message(role="user", content=f"status of {task}?"),
                Message(role="assistant", tool_calls=[ToolCall(name="get_order_details", arguments={"order_id": "#W1"})]),
                Message(role="tool", content='{"status": "pending"}' + " " * 400), Message(role="assistant", content=said)]
    return Trajectory(id=tid, task_id=task, env="retail", family=family, split=split, policy_id="p", adapter=adapter,
                      seed=0, messages=messages, reward=float(success), success=success, termination="user_stop",
                      tool_calls=1, invalid_actions=0, tool_errors=0, turns=2, prompt_tokens=0, completion_tokens=0)


def write_run(root: Path, *, trained: bool = True, fixes: bool = True) -> None:
    """A run that kept `say_it` (evidence: two failed rollouts), installed its environment, trained its adapter and
    evaluated the base model, TRACE and the adapter alone on four test tasks."""
    p = Paths(root)
    cap = Capability(id="say_it", name="Say it", description="Tell the user the fact.", recognition="never said it",
                     evidence=["t1#0", "t2#0"], source="rules")
    write_jsonl(p.kept, [cap])
    write_jsonl(p.scores, [CapabilityScore(capability_id="say_it", n_pos=3, n_neg=5, e_pos=1, e_neg=5, er_pos=0.33,
                                           er_neg=1.0, delta=0.67, coverage=0.6, delta_ci=(0.2, 0.9), kept=True,
                                           kept_runs=3, n_runs=3)])
    write_jsonl(p.labels, [Label(trajectory_id="t1#0", capability_id="say_it", label="LACKING", rationale="never said 'pending'"),
                           Label(trajectory_id="t1#0", capability_id="say_it", label="LACKING", rationale="never said 'pending'", run=1),
                           Label(trajectory_id="t3#0", capability_id="say_it", label="PRESENT")])
    write_jsonl(p.rollouts("train"), [episode("t1#0", "t1", "order_status", False, "train", said="Hello."),
                                      episode("t2#0", "t2", "order_total", False, "train", said="Bye."),
                                      episode("t3#0", "t3", "order_status", True, "train")])
    (p.envs / "say_it").mkdir(parents=True)
    (p.envs / "say_it" / "env.py").write_text(MODULE)
    write_jsonl(p.env_manifests, [SyntheticEnvManifest(
        capability_id="say_it", source="template", path="data/envs/say_it/env.py", sha256="abc", target_env="retail",
        valid=True, difficulty={"value": 0}, calibration={"attempts": [
            {"difficulty": 0, "start": "opening", "success": 0.25, "mixed_groups": 0.5, "rollouts": 48, "in_band": True}],
            "transfer": {"start": "opening", "tasks": ["t1", "t2"], "rollouts": 16, "successes": 1, "success": 0.0625,
                         "mixed_groups": 0.5, "by_family": {"order_status": "1/8", "order_total": "0/8"}}})])
    write_jsonl(p.synth_rollouts, [{"key": "say_it", "rollouts": 48, "stage": "synthesize"}])
    if trained:
        write_jsonl(p.adapter_manifests, [AdapterManifest(capability_id="say_it", path="data/adapters/say_it",
                                                          base_model="m", env_sha256="abc", backend="trl",
                                                          rollouts_used=96, iterations=3, final_reward=0.4)])
        write_jsonl(p.adapter("say_it") / "train_log.jsonl",
                    [{"iteration": i, "rollouts": 32 * i, "success_rate": r, "reward": r} for i, r in
                     ((1, 0.2), (2, 0.3), (3, 0.5))])
        write_jsonl(p.train_ledger("say_it"), [{"key": "say_it", "rollouts": 32, "stage": "train"}] * 3)
    base = [episode(f"b{i}", f"x{i}", "order_status", ok) for i, ok in enumerate((False, True, False, True))]
    trace = [episode(f"r{i}", f"x{i}", "order_status", ok, adapter=a) for i, (ok, a) in
             enumerate(((fixes, "say_it"), (False, "say_it"), (False, None), (True, None)))]
    write_jsonl(p.eval_episodes("base"), base)
    write_jsonl(p.eval_episodes("trace_argmax"), trace)
    if trained:
        write_jsonl(p.eval_episodes("single_say_it"), [episode(f"s{i}", f"x{i}", "order_status", i < 2)
                                                       for i in range(4)])


def test_the_record_shows_a_task_its_environment_generates(tmp_path: Path):
    from trace_lib.config import Params
    from trace_lib.synth.synthesize import target_spec
    from trace_lib.synth.templates import render_template_module

    write_run(tmp_path)
    (Paths(tmp_path).envs / "say_it" / "env.py").write_text(
        render_template_module("communicate_result", target_spec(Params().env), 0, {"status": 1}))
    sample = provenance(read_run(tmp_path))[0]["environment"]["sample_task"]
    assert sample["seed"] == 0 and sample["difficulty"] == 0 and "status of order" in sample["opening"]
    assert [a["name"] for a in sample["gold_actions"]] == ["get_order_details"] and len(sample["required_outputs"]) == 1


def test_changed_tasks_pairs_by_task_and_keeps_to_the_routed_ones():
    base = [episode("a", "x0", "f", False), episode("b", "x1", "f", True), episode("c", "x2", "f", False)]
    other = [episode("d", "x0", "f", True), episode("e", "x1", "f", False), episode("g", "x2", "f", True)]
    assert changed_tasks(base, other) == {"fixed": ["x0", "x2"], "broken": ["x1"]}
    assert changed_tasks(base, other, {"x0", "x1"}) == {"fixed": ["x0"], "broken": ["x1"]}
    assert changed_tasks(base, []) == {"fixed": [], "broken": []}


def test_a_capability_record_joins_every_link_of_the_chain(tmp_path: Path):
    write_run(tmp_path)
    (rec,) = provenance(read_run(tmp_path))
    assert [e["trajectory_id"] for e in rec["evidence"]] == ["t1#0", "t2#0"]
    first = rec["evidence"][0]
    assert first["rationale"] == ["never said 'pending'"] and first["quote"] == "Hello." and first["last_agent_turn"] == 4
    assert rec["evidence"][1]["rationale"] == [] and rec["evidence"][1]["family"] == "order_total"
    assert rec["score"]["delta"] == 0.67 and rec["score"]["kept_runs"] == 3 and rec["score"]["delta_ci"] == [0.2, 0.9]
    env = rec["environment"]
    assert env["installed"] and env["sha256"] == "abc" and env["rollouts"] == 48
    assert env["sample_task"]["error"].startswith("SandboxError")  # the stand-in module is no environment
    assert env["description"].startswith("Synthetic environment for `say_it`")
    adapter = rec["adapter"]
    assert adapter["env_matches"] and adapter["rollouts"] == 96 and [r["success_rate"] for r in adapter["curve"]] == [0.2, 0.3, 0.5]
    ev = rec["evaluation"]
    assert ev["trace_key"] == "trace_argmax" and ev["routed"] == ["x0", "x1"]
    assert ev["trace"] == {"fixed": ["x0"], "broken": ["x1"]}  # x3 was solved and kept by the base route
    assert ev["alone"] == {"fixed": ["x0"], "broken": ["x3"]}
    assert rec["rollouts"] == {"calibration": 48, "training": 96}


def _links(page: Path) -> list[str]:
    return [html.unescape(h) for h in re.findall(r'href="([^"#]+)', page.read_text())]


def test_the_report_writes_a_page_per_capability_and_the_viewer_and_every_link_resolves(tmp_path: Path):
    from trace_lib.config import Params
    from trace_lib.stages.report import run_report

    write_run(tmp_path)
    run_report(Params(), tmp_path)
    p = Paths(tmp_path)
    assert json.loads(p.provenance.read_text())[0]["capability"]["id"] == "say_it"
    page = p.capability_pages / "say_it.html"
    text = page.read_text()
    assert 'href="capabilities/say_it.html"' in p.index.read_text() and 'href="trajectories.html"' in p.index.read_text()
    for source in (p.index, page, p.trajectory_viewer):
        for link in _links(source):
            if link == "notebooks/08_report.ipynb":  # the report's own notebook, which papermill is writing
                continue
            assert (source.parent / link).exists(), f"{source.name}: broken link {link}"
    fixed = text[text.index("Fixed by TRACE"):text.index("Broken by TRACE")]
    assert fixed.count('class="ep"') == 2 and 'id="b0"' in fixed and 'id="r0"' in fixed  # base and TRACE, side by side
    assert "never said &#x27;pending&#x27;" in text and "<polyline" in text and "difficulty 0, opening" in text
    assert ("Transfer check before training: the base model on 2 failed target train tasks behind it, from the opening, "
            "succeeded in 1 of 16 episodes (order_status 1/8, order_total 0/8)") in text
    assert "<details" in text  # the system prompt and the long tool result fold


def test_a_run_where_no_task_changed_says_so(tmp_path: Path):
    from trace_lib.config import Params
    from trace_lib.stages.report import run_report

    write_run(tmp_path, trained=False, fixes=False)
    run_report(Params(), tmp_path)
    text = (Paths(tmp_path).capability_pages / "say_it.html").read_text()
    assert "No test task was fixed." in text and "No adapter was trained for it." in text
    assert "no adapter" in Paths(tmp_path).index.read_text()


def test_a_page_of_an_earlier_runs_capability_does_not_stay(tmp_path: Path):
    from trace_lib.config import Params
    from trace_lib.stages.report import run_report

    stale = Paths(tmp_path).capability_pages / "gone.html"
    stale.parent.mkdir(parents=True)
    stale.write_text("old")
    run_report(Params(), tmp_path)
    assert not stale.exists() and json.loads(Paths(tmp_path).provenance.read_text()) == []
    assert "No capability was kept" in Paths(tmp_path).index.read_text()


def test_the_viewer_holds_every_episode_with_its_filters(tmp_path: Path):
    write_run(tmp_path)
    run = read_run(tmp_path)
    rows = viewer_rows(run.train_episodes, run.evaluation, {"t1#0": ["say_it"]})
    assert len(rows) == 3 + 4 + 4 + 4
    assert {r["source"] for r in rows} == {"rollout (train split)", "evaluation: base", "evaluation: single_say_it",
                                           "evaluation: trace_argmax"}
    assert rows[0]["capability"] == "say_it" and rows[1]["capability"] == "none"
    page = viewer_page(rows)
    payload = re.search(r'<script type="application/json" id="episodes">(.*?)</script>', page, re.S)[1]
    assert len(json.loads(payload)) == len(rows) and "</div>" not in payload  # no early </script> in the data


def test_the_pages_render_in_chromium(tmp_path: Path):
    from browser import browser_check, chromium

    from trace_lib.config import Params
    from trace_lib.stages.report import run_report

    chromium()
    write_run(tmp_path)
    run_report(Params(), tmp_path)
    p = Paths(tmp_path)
    for page in (p.capability_pages / "say_it.html", p.trajectory_viewer):
        seen = browser_check(page, tmp_path)
        assert seen["fetched"] == [], f"{page.name} fetched something from the network"
    viewer = p.trajectory_viewer
    probe = viewer.with_name(".dom.html")
    probe.write_text(viewer.read_text())
    import subprocess

    out = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          f"--user-data-dir={tmp_path / 'profile2'}", "--virtual-time-budget=5000", "--dump-dom",
                          probe.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert "15 of 15 episodes" in out and out.count('class="ep"') == 15


@pytest.mark.parametrize("missing", ["kept", "evaluation"])
def test_a_run_missing_a_stage_still_gives_records(tmp_path: Path, missing: str):
    write_run(tmp_path)
    p = Paths(tmp_path)
    if missing == "kept":
        p.kept.unlink()
        assert provenance(read_run(tmp_path)) == []
    else:
        for f in p.eval_trajectories.glob("*.jsonl"):
            f.unlink()
        (rec,) = provenance(read_run(tmp_path))
        assert rec["evaluation"] == {"trace_key": None, "routed": [], "trace": {"fixed": [], "broken": []},
                                     "alone": None}
