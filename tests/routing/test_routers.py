"""The kNN router over the analyst's labels and contextual calibration (trace_lib.routing.routers)."""

from __future__ import annotations

import numpy as np
import pytest

from trace_lib.evaluation.tables import router_quality_table
from trace_lib.records import Label, RouteDecision
from trace_lib.routing.routers import (
    KnnRouter,
    calibrate,
    knn_decisions,
    knn_probs,
    lacking_labels,
)


def lab(tid: str, cap: str, value: str, run: int = 0) -> Label:
    return Label(trajectory_id=tid, capability_id=cap, label=value, run=run)


def test_lacking_labels_counts_over_trajectories_and_runs_and_breaks_ties_by_order():
    trajs = {"t1#0": "t1", "t1#1": "t1", "t2#0": "t2", "t3#0": "t3", "t4#0": "t4"}
    labels = [lab("t1#0", "a", "LACKING"), lab("t1#1", "b", "LACKING"), lab("t1#1", "b", "LACKING", run=1),
              lab("t2#0", "a", "LACKING"), lab("t2#0", "b", "LACKING"),  # a tie: the earlier id wins
              lab("t3#0", "a", "PRESENT"), lab("t3#0", "b", "NA"),  # nothing lacking: stays on the base model
              lab("t4#0", "zzz", "LACKING"),  # a capability without an adapter does not count
              lab("ghost#0", "a", "LACKING")]  # no such trajectory: ignored
    assert lacking_labels(labels, trajs, ["a", "b"]) == {"t1": "b", "t2": "a", "t3": None, "t4": None}
    assert lacking_labels(labels, trajs, ["b", "a"])["t2"] == "b"


def test_knn_probs_weights_votes_by_similarity_and_sends_other_labels_to_none():
    sims = np.array([[0.9, 0.8, 0.1, 0.7],
                     [0.1, 0.2, 0.9, 0.0]])
    labels = ["a", "b", None, "c"]  # c is not a candidate: its vote goes to the none-label
    p = knn_probs(sims, labels, ["a", "b"], k=3)
    assert p.shape == (2, 3) and np.allclose(p.sum(axis=1), 1.0)
    assert np.allclose(p[0], np.array([0.9, 0.8, 0.7]) / 2.4)
    assert np.allclose(p[1], np.array([0.1, 0.2, 0.9]) / 1.2)
    alone = knn_probs(sims, labels, ["a", "b"], k=1, exclude=np.array([[True, False, False, False]] * 2))
    assert alone[0].tolist() == [0.0, 1.0, 0.0]  # the nearest is left out: the next one votes alone
    negative = knn_probs(np.array([[-0.5, -0.2, -0.1, -0.3]]), labels, ["a", "b"], k=2)
    assert np.allclose(negative, 1 / 3)  # no positive similarity: no opinion
    with pytest.raises(ValueError, match="k must be >= 1"):
        knn_probs(sims, labels, ["a"], k=0)
    with pytest.raises(ValueError, match="do not match 3 neighbour labels"):
        knn_probs(sims, labels[:3], ["a"], k=1)


VECTORS = {"cancel my order": [1.0, 0.0], "cancel the order please": [0.95, 0.31],
           "what is my balance": [0.0, 1.0], "balance of my gift card": [0.2, 0.98]}


def fake_embed(texts):
    return np.asarray([VECTORS[t] for t in texts], dtype=np.float32)


def test_knn_router_votes_leave_one_out_and_makes_decisions():
    router = KnnRouter(["t1", "t2", "t3"], ["cancel my order", "what is my balance", "balance of my gift card"],
                       ["write", None, "read"], embed=fake_embed)
    p = router.probs(["cancel the order please", "balance of my gift card"], ["read", "write"], k=1)
    assert p.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    own = router.probs(["balance of my gift card"], ["read", "write"], k=1, task_ids=["t3"])
    assert own.tolist() == [[0.0, 0.0, 1.0]]  # t3 may not vote for itself: its neighbour t2 says none
    ds = knn_decisions(router, ["cancel the order please", "balance of my gift card"], [["read", "write"], ["read"]],
                       k=1, task_ids=["x", "y"])
    assert [d.task_id for d in ds] == ["x", "y"] and all(d.router == "knn" and d.label_mass is None for d in ds)
    assert ds[0].weights == {"write": 1.0} and ds[0].labels == [" A", " B", " C"]
    assert ds[1].candidates == ["read"] and ds[1].weights == {"read": 1.0} and ds[1].labels == [" A", " B"]
    with pytest.raises(ValueError, match="no labelled train task"):
        KnnRouter([], [], [], embed=fake_embed)


def test_calibrate_divides_by_the_prior_and_renormalises():
    out = calibrate([0.2, 0.1, 0.7], [0.25, 0.05, 0.7])
    assert np.allclose(out, np.array([0.8, 2.0, 1.0]) / 3.8)
    assert calibrate([0.5, 0.5], [0.5, 0.5]) == [0.5, 0.5]
    with pytest.raises(ValueError, match="against a prior over 2 labels"):
        calibrate([0.2, 0.1, 0.7], [0.5, 0.5])
    with pytest.raises(ValueError, match="positive"):
        calibrate([0.5, 0.5], [1.0, 0.0])


def test_router_quality_table_has_a_column_per_router_and_split():
    q = {"tasks": 2, "scored": 2, "router_accuracy": 0.5, "majority_accuracy": 1.0, "solved_on_none": None}
    df = router_quality_table(q, {"logits": {"train": q, "test": q}, "knn": {"note": "no labels"}})
    assert list(df.columns) == ["metric", "logits (train)", "logits (test)", "knn (train)", "knn (test)"]
    row = df.set_index("metric").loc["router_accuracy"]
    assert row["logits (test)"] == "0.5" and row["knn (test)"] == "not run"
    assert list(router_quality_table(q).columns) == ["metric", "value"]
    held = router_quality_table(q, {"logits": {"train": q, "validation": q, "test": q}, "knn": {"note": "no labels"}})
    assert list(held.columns) == ["metric", "logits (train)", "logits (validation)", "logits (test)", "knn (train)",
                                  "knn (validation)", "knn (test)"]


def test_route_decision_records_its_router():
    d = RouteDecision(task_id="t", mode="argmax", candidates=["a"], labels=[" A", " B"], probs=[0.4, 0.6])
    assert d.router == "logits"
    assert RouteDecision.model_validate_json(d.model_copy(update={"router": "knn"}).model_dump_json()).router == "knn"
