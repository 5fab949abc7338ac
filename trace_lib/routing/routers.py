"""Routers that need no label-token logits: a kNN router over the analyst's labels, and contextual calibration.

Why: at 135M parameters the base model's label-token probabilities hardly depend on the task (on the
CPU default every test task got ≈ 0.22 / 0.13 / 0.65 for A / B / none, so argmax sent all of them to
"none"). Two remedies, both producing the same `RouteDecision` records (probabilities over the
candidates plus the none-label, read by argmax or top-p exactly as the paper's router is):

- `knn`: the target's train tasks, each labelled with the capability its base-agent trajectories
  lacked most often (the score stage's PRESENT/LACKING/NA labels; "none" when no adapter's capability
  was lacking), embedded by their openings (MiniLM). A new task takes the similarity-weighted vote of
  its k nearest train tasks. The labels come from discovery, not from task tags, so it works on any
  environment the analyst labelled (τ² included).
- `calibrated`: contextual calibration (Zhao et al., 2021): the label probabilities of content-free
  openings ("N/A", "", "[MASK]") estimate the model's label prior; each task's probabilities are
  divided by it and renormalised. Still the base model's judgement, with its label bias removed.

Reads and writes nothing on disk (the evaluate stage passes labels, trajectories and openings in).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from trace_lib.analyst.embed import embed_texts
from trace_lib.records import Label, RouteDecision, RouteMode
from trace_lib.routing.route import (
    RouteCandidate,
    label_probabilities,
    read_weights,
    route_labels,
    route_prompt,
)

CONTENT_FREE = ("N/A", "", "[MASK]")
"""Openings that say nothing about a task (contextual calibration's content-free inputs)."""


# --- labels from discovery ------------------------------------------------------------------------
def lacking_labels(labels: Iterable[Label], task_of: Mapping[str, str], capability_ids: Sequence[str]
                   ) -> dict[str, str | None]:
    """Task id -> the capability (among `capability_ids`) labelled LACKING most often over the task's
    trajectories (`task_of`: trajectory id -> task id) and labelling runs; ties go to the earlier id in
    `capability_ids`; None when none of them was ever LACKING (the task should stay on the base model).
    Every task in `task_of` appears."""
    rank = {c: i for i, c in enumerate(capability_ids)}
    lacking: dict[str, Counter[str]] = defaultdict(Counter)
    for lab in labels:
        task = task_of.get(lab.trajectory_id)
        if task is not None and lab.label == "LACKING" and lab.capability_id in rank:
            lacking[task][lab.capability_id] += 1
    out: dict[str, str | None] = {}
    for task in sorted(set(task_of.values())):
        counts = lacking.get(task)
        out[task] = min(counts, key=lambda c: (-counts[c], rank[c])) if counts else None
    return out


# --- kNN over train-task openings ----------------------------------------------------------------
def knn_probs(sims: np.ndarray, neighbour_labels: Sequence[str | None], candidates: Sequence[str], k: int,
              exclude: np.ndarray | None = None) -> np.ndarray:
    """(n_tasks, len(candidates) + 1) vote shares: each of a task's k most similar neighbours votes for
    its label with weight max(similarity, 0); a label that is not a candidate (or None) votes for the
    none-label (last column). `exclude[i, j]` True keeps neighbour j out of task i's vote (leave-one-out).
    A task whose neighbours all weigh 0 gets the uniform row."""
    if k < 1:
        raise ValueError(f"knn k must be >= 1, got {k}")
    sims = np.asarray(sims, dtype=np.float64)
    if sims.ndim != 2 or sims.shape[1] != len(neighbour_labels):
        raise ValueError(f"similarities {sims.shape} do not match {len(neighbour_labels)} neighbour labels")
    column = {c: i for i, c in enumerate(candidates)}
    votes_for = np.array([column.get(lab, len(candidates)) for lab in neighbour_labels], dtype=int)
    out = np.zeros((sims.shape[0], len(candidates) + 1))
    for i, row in enumerate(sims):
        allowed = np.ones(len(row), bool) if exclude is None else ~np.asarray(exclude[i], bool)
        idx = np.flatnonzero(allowed)
        nearest = idx[np.lexsort((idx, -row[idx]))][:k]  # most similar first, ties by index
        np.add.at(out[i], votes_for[nearest], np.clip(row[nearest], 0.0, None))
        total = out[i].sum()
        out[i] = out[i] / total if total > 0 else 1.0 / out.shape[1]
    return out


class KnnRouter:
    """Train-task openings with their `lacking_labels`, embedded once; `probs` votes for new openings."""

    def __init__(self, task_ids: Sequence[str], openings: Sequence[str], labels: Sequence[str | None],
                 embed: Callable = embed_texts) -> None:
        if not (len(task_ids) == len(openings) == len(labels)):
            raise ValueError("knn router: task ids, openings and labels differ in length")
        if not task_ids:
            raise ValueError("knn router: no labelled train task to vote (did the score stage label any?)")
        self.task_ids = list(task_ids)
        self.labels = list(labels)
        self.embed = embed
        self.vectors = np.asarray(embed(list(openings)), dtype=np.float32)

    def probs(self, openings: Sequence[str], candidates: Sequence[str], k: int,
              task_ids: Sequence[str] | None = None) -> np.ndarray:
        """Vote shares for each opening (see `knn_probs`); a task id among the router's own train tasks
        never votes for itself (leave-one-out, so routing the train split is honest)."""
        if not openings:
            return np.zeros((0, len(candidates) + 1))
        sims = np.asarray(self.embed(list(openings)), dtype=np.float32) @ self.vectors.T
        exclude = None
        if task_ids is not None:
            exclude = np.array([[tid == own for own in self.task_ids] for tid in task_ids], bool)
        return knn_probs(sims, self.labels, candidates, k, exclude)


# --- contextual calibration ------------------------------------------------------------------------
def calibrate(probs: Sequence[float], prior: Sequence[float]) -> list[float]:
    """Probabilities divided by the label prior and renormalised (contextual calibration)."""
    p, q = np.asarray(probs, dtype=np.float64), np.asarray(prior, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError(f"{len(p)} probabilities against a prior over {len(q)} labels")
    if (q <= 0).any():
        raise ValueError("a label prior must be positive for every label")
    out = p / q
    return (out / out.sum()).tolist()


def label_prior(policy: Any, candidates: Sequence[RouteCandidate], batch_size: int = 8) -> np.ndarray:
    """The base model's mean label probabilities over the `CONTENT_FREE` openings, for this candidate list."""
    prompts = [route_prompt(text, candidates) for text in CONTENT_FREE]
    return label_probabilities(policy, None, prompts, route_labels(len(candidates)), batch_size).mean(axis=0)


def calibrated_decisions(policy: Any, decisions: Sequence[RouteDecision], candidates: Sequence[RouteCandidate],
                         mode: RouteMode = "argmax", top_p: float = 0.9, batch_size: int = 8) -> list[RouteDecision]:
    """The label-logit router's decisions with contextually calibrated probabilities and the weights
    read from them; one prior per distinct candidate list (retrieval may vary it per task)."""
    by_id = {c.capability_id: c for c in candidates}
    priors: dict[tuple[str, ...], np.ndarray] = {}
    out = []
    for d in decisions:
        key = tuple(d.candidates)
        if key not in priors:
            priors[key] = label_prior(policy, [by_id[c] for c in key], batch_size)
        probs = calibrate(d.probs, priors[key])
        out.append(d.model_copy(update={"probs": probs, "weights": read_weights(probs, d.candidates, mode, top_p),
                                        "router": "calibrated", "mode": mode}))
    return out


def knn_decisions(router: KnnRouter, openings: Sequence[str], per_task: Sequence[Sequence[str]], k: int,
                  mode: RouteMode = "argmax", top_p: float = 0.9, task_ids: Sequence[str] | None = None
                  ) -> list[RouteDecision]:
    """kNN decisions for tasks whose candidates (capability ids, per task) are given."""
    task_ids = list(task_ids) if task_ids is not None else [""] * len(openings)
    out: list[RouteDecision | None] = [None] * len(openings)
    for key in dict.fromkeys(tuple(c) for c in per_task):
        rows = [i for i, c in enumerate(per_task) if tuple(c) == key]
        probs = router.probs([openings[i] for i in rows], list(key), k, [task_ids[i] for i in rows])
        for j, i in enumerate(rows):
            p = probs[j].tolist()
            out[i] = RouteDecision(task_id=task_ids[i], mode=mode, candidates=list(key),
                                   labels=route_labels(len(key)), probs=p, label_mass=None,
                                   weights=read_weights(p, list(key), mode, top_p), router="knn")
    return [d for d in out if d is not None]
