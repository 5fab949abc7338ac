"""End to end: `dvc repro` of the existing stages in a scratch copy of the repo, on tiny settings.

The tiny random model stands in for SmolLM2 so this runs in about a minute; the real model has its
own slow test. A second `dvc repro` must do nothing.
"""

from __future__ import annotations

import html
import json
import os
import re
import secrets
import subprocess
from pathlib import Path

import pytest
import yaml
from scratch_repo import BIN, make_scratch_repo, run_checked, tiny_params


pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def scratch_repo(tmp_path_factory, tiny_model_dir) -> Path:
    return make_scratch_repo(tmp_path_factory.mktemp("repo"), tiny_params(Path(tiny_model_dir)))


def test_dvc_repro_runs_rollout_and_is_idempotent(scratch_repo: Path):
    run_checked([str(BIN / "dvc"), "repro", "rollout"], scratch_repo)
    traj_file = scratch_repo / "data/rollouts/train.jsonl"
    rows = [json.loads(line) for line in traj_file.read_text().splitlines()]
    assert rows and all(r["policy_id"] and r["messages"][0]["role"] == "system" for r in rows)
    metrics = json.loads((scratch_repo / "reports/metrics/rollout.json").read_text())
    assert metrics["n"] == len(rows)
    assert 0.0 <= metrics["ci_low"] <= metrics["success_rate"] <= metrics["ci_high"] <= 1.0
    assert set(metrics["by_family"]) == {r["family"] for r in rows}
    assert (scratch_repo / "reports/figures/rollout_success_by_family.png").stat().st_size > 1000
    assert (scratch_repo / "reports/notebooks/01_rollout.ipynb").exists()
    first = traj_file.read_bytes()

    again = run_checked([str(BIN / "dvc"), "repro", "rollout"], scratch_repo)
    assert "didn't change" in again.stdout or "up to date" in again.stdout
    assert traj_file.read_bytes() == first


def test_same_seed_same_bytes(scratch_repo: Path):
    """Forcing the stage to run again reproduces the trajectories byte for byte."""
    traj_file = scratch_repo / "data/rollouts/train.jsonl"
    run_checked([str(BIN / "dvc"), "repro", "rollout"], scratch_repo)
    before = traj_file.read_bytes()
    run_checked([str(BIN / "dvc"), "repro", "--force", "--single-item", "rollout"], scratch_repo)
    assert traj_file.read_bytes() == before


def test_bad_params_key_fails_before_any_work(scratch_repo: Path):
    params = yaml.safe_load((scratch_repo / "params.yaml").read_text())
    params["rollout"]["temperatur"] = 1.0
    bad = scratch_repo / "bad_params.yaml"
    bad.write_text(yaml.safe_dump(params))
    out = scratch_repo / "bad.ipynb"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        [str(BIN / "papermill"), "--no-progress-bar", "-k", "python3", "notebooks/01_rollout.ipynb", str(out),
         "-p", "params_path", str(bad), "-p", "root", "scratch_out"],
        cwd=scratch_repo, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "rollout.temperatur: unknown key" in proc.stdout + proc.stderr
    assert not (scratch_repo / "scratch_out").exists()


def test_dvc_repro_score_runs_discover_and_score(scratch_repo: Path):
    """`dvc repro score` pulls discover and score after the rollouts; the analyst cache is no output."""
    params_file = scratch_repo / "params.yaml"
    params = yaml.safe_load(params_file.read_text())
    params["analyst"]["backend"] = "rules"  # offline whatever keys the environment holds
    params_file.write_text(yaml.safe_dump(params))
    run_checked([str(BIN / "dvc"), "repro", "score"], scratch_repo)

    caps = [json.loads(line) for line in (scratch_repo / "data/discover/capabilities.jsonl").read_text().splitlines()]
    scores = [json.loads(line) for line in (scratch_repo / "data/score/scores.jsonl").read_text().splitlines()]
    assert sorted(s["capability_id"] for s in scores) == sorted(c["id"] for c in caps)
    metrics = json.loads((scratch_repo / "reports/metrics/score.json").read_text())
    assert metrics["analyst"] == "rules" and metrics["candidates"] == len(caps)
    assert set(metrics["reasons"]) == {c["id"] for c in caps} and "ground_truth" in metrics
    assert json.loads((scratch_repo / "reports/metrics/discover.json").read_text())["analyst"] == "rules"
    for name in ("score_error_rates", "score_delta_coverage", "score_stability"):
        assert (scratch_repo / f"reports/figures/{name}.png").stat().st_size > 1000
    assert (scratch_repo / "reports/notebooks/03_score.ipynb").exists()

    again = run_checked([str(BIN / "dvc"), "repro", "score"], scratch_repo)
    assert "didn't change" in again.stdout or "up to date" in again.stdout


