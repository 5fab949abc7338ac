"""The discover and score notebooks executed with papermill on crafted retail trajectories.

The trajectories are scripted replays of the built-in retail tasks (`play_retail`): gold replays
succeed, broken variants (no confirmation, silent, stopped early) mostly fail. The rules analyst is
forced, so nothing here calls an API whatever keys the environment holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import papermill
import pytest
import yaml
from retail_play import play_retail, retail_tasks

from trace_lib.io import write_jsonl

REPO = Path(__file__).resolve().parents[2]
FIGURES = ("score_error_rates.png", "score_delta_coverage.png", "score_stability.png")
PARAMS = {"env": {"families": [], "tasks_per_family": 2}, "analyst": {"backend": "rules"},
          "discover": {"batch_size": 8}, "score": {"n_boot": 200, "max_kept": None}}

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def replays() -> dict:
    tasks = retail_tasks(PARAMS["env"]["tasks_per_family"])
    return {mode: play_retail(tasks, mode) for mode in ("gold", "no_confirm", "silent", "stop_early")}


def run_stages(workdir: Path, trajectories) -> dict:
    """Write params + rollouts into `workdir`, execute 02 and 03 there, return what they wrote."""
    (workdir / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    write_jsonl(workdir / "data/rollouts/train.jsonl", trajectories)
    executed = {}
    for name in ("02_discover", "03_score"):
        out = workdir / "reports/notebooks" / f"{name}.ipynb"
        out.parent.mkdir(parents=True, exist_ok=True)
        papermill.execute_notebook(str(REPO / "notebooks" / f"{name}.ipynb"), str(out), kernel_name="python3",
                                   cwd=str(workdir), progress_bar=False)
        executed[name] = nbformat.read(out, as_version=4)

    def rows(path: str) -> list[dict]:
        return [json.loads(line) for line in (workdir / path).read_text().splitlines()]

    return {"caps": rows("data/discover/capabilities.jsonl"), "scores": rows("data/score/scores.jsonl"),
            "kept": rows("data/score/kept.jsonl"), "runs": rows("data/score/runs.jsonl"),
            "discover": json.loads((workdir / "reports/metrics/discover.json").read_text()),
            "score": json.loads((workdir / "reports/metrics/score.json").read_text()), "notebooks": executed}


def stdout_of(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def images_in(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", []))


def assert_figures(workdir: Path, nb) -> None:
    for name in FIGURES:
        assert (workdir / "reports/figures" / name).stat().st_size > 1000, name
    assert images_in(nb) == len(FIGURES)


def test_discover_and_score_notebooks_on_mixed_replays(tmp_path: Path, replays):
    trajs = [t for mode in ("gold", "no_confirm", "silent", "stop_early") for t in replays[mode]]
    failures = {t.id for t in trajs if not t.success}
    got = run_stages(tmp_path, trajs)

    caps = {c["id"]: c for c in got["caps"]}
    assert {"confirmation_before_write", "communicate_result"} <= set(caps)
    assert all(c["evidence"] and set(c["evidence"]) <= failures for c in caps.values())
    assert got["discover"]["analyst"] == "rules" and got["discover"]["candidates"] == len(caps)
    assert got["discover"]["failures"] == len(failures)

    assert sorted(s["capability_id"] for s in got["scores"]) == sorted(caps)
    kept = {c["id"] for c in got["kept"]}
    assert kept == {s["capability_id"] for s in got["scores"] if s["kept"]} == set(got["score"]["kept"])
    # Gold replays confirm and report; the broken variants do not: a clean contrast.
    assert {"confirmation_before_write", "communicate_result"} <= kept
    assert {r["capability_id"] for r in got["runs"]} == set(caps)
    assert len(got["runs"]) == len(caps) * got["score"]["n_runs"]

    metrics = got["score"]
    assert {"successes", "failures", "candidates", "kept", "reasons", "ground_truth",
            "ground_truth_candidates"} <= set(metrics)
    assert set(metrics["reasons"]) == set(caps)
    truth = metrics["ground_truth"]
    assert truth["precision"] == 1.0  # rules ids are the families' tag vocabulary
    assert 0 < truth["recall"] <= 1 and truth["n_kept"] == len(kept)

    discover_out = stdout_of(got["notebooks"]["02_discover"])
    assert "analyst backend: rules" in discover_out
    assert any(f"[{e}] family=" in discover_out for c in caps.values() for e in c["evidence"])  # rendered evidence
    score_out = stdout_of(got["notebooks"]["03_score"])
    assert all(f"{cid}: " in score_out for cid in caps)
    assert_figures(tmp_path, got["notebooks"]["03_score"])


@pytest.mark.parametrize("case", ["no_successes", "no_failures"])
def test_score_keeps_nothing_and_says_why(tmp_path: Path, replays, case):
    if case == "no_successes":  # the base agent failed every task
        trajs = [t for mode in ("no_confirm", "silent", "stop_early") for t in replays[mode] if not t.success]
    else:
        trajs = list(replays["gold"])
    assert trajs and all(t.success == (case == "no_failures") for t in trajs)
    got = run_stages(tmp_path, trajs)

    assert got["kept"] == [] and got["score"]["n_kept"] == 0 and got["score"]["kept"] == []
    assert len(got["scores"]) == len(got["caps"]) == got["score"]["candidates"]
    score_out = stdout_of(got["notebooks"]["03_score"])
    if case == "no_successes":
        assert got["caps"] and got["score"]["successes"] == 0
        assert all(s["reason"] == "not kept: no successes (|D+| = 0)" for s in got["scores"])
        assert set(got["score"]["reasons"]) == {c["id"] for c in got["caps"]}
        assert "succeeded on no trajectory" in score_out and "not kept: no successes" in score_out
        assert got["score"]["ground_truth"]["precision"] is None
    else:
        assert got["caps"] == [] and got["discover"]["note"] == "no failures: nothing to discover"
        assert got["score"]["reasons"] == {} and got["runs"] == []
        assert "No candidates came out of discover" in score_out
    assert "Nothing kept" in score_out
    assert_figures(tmp_path, got["notebooks"]["03_score"])
