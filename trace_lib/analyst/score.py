"""Scoring: label every trajectory x candidate, contrast failures with successes, select.

Reads and writes nothing: functions from Trajectory, Task and Capability records to Label and
CapabilityScore records, per-run rows and the ground-truth check. The score stage
(`stages/score.py`) reads the rollouts and the candidates and writes what these return.

Paper §3.1, contrastive selection. For a capability c, with D+ the successes and D- the failures:
N±(c) = trajectories of D± where c is relevant (label not NA), E±(c) = those labelled LACKING,
ER±(c) = E±/N±, Δ(c) = ER-(c) - ER+(c), coverage(c) = E-(c)/|D-|. A run selects c when Δ ≥ δ and
coverage ≥ ρ; c is kept when selected in at least k of n independent labelling runs.

What a "run" is depends on the analyst. An LLM labels every trajectory n times (separate requests
at `score.temperature`), so runs differ by the analyst's sampling. The rules analyst is
deterministic, so its n runs are stratified bootstrap resamples of the trajectories (D+ and D-
resampled separately, seeded): the k-of-n rule then asks that the selection survive resampling
the data (with n = 1 the single run is the data itself). The headline numbers use the majority
label across runs (ties go to NA, then PRESENT) and the full data; the Δ interval is a stratified
percentile bootstrap.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trace_lib.analyst.detectors import detect
from trace_lib.llm import LLMClient, LLMError
from trace_lib.analyst.prompting import load_prompt
from trace_lib.analyst.render import render_for_analyst, tools_block
from trace_lib.config import ScoreConfig
from trace_lib.paths import Paths
from trace_lib.records import Capability, CapabilityScore, Label, Task, Trajectory

EPS = 1e-9  # Δ and coverage are ratios; 0.3 - 0.1 must still pass δ = 0.2
_CODE = {"NA": 0, "PRESENT": 1, "LACKING": 2}
_TIE_ORDER = ("NA", "PRESENT", "LACKING")


# --- labelling ----------------------------------------------------------------------------------
def label_schema(capability_ids: Sequence[str]) -> dict[str, Any]:
    return {"type": "object", "required": ["labels"], "properties": {"labels": {"type": "array", "items": {
        "type": "object", "required": ["capability_id", "label"],
        "properties": {"capability_id": {"type": "string", "enum": list(capability_ids)},
                       "label": {"type": "string", "enum": list(_CODE)},
                       "rationale": {"type": "string"}}}}}}


def _dictionary(caps: Sequence[Capability]) -> str:
    return "\n".join(f"- {c.id}: {c.name}. {c.description} Recognition: {c.recognition or '-'}" for c in caps)


def label_llm(traj: Trajectory, task: Task | None, caps: Sequence[Capability], system: str, cfg: ScoreConfig,
              client: LLMClient, run: int) -> list[Label]:
    """One analyst call labels one trajectory against every candidate; an error is recorded as NA."""
    ids = [c.id for c in caps]
    user = (f"{render_for_analyst(traj, task, cfg.trajectory_chars)}\n\n"
            f"Labelling pass {run + 1} of {cfg.n_runs}: label all {len(ids)} capabilities.")
    try:
        reply = client.complete_json(system, [{"role": "user", "content": user}], label_schema(ids),
                                     max_tokens=cfg.max_tokens, temperature=cfg.temperature, stage="score")
        given = {item["capability_id"]: item for item in reply["labels"]}
    except LLMError as err:
        given, missing_why = {}, f"analyst error: {str(err)[:160]}"
    else:
        missing_why = "analyst gave no label for this capability"
    def why(cid: str) -> str:
        return " ".join(str(given[cid].get("rationale", "")).split())[:300] if cid in given else missing_why

    return [Label(trajectory_id=traj.id, capability_id=cid, run=run, rationale=why(cid),
                  label=given[cid]["label"] if cid in given else "NA") for cid in ids]


def label_trajectories(trajectories: Sequence[Trajectory], capabilities: Sequence[Capability],
                       tasks: Sequence[Task], tool_kinds: dict[str, str], cfg: ScoreConfig,
                       client: LLMClient | None, seed: int = 0) -> list[Label]:
    """PRESENT/LACKING/NA with a rationale for every trajectory x candidate.

    Rules analyst (client None): one deterministic run (run 0). LLM: `cfg.n_runs` runs, each with
    the dictionary in its own seeded order (position bias averages out across runs).
    """
    by_id = {t.id: t for t in tasks}
    ids = [c.id for c in capabilities]
    labels: list[Label] = []
    if client is None:
        for traj in trajectories:
            labels += detect(traj, tool_kinds, by_id.get(traj.task_id), ids=ids)
    else:
        for run in range(cfg.n_runs):
            order = list(capabilities)
            np.random.default_rng([seed, run]).shuffle(order)
            system = load_prompt("label_system.md", tools=tools_block(tool_kinds), capabilities=_dictionary(order))
            for traj in trajectories:
                labels += label_llm(traj, by_id.get(traj.task_id), order, system, cfg, client, run)
    return sorted(labels, key=lambda lb: (lb.run, lb.trajectory_id, lb.capability_id))


# --- statistics ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Contrast:
    n_pos: int
    n_neg: int
    e_pos: int
    e_neg: int
    d_pos: int
    d_neg: int
    er_pos: float | None
    er_neg: float | None
    delta: float | None
    coverage: float | None
    note: str


def contrast(codes_pos: np.ndarray, codes_neg: np.ndarray, empty_rate: float | None = None) -> Contrast:
    """N±, E±, ER±, Δ and coverage from label codes (0 NA, 1 PRESENT, 2 LACKING) of D+ and D-.

    Undefined quantities are None, with the reason in `note`; nothing divides by zero.
    """
    d_pos, d_neg = int(codes_pos.size), int(codes_neg.size)
    n_pos, n_neg = int((codes_pos > 0).sum()), int((codes_neg > 0).sum())
    e_pos, e_neg = int((codes_pos == 2).sum()), int((codes_neg == 2).sum())
    notes = []

    def rate(e: int, n: int, d: int, group: str) -> float | None:
        if d == 0:
            # With no failures nothing can be selected; with no successes the configured
            # empty rate (if any) stands in, so a run where the base agent never succeeds can go on.
            sub = f", ER+ taken as {empty_rate:g}" if group == "+" and empty_rate is not None else ""
            notes.append(f"no {'successes' if group == '+' else 'failures'} (|D{group}| = 0{sub})")
            return empty_rate if group == "+" else None
        if n == 0:
            sub = f", ER{group} taken as {empty_rate:g}" if empty_rate is not None else ""
            notes.append(f"never relevant in {'successes' if group == '+' else 'failures'} (N{group} = 0{sub})")
            return empty_rate
        return e / n

    er_pos, er_neg = rate(e_pos, n_pos, d_pos, "+"), rate(e_neg, n_neg, d_neg, "-")
    if n_pos == 0 and n_neg == 0 and d_pos + d_neg > 0:
        notes = ["never relevant (NA in every trajectory)"]
    delta = er_neg - er_pos if er_pos is not None and er_neg is not None else None
    coverage = e_neg / d_neg if d_neg else None
    return Contrast(n_pos, n_neg, e_pos, e_neg, d_pos, d_neg, er_pos, er_neg, delta, coverage, "; ".join(notes))


def passes(delta: float | None, coverage: float | None, delta_min: float, rho: float) -> bool:
    """The paper's selection rule: Δ ≥ δ and coverage ≥ ρ (both defined)."""
    return delta is not None and coverage is not None and delta >= delta_min - EPS and coverage >= rho - EPS


