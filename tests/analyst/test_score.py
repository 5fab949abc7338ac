"""Contrastive statistics and selection on hand-made label sets with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from trace_lib.llm import LLMError
from trace_lib.analyst.score import (
    at_most,
    consensus,
    contrast,
    explain_selection,
    ground_truth_metrics,
    label_trajectories,
    passes,
    score_capabilities,
    score_runs,
)
from trace_lib.config import ScoreConfig, params_from_dict
from trace_lib.records import Capability, CapabilityScore, Label, Message, Task, Trajectory, UserScenario

CODE = {"L": 2, "P": 1, "N": 0}


def traj(tid: str, success: bool) -> Trajectory:
    return Trajectory(id=tid, task_id="task", env="toy", family="f", split="train", policy_id="p", seed=0,
                      messages=[Message(role="user", content="hi")], reward=float(success), success=success,
                      termination="user_stop", tool_calls=0, invalid_actions=0, tool_errors=0, turns=1,
                      prompt_tokens=0, completion_tokens=0)


def dataset(pos: str, neg: str, cid: str = "c", run: int = 0) -> tuple[list[Trajectory], list[Label]]:
    """Trajectories p0.. (successes) and n0.. (failures) labelled by the letters L/P/N."""
    trajs = [traj(f"p{i}", True) for i in range(len(pos))] + [traj(f"n{i}", False) for i in range(len(neg))]
    value = {"L": "LACKING", "P": "PRESENT", "N": "NA"}
    labels = [Label(trajectory_id=t.id, capability_id=cid, label=value[x], run=run)
              for t, x in zip(trajs, pos + neg, strict=True)]
    return trajs, labels


def codes(s: str) -> np.ndarray:
    return np.array([CODE[x] for x in s], dtype=np.int8)


def test_contrast_known_answer():
    c = contrast(codes("LPPN"), codes("LLLPNN"))
    assert (c.n_pos, c.e_pos, c.n_neg, c.e_neg, c.d_pos, c.d_neg) == (3, 1, 4, 3, 4, 6)
    assert c.er_pos == pytest.approx(1 / 3) and c.er_neg == pytest.approx(0.75)
    assert c.delta == pytest.approx(0.75 - 1 / 3) and c.coverage == pytest.approx(0.5)
    assert c.note == ""


@pytest.mark.parametrize("pos, neg, delta, coverage, note", [
    ("", "LLP", None, 2 / 3, "no successes (|D+| = 0)"),
    ("LPP", "", None, None, "no failures (|D-| = 0)"),
    ("NNN", "NNNN", None, 0.0, "never relevant (NA in every trajectory)"),
    ("NN", "LLP", None, 2 / 3, "never relevant in successes (N+ = 0)"),
    ("LP", "NNN", None, 0.0, "never relevant in failures (N- = 0)"),
    ("", "", None, None, "no successes (|D+| = 0); no failures (|D-| = 0)"),
])
def test_contrast_degenerate_inputs_are_named_not_divided(pos, neg, delta, coverage, note):
    c = contrast(codes(pos), codes(neg))
    assert c.delta is None and c.note == note
    assert c.coverage == (pytest.approx(coverage) if coverage is not None else None)


def test_empty_rate_substitutes_for_a_never_relevant_group():
    c = contrast(codes("NN"), codes("LLP"), empty_rate=0.0)
    assert c.er_pos == 0.0 and c.delta == pytest.approx(2 / 3) and "ER+ taken as 0" in c.note
    c = contrast(codes(""), codes("LLP"), empty_rate=0.0)
    assert c.delta == pytest.approx(2 / 3) and c.note == "no successes (|D+| = 0, ER+ taken as 0)"
    assert contrast(codes("LP"), codes(""), empty_rate=0.0).delta is None


@pytest.mark.parametrize("delta, coverage, expected", [
    (0.3 - 0.1, 0.1, True),          # float arithmetic just under 0.2 still passes
    (0.2, 0.3 - 0.2, True),          # 0.09999999999999998 counts as ρ
    (0.2 - 1e-6, 0.5, False),
    (0.5, 0.1 - 1e-6, False),
    (None, 0.5, False),
    (0.5, None, False),
])
def test_selection_thresholds_at_the_boundary(delta, coverage, expected):
    assert passes(delta, coverage, 0.2, 0.1) is expected


def test_consensus_majority_and_ties():
    rows = [("t", "a", "LACKING"), ("t", "a", "LACKING"), ("t", "a", "PRESENT"),   # majority
            ("t", "b", "LACKING"), ("t", "b", "PRESENT"),                           # tie -> PRESENT
            ("t", "c", "LACKING"), ("t", "c", "NA"),                                # tie -> NA
            ("t", "d", "LACKING"), ("t", "d", "PRESENT"), ("t", "d", "NA")]         # three-way -> NA
    labels = [Label(trajectory_id=t, capability_id=c, label=v, run=i) for i, (t, c, v) in enumerate(rows)]
    assert consensus(labels) == {("t", "a"): "LACKING", ("t", "b"): "PRESENT", ("t", "c"): "NA", ("t", "d"): "NA"}


def _llm_runs(selected_runs: int, n: int = 10):
    """n labelling runs; in `selected_runs` of them c separates failures from successes."""
    trajs, _ = dataset("PPPP", "LLLL")
    all_labels = []
    for r in range(n):
        strong = r < selected_runs
        _, lb = dataset("PPPP", "LLLL" if strong else "PPPP", run=r)
        all_labels += lb
    return trajs, all_labels


@pytest.mark.parametrize("selected, kept", [(8, True), (7, False), (10, True), (0, False)])
def test_k_of_n_rule_with_llm_runs(selected, kept):
    trajs, labels = _llm_runs(selected)
    (s,) = score_capabilities(labels, trajs, ScoreConfig(n_boot=0))
    assert s.kept_runs == selected and s.n_runs == 10 and s.kept is kept
    assert ("kept:" if kept else "not kept:") in s.reason


def test_fewer_llm_runs_keep_the_configured_share():
    trajs, labels = _llm_runs(4, n=5)  # 4 of 5 >= ceil(8/10 * 5) = 4
    (s,) = score_capabilities(labels, trajs, ScoreConfig(n_boot=0))
    assert s.n_runs == 5 and s.kept


def test_rules_runs_are_seeded_bootstrap_resamples():
    trajs, labels = dataset("PPPPPPPPLN", "LLLLLLPPNN")
    cfg = ScoreConfig()
    runs_a = score_runs(labels, trajs, cfg, seed=3)
    assert runs_a == score_runs(labels, trajs, cfg, seed=3)
    assert runs_a != score_runs(labels, trajs, cfg, seed=4)
    assert len(runs_a) == 10 and len({r["delta"] for r in runs_a}) > 1
    (s,) = score_capabilities(labels, trajs, cfg, seed=3)
    assert s.delta == pytest.approx(6 / 8 - 1 / 9) and s.coverage == pytest.approx(0.6)
    assert s.delta_ci[0] < s.delta < s.delta_ci[1]
    assert s.kept and s.kept_runs >= 8


def test_single_rules_run_is_the_data_itself():
    trajs, labels = dataset("PPPPL", "LLLPP")
    (r,) = score_runs(labels, trajs, ScoreConfig(n_runs=1, k_keep=1))
    assert r["delta"] == pytest.approx(0.6 - 0.2) and r["coverage"] == pytest.approx(0.6) and r["selected"]


def test_not_kept_reasons_name_the_failed_threshold():
    trajs, labels = dataset("LPPP", "LLPP")          # Δ = 0.25, coverage = 0.5
    (s,) = score_capabilities(labels, trajs, ScoreConfig(delta=0.3, n_boot=0))
    assert not s.kept and "Δ=0.250 < δ=0.3" in s.reason
    trajs, labels = dataset("PPPPPPPPPP", "L" + "N" * 19)  # Δ = 1, coverage = 0.05
    (s,) = score_capabilities(labels, trajs, ScoreConfig(n_boot=0))
    assert not s.kept and "coverage=0.050 < ρ=0.1" in s.reason


def test_no_successes_with_an_empty_rate_still_selects():
    trajs, labels = dataset("", "LLLLPN")
    (s,) = score_capabilities(labels, trajs, ScoreConfig(empty_rate=0.0, n_boot=50))
    assert s.kept and s.delta == pytest.approx(0.8) and s.delta_ci is not None
    assert "ER+ taken as 0" in s.reason


def test_degenerate_scores_are_recorded():
    trajs, labels = dataset("", "LLL")
    (s,) = score_capabilities(labels, trajs, ScoreConfig())
    assert not s.kept and s.delta is None and s.delta_ci is None and "no successes" in s.reason
    trajs, labels = dataset("NN", "NNN")
    (s,) = score_capabilities(labels, trajs, ScoreConfig())
    assert not s.kept and "never relevant (NA in every trajectory)" in s.reason


def test_missing_labels_count_as_na_and_capability_ids_are_respected():
    trajs, labels = dataset("PP", "LL")
    scores = score_capabilities(labels, trajs, ScoreConfig(n_boot=0), capability_ids=["c", "ghost"])
    ghost = next(s for s in scores if s.capability_id == "ghost")
    assert (ghost.n_pos, ghost.n_neg, ghost.kept) == (0, 0, False)


def test_scores_are_deterministic():
    trajs, labels = dataset("PPPLNPPPNL", "LLLNLPLLNL")
    a = score_capabilities(labels, trajs, ScoreConfig(), seed=1)
    b = score_capabilities(labels, trajs, ScoreConfig(), seed=1)
    assert [x.model_dump_json() for x in a] == [x.model_dump_json() for x in b]


def _task(tags):
    return Task(id="x", env="retail", split="train", family="f", instruction="i",
                user=UserScenario(reason_for_call="r"), capability_tags=tags)


def test_ground_truth_metrics():
    tasks = [_task(["a", "b"]), _task(["b", "c", "d"])]
    m = ground_truth_metrics(["a", "b", "z"], tasks)
    assert m["precision"] == pytest.approx(2 / 3) and m["recall"] == pytest.approx(0.5)
    assert m["f1"] == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))
    assert m["false_positives"] == ["z"] and m["missed"] == ["c", "d"]
    empty = ground_truth_metrics([], tasks)
    assert empty["precision"] is None and empty["recall"] == 0.0 and empty["f1"] is None
    assert ground_truth_metrics(["a"], [_task([])])["recall"] is None


def test_explain_selection_says_why_nothing_could_be_kept():
    reasons = {"a": "kept: selected in 9/10 runs (>= 8)", "b": "not kept: coverage=0.050 < ρ=0.1"}
    assert explain_selection(5, 7, reasons) == ["a: kept: selected in 9/10 runs (>= 8)",
                                                "b: not kept: coverage=0.050 < ρ=0.1"]
    no_pos = explain_selection(0, 7, {"a": "not kept: no successes (|D+| = 0)"})
    assert len(no_pos) == 2 and "succeeded on no trajectory (|D+| = 0)" in no_pos[0]
    assert "score.empty_rate" in no_pos[0] and no_pos[1] == "a: not kept: no successes (|D+| = 0)"
    nothing = explain_selection(5, 0, {})
    assert nothing == ["The base agent failed no trajectory (|D-| = 0): there is nothing to contrast.",
                       "No candidates came out of discover, so nothing was scored "
                       "(see reports/metrics/discover.json)."]
    assert len(explain_selection(0, 0, {})) == 3


class FakeAnalyst:
    """Answers label requests: LACKING for failures, PRESENT for successes; errors on 'boom'."""

    backend, model = "fake", "fake"

    def __init__(self):
        self.calls = []

    def complete_json(self, system, messages, schema, *, max_tokens, temperature=0.0, stage=""):
        self.calls.append((system, messages[0]["content"]))
        text = messages[0]["content"]
        if "[boom]" in text:
            raise LLMError("fake: invalid JSON after one re-ask")
        value = "LACKING" if "success=False" in text else "PRESENT"
        ids = schema["properties"]["labels"]["items"]["properties"]["capability_id"]["enum"]
        return {"labels": [{"capability_id": i, "label": value, "rationale": "because"} for i in ids[:1]]}


def test_label_trajectories_with_an_llm_records_errors_and_missing_labels():
    trajs = [traj("a", True), traj("b", False), traj("boom", False)]
    caps = [Capability(id="x", name="X", description="d"), Capability(id="y", name="Y", description="d")]
    client = FakeAnalyst()
    labels = label_trajectories(trajs, caps, [], {"t": "read"}, ScoreConfig(n_runs=2, k_keep=1), client, seed=0)
    assert len(labels) == 2 * 3 * 2 and len(client.calls) == 6
    assert {lb.run for lb in labels} == {0, 1}
    errs = [lb for lb in labels if lb.trajectory_id == "boom"]
    assert all(lb.label == "NA" and lb.rationale.startswith("analyst error") for lb in errs)
    answered = [lb for lb in labels if lb.trajectory_id == "b"]
    assert sorted(lb.label for lb in answered) == ["LACKING", "LACKING", "NA", "NA"]  # one id per reply
    assert any("analyst gave no label" in lb.rationale for lb in answered)
    assert "Labelling pass 2 of 2" in client.calls[-1][1]


def test_label_trajectories_with_rules_is_one_deterministic_run():
    trajs = [traj("a", True), traj("b", False)]
    caps = [Capability(id="multi_step_completion", name="m", description="d"),
            Capability(id="telepathy", name="t", description="d")]
    labels = label_trajectories(trajs, caps, [], {}, ScoreConfig(), None)
    assert len(labels) == 4 and {lb.run for lb in labels} == {0}
    assert next(lb for lb in labels if lb.capability_id == "telepathy").rationale == "no rules detector for this capability"


def test_k_keep_above_n_runs_is_a_config_error():
    with pytest.raises(ValueError, match=r"k_keep \(9\) must be <= n_runs \(5\)"):
        params_from_dict({"score": {"n_runs": 5, "k_keep": 9}})


def test_score_figures_and_table():
    from trace_lib.plots.score import (
        delta_coverage,
        error_rate_bars,
        scores_table,
        stability,
    )

    trajs, labels = dataset("PPPPPPPPLN", "LLLLLLPPNN", cid="strong")
    _, weak = dataset("LPPPPPPPLN", "LPPPPPPPNN", cid="weak")
    _, never = dataset("NNNNNNNNNN", "NNNNNNNNNN", cid="never")
    all_labels = labels + weak + never
    cfg = ScoreConfig(n_boot=100)
    runs = score_runs(all_labels, trajs, cfg)
    scores = score_capabilities(all_labels, trajs, cfg, runs=runs)
    table = scores_table(scores)
    assert list(table["capability"]) == ["strong", "weak", "never"] and table["delta"].isna().tolist() == [False, False, True]
    fig = error_rate_bars(scores)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["strong ✓", "weak", "never"]
    fig = delta_coverage(scores, cfg.delta, cfg.rho)
    ax = fig.axes[0]
    assert ax.get_ylabel().startswith("Δ(c)") and any(line.get_ydata()[0] == cfg.delta for line in ax.get_lines())
    fig = stability(runs, cfg.k_keep, cfg.delta)
    assert len(fig.axes) == 2 and fig.axes[0].get_xticklabels()[0].get_text() == "strong"
    assert stability([], 8).axes  # nothing to draw is still a figure


def _score(cid: str, delta: float | None, coverage: float | None, kept: bool) -> CapabilityScore:
    return CapabilityScore(capability_id=cid, n_pos=1, n_neg=1, e_pos=0, e_neg=1, er_pos=0.0, er_neg=1.0,
                           delta=delta, coverage=coverage, kept=kept, reason="kept: selected" if kept else "no")


def test_max_kept_keeps_the_largest_gaps_and_says_why_the_rest_are_not():
    scores = [_score("a", 0.5, 0.5, True), _score("b", 1.0, 1.0, True), _score("c", 0.5, 0.9, True),
              _score("d", 2.0, 1.0, False)]
    out = at_most(scores, 2)
    assert [s.capability_id for s in out] == ["a", "b", "c", "d"]  # order kept
    assert [s.kept for s in out] == [False, True, True, False]
    assert out[0].reason == "not kept: ranked 3 of 3 by Δ and score.max_kept is 2; it passed: selected"
    assert out[3].reason == "no"
    assert at_most(scores, None) == scores and at_most(scores, 3) == scores


def test_max_kept_is_a_params_key():
    assert params_from_dict({"score": {"max_kept": 1}}).score.max_kept == 1
    with pytest.raises(Exception, match="max_kept"):
        params_from_dict({"score": {"max_kept": 0}})