def test_dvc_repro_train_synthesizes_and_trains_adapters(scratch_repo: Path):
    """`dvc repro train`: template environments for the kept capabilities, then one LoRA adapter each.

    The tiny random model never succeeds, so `score.empty_rate: 0` lets capabilities be kept (ER+ = 0).
    """
    params_file = scratch_repo / "params.yaml"
    params = yaml.safe_load(params_file.read_text())
    params["analyst"]["backend"] = "rules"
    params["score"]["empty_rate"] = 0.0
    # in lockstep (`train.lockstep`): the adapters, the baselines and the student share their sampling rounds
    params["train"] = {"iterations": 1, "groups": 1, "group_size": 2, "reference_samples": 1, "max_new_tokens": 8,
                       "max_steps_per_episode": 2, "threads": 1, "lockstep": True}
    params_file.write_text(yaml.safe_dump(params))
    run_checked([str(BIN / "dvc"), "repro", "train"], scratch_repo)

    synth = json.loads((scratch_repo / "reports/metrics/synthesize.json").read_text())
    kept = [json.loads(line)["id"] for line in (scratch_repo / "data/score/kept.jsonl").read_text().splitlines()]
    assert kept and synth["kept"] == len(kept) and synth["valid"] >= 1
    installed = [c for c in kept if synth["envs"][c]["valid"]]
    for cid in installed:
        assert (scratch_repo / f"data/envs/{cid}/env.py").is_file()
    train = json.loads((scratch_repo / "reports/metrics/train.json").read_text())
    # the capability adapters, then the cpu profile's two baselines at TRACE's budget (discovery included): GRPO
    # on target and the same from the reads played; no student (merged data and distillation: gpu, paper)
    after = ["grpo_target", "grpo_target_late"]
    assert sorted(train["adapters"]) == sorted([*installed, *after])
    late = [json.loads(x) for x in (scratch_repo / "data/adapters/_baselines/grpo_target_late/train_log.jsonl").open()]
    assert late and all(r["preplayed_steps"] > 0 for r in late)  # started after the reference's reads
    per_iteration = 2
    for name in after:
        assert train["adapters"][name]["rollouts"] == train["trace_budget"] // per_iteration * per_iteration
        assert (scratch_repo / f"data/adapters/_baselines/{name}/adapter_config.json").is_file()
    for cid in installed:
        folder = scratch_repo / f"data/adapters/{cid}"
        assert (folder / "adapter_config.json").is_file() and (folder / "train_log.jsonl").is_file()
        assert train["adapters"][cid]["rollouts"] == 2
        ledger = scratch_repo / f"data/train/{cid}/rollouts.jsonl"
        assert sum(json.loads(line)["rollouts"] for line in ledger.read_text().splitlines()) == 2
    assert (scratch_repo / "reports/figures/train_curves.png").stat().st_size > 1000
    assert (scratch_repo / "reports/figures/train_vs_base.png").stat().st_size > 1000
    # DVCLive's files, one folder per adapter (dvc plots: x step, one TSV per metric), its last values, its episodes
    curves = sorted(p.name for p in (scratch_repo / "reports/train").iterdir())
    assert curves == sorted([*installed, *after])
    lines = {name: (scratch_repo / f"reports/train/{name}/plots/metrics/reward.tsv").read_text().splitlines()
             for name in curves}  # header + one row per iteration
    assert all(rows[0] == "step\treward" for rows in lines.values())
    assert {name: len(rows) - 1 for name, rows in lines.items()} == {
        name: train["adapters"][name]["iterations"] for name in lines}
    assert all(len(lines[cid]) == 2 for cid in installed)
    summaries = {p.stem: json.loads(p.read_text()) for p in (scratch_repo / "reports/metrics/train").glob("*.json")}
    assert sorted(summaries) == curves and all(s["step"] == len(lines[n]) - 1 for n, s in summaries.items())
    assert all((scratch_repo / f"reports/tables/train_episodes/{name}.tsv").read_text().startswith("step\tsource")
               for name in curves)
    shown = json.loads(run_checked([str(BIN / "dvc"), "plots", "show", "--json"], scratch_repo).stdout)
    assert not [e for e in shown.get("errors", []) if e["name"].startswith("reports/train")]  # later stages: not run
    assert shown["data"][f"reports/train/{curves[0]}/plots/metrics/reward.tsv"][0]["content"]["data"]["values"]
    again = run_checked([str(BIN / "dvc"), "repro", "train"], scratch_repo)
    assert "didn't change" in again.stdout or "up to date" in again.stdout