def consensus(labels: Sequence[Label]) -> dict[tuple[str, str], str]:
    """Majority label per (trajectory, capability) across runs; ties go to NA, then PRESENT."""
    votes: dict[tuple[str, str], Counter] = {}
    for lb in labels:
        votes.setdefault((lb.trajectory_id, lb.capability_id), Counter())[lb.label] += 1
    return {key: max(_TIE_ORDER, key=lambda v: (c[v], -_TIE_ORDER.index(v))) for key, c in votes.items()}


def _codes(table: dict[tuple[str, str], str], trajs: Sequence[Trajectory], cid: str) -> np.ndarray:
    return np.array([_CODE[table.get((t.id, cid), "NA")] for t in trajs], dtype=np.int8)


def _boot_delta(pos: np.ndarray, neg: np.ndarray, idx_pos: np.ndarray, idx_neg: np.ndarray,
                empty_rate: float | None) -> np.ndarray:
    """Δ for each row of resample indices (NaN where undefined)."""
    fill = np.nan if empty_rate is None else empty_rate

    def rates(codes: np.ndarray, idx: np.ndarray) -> np.ndarray:
        if codes.size == 0:
            return np.full(idx.shape[0], fill)
        n = (codes[idx] > 0).sum(1)
        e = (codes[idx] == 2).sum(1)
        return np.where(n > 0, e / np.maximum(n, 1), fill)

    return rates(neg, idx_neg) - rates(pos, idx_pos)