def test_dvc_repro_report_evaluates_scales_and_writes_the_html_index(scratch_repo: Path):
    """`dvc repro report` after training: evaluate (base + TRACE argmax), scaling, then the HTML report."""
    params_file = scratch_repo / "params.yaml"
    params = yaml.safe_load(params_file.read_text())
    params["analyst"]["backend"] = "rules"  # as in the train test, so this one also runs alone
    params["score"]["empty_rate"] = 0.0
    params["train"] = {"iterations": 1, "groups": 1, "group_size": 2, "reference_samples": 1, "max_new_tokens": 8,
                       "max_steps_per_episode": 2, "threads": 1, "reward": {"efficiency": False}, "lockstep": True}
    params["evaluate"].update({"n_boot": 100})
    params_file.write_text(yaml.safe_dump(params))
    run_checked([str(BIN / "dvc"), "repro", "report"], scratch_repo)

    ev = json.loads((scratch_repo / "reports/metrics/evaluate.json").read_text())
    ran = {k for k, v in ev["methods"].items() if v["status"] == "run"}
    # the cpu profile's methods: every one but GEPA (no LLM) and TRACE top-p, baselines at TRACE's budget
    assert ran == {"base", "grpo_target", "grpo_target_late", "linear_merge", "oracle_route", "trace_argmax",
                   "single_best", "hindsight_route"} | {k for k in ev["methods"] if k.startswith("single_")}
    assert ev["methods"]["merged_data"]["reason"].startswith("left out of the cpu profile: add 'merged_data'")
    # an argmax router takes one of the routes the bound chooses among, so it never solves more
    solved = {k: ev["methods"][k]["overall"]["successes"] for k in ("hindsight_route", "trace_argmax", "oracle_route")}
    assert solved["hindsight_route"] >= max(solved["trace_argmax"], solved["oracle_route"])
    budget = ev["trace_budget"]["total"]
    assert 0 < ev["methods"]["grpo_target"]["rollouts"] <= budget and ev["methods"]["linear_merge"]["rollouts"] == budget
    assert ev["tasks"] == 4 and ev["methods"]["grpo_target"]["trace_vs"]["trace"] == "trace_argmax"
    # the testbed's router is the one that agrees most with the labels oracle on the validation split
    assert ev["router"] in ev["routers"] and all(r["validation"]["tasks"] == 4 for r in ev["routers"].values())
    assert ev["routing"] == ev["routers"][ev["router"]]["test"]
    table1 = (scratch_repo / "reports/tables/table1.md").read_text()
    assert "TRACE (argmax)" in table1 and "not run" in table1 and "## Paired tests" in table1
    scaling = json.loads((scratch_repo / "reports/metrics/scaling.json").read_text())
    trace = [p for p in scaling["points"] if p["method"] == "TRACE"]
    assert trace[0]["budget"] == 0 and trace[-1]["success_rate"] == ev["methods"]["trace_argmax"]["overall"]["success_rate"]
    assert "no contrastive filter" in (scratch_repo / "reports/tables/ablations.md").read_text()
    index = (scratch_repo / "reports/index.html").read_text()
    for name in ("table1", "scaling", "ablations"):
        assert name in index
    for nb in ("01_rollout", "05_train", "06_evaluate", "07_scaling"):
        assert (scratch_repo / f"reports/html/{nb}.html").is_file()
    # the train page shows what the policies did at their last iteration, read from the stage's episode tables
    assert "last_message" in (scratch_repo / "reports/html/05_train.html").read_text(encoding="utf-8")
    again = run_checked([str(BIN / "dvc"), "repro", "report"], scratch_repo)
    assert "didn't change" in again.stdout or "up to date" in again.stdout


PROGRESS_BAR = re.compile(r"\d+%\|[^|\n]*\||\d+/\d+ \[\d+:\d+")
"""A tqdm line: '40%|████      | 2/5' or '2/5 [00:01<00:02'."""


def test_the_reports_first_screen_in_a_browser(scratch_repo: Path, tmp_path: Path):
    """The report `dvc repro report` wrote, as a reader at 1280 px sees it: a summary that agrees with
    evaluate.json, Table 1 without horizontal overflow, a caption on every figure; and executed notebook
    pages without progress bars or repeated warnings."""
    from browser import browser_check

    from trace_lib.evaluation.tables import findings

    index = scratch_repo / "reports/index.html"
    if not index.is_file():
        pytest.skip("needs the report of test_dvc_repro_report_evaluates_scales_and_writes_the_html_index")
    ev = json.loads((scratch_repo / "reports/metrics/evaluate.json").read_text())
    seen = browser_check(index, tmp_path, width=1280)
    assert seen["findings"][-len(findings(ev)):] == findings(ev)
    assert seen["findings"][0].startswith("Profile cpu: model ")
    table1 = [t for t in seen["tables"] if t["section"] == "table-table1"]
    assert table1 and table1[0]["head"][:3] == ["method", "overall", "rollouts"]
    assert all(t["overflow"] <= 0 for t in table1), table1
    assert seen["figures"] and all(f["caption"] for f in seen["figures"]), seen["figures"]
    for page in sorted((scratch_repo / "reports/html").glob("*.html")):
        text = re.sub(r"<[^>]+>", "\n", html.unescape(page.read_text()))
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        assert not [line for line in lines if PROGRESS_BAR.search(line)], page.name
        warnings = [line for line in lines if "Warning" in line]
        assert len(warnings) == len(set(warnings)), (page.name, warnings)


def _ledger(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "data/discover/ledger.jsonl").read_text().splitlines()]


def test_api_key_never_reaches_a_file(scratch_repo: Path, monkeypatch):
    """With ANTHROPIC_API_KEY set, the whole tiny pipeline (rules analyst, up to the HTML report) and
    then discover through the anthropic backend, against a local Messages API that answers a 429 and
    a body cut mid-way before the proposals, with the SDK's debug log on: the key reaches the server
    and no file in the repo, nor dvc's output. A forced rerun of discover sends nothing."""
    from fake_anthropic import FakeMessagesAPI, error_reply, text_reply

    key = f"sk-ant-test-{secrets.token_hex(16)}"
    proposal = {"capabilities": [{"name": "Confirm before writing", "description": "asks before a write tool",
                                  "recognition": "a write call with no confirmation", "evidence": []}]}
    reply = json.dumps(text_reply(json.dumps(proposal))).encode()
    script = [error_reply(429, "rate_limit_error"), (200, reply[:60]), (200, reply)]
    params_file = scratch_repo / "params.yaml"
    params = yaml.safe_load(params_file.read_text())
    params["analyst"]["backend"] = "rules"  # as in the report test: a no-op after it, the whole DAG alone
    params["score"]["empty_rate"] = 0.0
    params["train"] = {"iterations": 1, "groups": 1, "group_size": 2, "reference_samples": 1, "max_new_tokens": 8,
                       "max_steps_per_episode": 2, "threads": 1, "reward": {"efficiency": False}, "lockstep": True}
    params["evaluate"].update({"n_boot": 100})
    params_file.write_text(yaml.safe_dump(params))
    logs = []
    with FakeMessagesAPI(script) as api:
        monkeypatch.setenv("ANTHROPIC_API_KEY", key)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.url)  # nothing leaves the machine
        monkeypatch.setenv("ANTHROPIC_LOG", "debug")
        logs.append(run_checked([str(BIN / "dvc"), "repro", "report"], scratch_repo))
        assert api.requests == []  # the rules analyst: the key is set but unused
        params["analyst"]["backend"] = "auto"  # the key set: Claude, i.e. the fake server
        params["discover"]["merge"] = "name"
        params_file.write_text(yaml.safe_dump(params))
        logs.append(run_checked([str(BIN / "dvc"), "repro", "discover"], scratch_repo))
        sent, ledger = len(api.requests), _ledger(scratch_repo)
        # The rerun overwrites them: the notebook that holds the SDK's log of the real calls, and the ledger.
        first_run = {p: (scratch_repo / p).read_text() for p in ("reports/notebooks/02_discover.ipynb",
                                                                 "data/discover/ledger.jsonl")}
        logs.append(run_checked([str(BIN / "dvc"), "repro", "--force", "--single-item", "discover"], scratch_repo))
    assert sent >= 3 and all(key in (h.get("x-api-key"), h.get("authorization", "").removeprefix("Bearer "))
                             for h in api.headers)  # the key did reach the API
    assert sum(r["retries"] for r in ledger) == 2 and not any(r["cached"] or "error" in r for r in ledger)
    assert len(api.requests) == sent and all(r["cached"] for r in _ledger(scratch_repo))  # the rerun: cache only
    metrics = json.loads((scratch_repo / "reports/metrics/discover.json").read_text())
    assert metrics["analyst"] == "anthropic:claude-sonnet-4-5" and metrics["candidates"] == 1

    files = [p for p in scratch_repo.rglob("*") if p.is_file()]
    assert any(p.suffix == ".html" for p in files) and any(p.suffix == ".ipynb" for p in files)
    assert list((scratch_repo / "data/analyst_cache").rglob("*.json"))
    leaked = [str(p.relative_to(scratch_repo)) for p in files if key.encode() in p.read_bytes()]
    assert leaked == []
    assert not any(key in proc.stdout + proc.stderr for proc in logs)
    assert "HTTP Request: POST" in first_run["reports/notebooks/02_discover.ipynb"]  # the debug log was kept
    assert not [p for p, text in first_run.items() if key in text]