def _resample(rng: np.random.Generator, size: int, rows: int) -> np.ndarray:
    return rng.integers(0, size, size=(rows, size)) if size else np.zeros((rows, 0), dtype=np.int64)


def score_runs(labels: Sequence[Label], trajectories: Sequence[Trajectory], cfg: ScoreConfig,
               capability_ids: Sequence[str] | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Per run x capability: Δ, coverage and whether the run selects it (see module docstring)."""
    pos = [t for t in trajectories if t.success]
    neg = [t for t in trajectories if not t.success]
    cids = sorted({lb.capability_id for lb in labels}) if capability_ids is None else list(capability_ids)
    runs = sorted({lb.run for lb in labels})
    rows = []
    if len(runs) > 1:
        for r in runs:
            table = {(lb.trajectory_id, lb.capability_id): lb.label for lb in labels if lb.run == r}
            for cid in cids:
                c = contrast(_codes(table, pos, cid), _codes(table, neg, cid), cfg.empty_rate)
                rows.append({"run": r, "capability_id": cid, "delta": c.delta, "coverage": c.coverage,
                             "selected": passes(c.delta, c.coverage, cfg.delta, cfg.rho)})
        return rows
    table = consensus(labels)
    for r in range(cfg.n_runs):
        rng = np.random.default_rng([seed, r])
        ip, ineg = _resample(rng, len(pos), 1)[0], _resample(rng, len(neg), 1)[0]
        if cfg.n_runs == 1:  # a single run is the data itself, not a resample of it
            ip, ineg = np.arange(len(pos)), np.arange(len(neg))
        for cid in cids:
            c = contrast(_codes(table, pos, cid)[ip], _codes(table, neg, cid)[ineg], cfg.empty_rate)
            rows.append({"run": r, "capability_id": cid, "delta": c.delta, "coverage": c.coverage,
                         "selected": passes(c.delta, c.coverage, cfg.delta, cfg.rho)})
    return rows


def _fmt(x: float | None) -> str:
    return "undefined" if x is None else f"{x:.3f}"


def score_capabilities(labels: Sequence[Label], trajectories: Sequence[Trajectory], cfg: ScoreConfig,
                       capability_ids: Sequence[str] | None = None, seed: int = 0,
                       runs: list[dict[str, Any]] | None = None) -> list[CapabilityScore]:
    """Headline statistics, Δ interval and the k-of-n keep decision for every capability."""
    pos = [t for t in trajectories if t.success]
    neg = [t for t in trajectories if not t.success]
    cids = sorted({lb.capability_id for lb in labels}) if capability_ids is None else list(capability_ids)
    runs = score_runs(labels, trajectories, cfg, cids, seed) if runs is None else runs
    n_runs = len({r["run"] for r in runs}) or 1
    # A different number of LLM runs than configured keeps the configured share, rounded up.
    k = cfg.k_keep if n_runs == cfg.n_runs else math.ceil(cfg.k_keep * n_runs / cfg.n_runs)
    table = consensus(labels)
    boot_rng = np.random.default_rng([seed, 1_000_003])
    idx_pos, idx_neg = _resample(boot_rng, len(pos), cfg.n_boot), _resample(boot_rng, len(neg), cfg.n_boot)
    scores = []
    for cid in cids:
        cp, cn = _codes(table, pos, cid), _codes(table, neg, cid)
        c = contrast(cp, cn, cfg.empty_rate)
        ci = None
        if cfg.n_boot and c.delta is not None:
            deltas = _boot_delta(cp, cn, idx_pos, idx_neg, cfg.empty_rate)
            deltas = deltas[~np.isnan(deltas)]
            if deltas.size:
                a = (1 - cfg.ci_level) / 2
                lo, hi = np.quantile(deltas, [a, 1 - a])
                ci = (float(lo), float(hi))
        kept_runs = sum(r["selected"] for r in runs if r["capability_id"] == cid)
        kept = kept_runs >= k
        if kept:
            reason = (f"kept: selected in {kept_runs}/{n_runs} runs (>= {k}); "
                      f"Δ={_fmt(c.delta)}, coverage={_fmt(c.coverage)}")
        elif c.delta is None or c.coverage is None:
            reason = f"not kept: {c.note or 'Δ undefined'}"
        elif not passes(c.delta, c.coverage, cfg.delta, cfg.rho):
            why = [f"Δ={_fmt(c.delta)} < δ={cfg.delta:g}"] if c.delta < cfg.delta - EPS else []
            why += [f"coverage={_fmt(c.coverage)} < ρ={cfg.rho:g}"] if c.coverage < cfg.rho - EPS else []
            reason = "not kept: " + ", ".join(why) + f"; selected in {kept_runs}/{n_runs} runs"
        else:
            reason = f"not kept: selected in only {kept_runs}/{n_runs} runs (< {k})"
        if c.note and not reason.endswith(c.note) and c.delta is not None:
            reason += f" ({c.note})"
        scores.append(CapabilityScore(capability_id=cid, n_pos=c.n_pos, n_neg=c.n_neg, e_pos=c.e_pos, e_neg=c.e_neg,
                                      er_pos=c.er_pos, er_neg=c.er_neg, delta=c.delta, coverage=c.coverage,
                                      delta_ci=ci, kept=kept, kept_runs=kept_runs, n_runs=n_runs, reason=reason))
    return at_most(scores, cfg.max_kept)


def at_most(scores: Sequence[CapabilityScore], max_kept: int | None) -> list[CapabilityScore]:
    """`scores` with only the `max_kept` kept ones of largest Δ (then coverage, then id) still kept; the others say
    they ranked below (`score.max_kept`). None: unchanged."""
    kept = sorted((s for s in scores if s.kept), key=lambda s: (-(s.delta or 0.0), -(s.coverage or 0.0),
                                                                 s.capability_id))
    if max_kept is None or len(kept) <= max_kept:
        return list(scores)
    over = {s.capability_id: rank for rank, s in enumerate(kept, start=1) if rank > max_kept}
    return [s.model_copy(update={"kept": False, "reason": f"not kept: ranked {over[s.capability_id]} of "
                                 f"{len(kept)} by Δ and score.max_kept is {max_kept}; it passed: "
                                 f"{s.reason.removeprefix('kept: ')}"})
            if s.capability_id in over else s for s in scores]


def ground_truth_metrics(kept: Sequence[str], tasks: Sequence[Task]) -> dict[str, Any]:
    """Precision/recall of capability ids against the union of the tasks' `capability_tags`.

    Only meaningful where ids share the tag vocabulary (the rules analyst on the built-in
    families). Undefined ratios (nothing kept, no tags) are None.
    """
    truth = sorted({tag for t in tasks for tag in t.capability_tags})
    chosen = sorted(set(kept))
    tp = sorted(set(chosen) & set(truth))
    precision = len(tp) / len(chosen) if chosen else None
    recall = len(tp) / len(truth) if truth else None
    f1 = (2 * precision * recall / (precision + recall)) if precision and recall else (
        0.0 if precision is not None and recall is not None else None)
    return {"precision": precision, "recall": recall, "f1": f1, "n_kept": len(chosen), "n_true": len(truth),
            "true_positives": tp, "false_positives": sorted(set(chosen) - set(truth)),
            "missed": sorted(set(truth) - set(chosen))}


def explain_selection(successes: int, failures: int, reasons: dict[str, str]) -> list[str]:
    """Lines saying why each candidate was or was not kept, preceded by what made selection
    impossible (no successes, no failures, no candidates) when that is the case."""
    lines = []
    if successes == 0:
        lines.append("The base agent succeeded on no trajectory (|D+| = 0): ER+ is undefined, so nothing can be "
                     "kept unless score.empty_rate is set.")
    if failures == 0:
        lines.append("The base agent failed no trajectory (|D-| = 0): there is nothing to contrast.")
    if not reasons:
        lines.append(f"No candidates came out of discover, so nothing was scored "
                     f"(see {Paths().metrics('discover').as_posix()}).")
    return lines + [f"{cid}: {reason}" for cid, reason in reasons.items()]
