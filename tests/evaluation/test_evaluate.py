"""Evaluate stage: routed evaluation with real LoRA weights (tiny model), routing quality, tables, budgets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_files import save_lora
from toy import KVEnv, kv_task, outcome_trajectory

from trace_lib.engine.policy import load_policy
from trace_lib.config import EvaluateConfig, Params, RolloutConfig
from trace_lib.evaluation.gepa import RULES_REASON, gepa_status
from trace_lib.budget import adapter_budget, find_adapters, trace_budget
from trace_lib.evaluation.runner import (
    decode_into_memo,
    evaluate_policy,
    interference_matrix,
    route_groups,
)
from trace_lib.routing.decide import oracle_decisions, route_all, route_by, routing_quality, with_top_p
from trace_lib.evaluation.tables import (
    MethodRun,
    best_single,
    hindsight_route,
    markdown,
    not_run_table,
    paired_table,
    route_solvers,
    routing_table,
    success_interval,
    summarize_runs,
    table1,
    table1_long,
)
from trace_lib.io import read_jsonl, write_json, write_jsonl
from trace_lib.paths import Paths
from trace_lib.records import AdapterManifest, Label, RouteDecision, Task, Trajectory, UserScenario
from trace_lib.engine.compose import merge_label
from trace_lib.routing.route import RouteCandidate
from trace_lib.routing.routers import calibrate, label_prior, lacking_labels
from trace_lib.budget import RolloutLedger

CFG = RolloutConfig(samples_per_task=1, temperature=0.0, max_new_tokens=6, batch_size=4, constrained=False)


@pytest.fixture(scope="module")
def lora_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_loras")
    return {"a": save_lora(tiny_model_dir, root / "a", 1, ["q_proj", "v_proj", "down_proj"], b_std=0.5),
            "b": save_lora(tiny_model_dir, root / "b", 2, ["k_proj", "o_proj", "up_proj"], b_std=0.5)}


@pytest.fixture(scope="module")
def policy(tiny_model_dir, lora_dirs):
    return load_policy(tiny_model_dir, adapters={k: str(v) for k, v in lora_dirs.items()}, policy_id="tiny")


def base_state(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" not in n}


def tagged(i: int, tags: list[str]) -> Task:
    return Task(id=f"t{i}", env="retail", split="test", family="f", instruction="i",
                user=UserScenario(reason_for_call="r"), capability_tags=tags)


# --- evaluate_policy ---------------------------------------------------------------------------------
def test_evaluate_policy_labels_groups_and_restores_base(policy):
    tasks = [kv_task(i) for i in range(4)]
    before = base_state(policy)
    base = evaluate_policy(policy, tasks, KVEnv, CFG, seed=0)
    single = evaluate_policy(policy, tasks, KVEnv, CFG, seed=0, routing="a")
    merged = evaluate_policy(policy, tasks, KVEnv, CFG, seed=0, routing={"a": 0.5, "b": 0.5})
    assert [t.task_id for t in base] == [t.id for t in tasks]
    assert {(t.adapter, t.policy_id) for t in base} == {(None, "tiny")}
    assert {(t.adapter, t.policy_id) for t in single} == {("a", "tiny+a")}
    label = merge_label({"a": 0.5, "b": 0.5})
    assert label == "merge[a=0.5,b=0.5]" and {(t.adapter, t.policy_id) for t in merged} == {(label, f"tiny+{label}")}
    assert [t.messages for t in single] != [t.messages for t in base]  # the adapter changes behaviour

    decisions = [RouteDecision(task_id="toy/read/0", mode="argmax", candidates=["a", "b"], labels=[" A", " B", " C"],
                               probs=[0.1, 0.2, 0.7], weights={}),
                 RouteDecision(task_id="toy/read/1", mode="argmax", candidates=["a", "b"], labels=[" A", " B", " C"],
                               probs=[0.6, 0.2, 0.2], weights={"a": 1.0}),
                 RouteDecision(task_id="toy/read/2", mode="top_p", candidates=["a", "b"], labels=[" A", " B", " C"],
                               probs=[0.4, 0.4, 0.2], weights={"a": 0.5, "b": 0.5}),
                 RouteDecision(task_id="toy/read/3", mode="argmax", candidates=["a", "b"], labels=[" A", " B", " C"],
                               probs=[0.2, 0.2, 0.6], weights={})]
    groups = route_groups(tasks, decisions)
    assert [(w, [t.id for t in ts]) for w, ts in groups] == [
        ({}, ["toy/read/0", "toy/read/3"]), ({"a": 1.0}, ["toy/read/1"]), ({"a": 0.5, "b": 0.5}, ["toy/read/2"])]
    routed = evaluate_policy(policy, tasks, KVEnv, CFG, seed=0, routing=decisions)
    assert [t.adapter for t in routed] == [None, "a", label, None]
    # each task ran exactly as under its group's weights alone (greedy decoding)
    assert routed[0].messages == base[0].messages and routed[3].messages == base[3].messages
    assert routed[1].messages == single[1].messages and routed[2].messages == merged[2].messages
    # a {task id: weights} dict routes the same way
    as_dict = evaluate_policy(policy, tasks[:2], KVEnv, CFG, seed=0, routing={"toy/read/0": {}, "toy/read/1": {"a": 1}})
    assert [t.adapter for t in as_dict] == [None, "a"]

    after = base_state(policy)
    assert all(torch.equal(before[n], after[n]) for n in before)  # bit-identical base weights
    assert policy.adapter is None and not getattr(policy.model, "_trace_merged", False)
    with pytest.raises(ValueError, match="no routing decision for task 'toy/read/3'"):
        evaluate_policy(policy, tasks, KVEnv, CFG, seed=0, routing=decisions[:3])


def test_memo_shares_greedy_episodes_between_methods(policy, monkeypatch):
    """With a memo, a (task, weights) pair decodes once: routing a task to 'a' reuses `single a`'s episode."""
    import trace_lib.evaluation.runner as ev

    calls: list[list[str]] = []
    real = ev.collect_rollouts

    def counting(policy_, factory, tasks, *a, **k):
        calls.append([t.id for t in tasks])
        return real(policy_, factory, tasks, *a, **k)

    monkeypatch.setattr(ev, "collect_rollouts", counting)
    tasks = [kv_task(i) for i in range(3)]
    memo: dict = {}
    base = evaluate_policy(policy, tasks, KVEnv, CFG, seed=0, memo=memo)
    single = evaluate_policy(policy, tasks, KVEnv, CFG, seed=0, routing="a", memo=memo)
    routed = evaluate_policy(policy, tasks, KVEnv, CFG, seed=0, memo=memo,
                             routing={"toy/read/0": {}, "toy/read/1": {"a": 1.0}, "toy/read/2": {"b": 1.0}})
    assert calls == [[t.id for t in tasks], [t.id for t in tasks], ["toy/read/2"]]
    assert routed[0] == base[0] and routed[1] == single[1] and routed[2].adapter == "b"
    fresh = evaluate_policy(policy, tasks[2:], KVEnv, CFG, seed=0, routing="b")
    assert fresh[0].messages == routed[2].messages
    # another environment's tasks never hit this one's entries
    evaluate_policy(policy, tasks[:1], KVEnv, CFG, seed=0, memo=memo, env_name="other")
    assert calls[-1] == ["toy/read/0"]
    with pytest.raises(ValueError, match="only at temperature 0"):
        evaluate_policy(policy, tasks, KVEnv, CFG.model_copy(update={"temperature": 0.5}), seed=0, memo={})


def test_decode_into_memo_plays_every_method_in_one_batch_as_each_alone(policy, monkeypatch):
    """Episodes of the base model, two adapters and a merge decoded in one batch (rows under different
    weights) are the episodes each method decodes alone (fp32, greedy), named as they are."""
    import trace_lib.evaluation.runner as ev

    tasks = [kv_task(i) for i in range(4)]
    cfg = CFG.model_copy(update={"batch_size": 8})
    decisions = {"toy/read/0": {"b": 1.0}, "toy/read/1": {}, "toy/read/2": {"a": 0.5, "b": 0.25},
                 "toy/read/3": {"a": 1.0}}
    routings = [None, "a", "b", {"a": 0.5, "b": 0.25}, decisions]
    alone = [evaluate_policy(policy, tasks, KVEnv, cfg, seed=0, routing=r) for r in routings]
    memo: dict = {}
    before = base_state(policy)
    assert decode_into_memo(policy, tasks, KVEnv, cfg, 0, routings, memo) == 16  # the decisions add nothing new
    assert all(torch.equal(before[n], p) for n, p in base_state(policy).items())
    monkeypatch.setattr(ev, "collect_rollouts", lambda *a, **k: pytest.fail("decoded again"))
    together = [evaluate_policy(policy, tasks, KVEnv, cfg, seed=0, routing=r, memo=memo) for r in routings]
    assert together == alone
    assert {t.policy_id for t in together[3]} == {"tiny+merge[a=0.5,b=0.25]"}
    assert decode_into_memo(policy, tasks, KVEnv, cfg, 0, routings, memo) == 0  # all there already
    # another batch size: rows meet other rows, the episodes stay the same
    memo2: dict = {}
    decode_into_memo(policy, tasks, KVEnv, cfg.model_copy(update={"batch_size": 3}), 0, routings, memo2)
    assert memo2 == memo
    # two weightings whose merge labels agree (6 digits) are still two routes, each task once under each
    from trace_lib.agent.rollout import collect_routed_rollouts

    close = {"a": 0.5 + 1e-9, "b": 0.25}
    per_job, _ = collect_routed_rollouts(policy, KVEnv, [(tasks[0], {"a": 0.5, "b": 0.25}), (tasks[0], close)],
                                         cfg, 0, progress=False)
    assert [len(j) for j in per_job] == [1, 1] and per_job[0][0].adapter == per_job[1][0].adapter
    with pytest.raises(ValueError, match="jobs repeat task 'toy/read/0' under the same weights"):
        collect_routed_rollouts(policy, KVEnv, [(tasks[0], {"a": 1.0}), (tasks[0], {"a": 1})], cfg, 0)
    # where one batch cannot mix weights, nothing is decoded ahead
    monkeypatch.setattr(type(policy), "plays_turns", property(lambda self: False))
    assert decode_into_memo(policy, tasks, KVEnv, cfg, 0, routings, {}) == 0
    with pytest.raises(ValueError, match="only at temperature 0"):
        decode_into_memo(policy, tasks, KVEnv, cfg.model_copy(update={"temperature": 0.5}), 0, routings, {})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: rows under different weights decoded on a GPU against the same on the CPU")
def test_cuda_decodes_every_method_in_one_batch_as_the_cpu_does(tiny_model_dir, lora_dirs):
    """On a GPU, one batch of rows under the base model, two adapters and a merge (per-row LoRA, each route's
    own prefix copied per row: no cascade there) gives the CPU's greedy episodes (fp32)."""
    tasks = [kv_task(i) for i in range(4)]
    routings = [None, "a", "b", {"a": 0.5, "b": 0.25},
                {"toy/read/0": {"b": 1.0}, "toy/read/1": {}, "toy/read/2": {"a": 0.5, "b": 0.25}, "toy/read/3": {"a": 1}}]
    memos = {}
    for device in ("cpu", "cuda"):
        pol = load_policy(tiny_model_dir, adapters={k: str(v) for k, v in lora_dirs.items()}, policy_id="tiny",
                          device=device)
        assert pol.device.type == device
        memos[device] = {}
        assert decode_into_memo(pol, tasks, KVEnv, CFG.model_copy(update={"batch_size": 8}), 0, routings,
                                memos[device]) == 16
    assert memos["cuda"] == memos["cpu"]


def test_route_all_scores_label_tokens_and_none_routes_to_base(policy):
    tasks = [kv_task(i) for i in range(3)]
    cands = [RouteCandidate(capability_id="a", description="looks values up"),
             RouteCandidate(capability_id="b", description="writes values")]
    ds = route_all(policy, tasks, cands, EvaluateConfig(batch_size=2), KVEnv)
    assert [d.task_id for d in ds] == [t.id for t in tasks]
    for d in ds:
        assert d.candidates == ["a", "b"] and len(d.probs) == 3 and sum(d.probs) == pytest.approx(1.0, abs=1e-9)
        best = max(range(3), key=lambda i: d.probs[i])
        assert d.weights == ({} if best == 2 else {d.candidates[best]: 1.0})  # the none-label means base
    tp = with_top_p(ds, 1.0)
    assert all(t.mode == "top_p" and t.probs == d.probs for t, d in zip(tp, ds, strict=True))
    assert all(sum(t.weights.values()) == pytest.approx(1 - t.probs[-1]) for t in tp)
    forced_none = ds[0].model_copy(update={"probs": [0.1, 0.1, 0.8]})
    assert with_top_p([forced_none], 0.5)[0].weights == {}  # none alone reaches p: the base model


def test_route_all_calibrated_divides_by_the_content_free_prior(policy):
    tasks = [kv_task(i) for i in range(3)]
    cands = [RouteCandidate(capability_id="a", description="looks values up"),
             RouteCandidate(capability_id="b", description="writes values")]
    cfg = EvaluateConfig(batch_size=2)
    raw = route_all(policy, tasks, cands, cfg, KVEnv)
    cal = route_all(policy, tasks, cands, cfg, KVEnv, router="calibrated")
    prior = label_prior(policy, cands)
    assert prior.shape == (3,) and prior.sum() == pytest.approx(1.0)
    for r, c in zip(raw, cal, strict=True):
        assert c.router == "calibrated" and c.label_mass == r.label_mass
        assert c.probs == pytest.approx(calibrate(r.probs, prior))
        best = max(range(3), key=lambda i: c.probs[i])
        assert c.weights == ({} if best == 2 else {c.candidates[best]: 1.0})
    both = route_by(policy, tasks, cands, cfg, KVEnv, ("calibrated", "logits"))  # one scoring pass for both
    assert list(both) == ["calibrated", "logits"] and both["logits"] == raw and both["calibrated"] == cal
    with pytest.raises(ValueError, match="needs the score stage's labels"):
        route_all(policy, tasks, cands, cfg, KVEnv, router="knn")


def test_interference_matrix_long_form(policy):
    envs = {"e1": (KVEnv, [kv_task(1)]), "e2": (KVEnv, [kv_task(2), kv_task(3)])}
    rows = interference_matrix(policy, ["a", "b"], envs, CFG, seed=0)
    assert [(r["adapter"], r["env"], r["n"]) for r in rows] == [
        ("base", "e1", 1), ("base", "e2", 2), ("a", "e1", 1), ("a", "e2", 2), ("b", "e1", 1), ("b", "e2", 2)]
    assert all(0 <= r["success_rate"] <= 1 for r in rows)


def test_interference_matrix_in_one_batch_per_env_is_the_matrix_weight_by_weight(policy, monkeypatch):
    """Each environment's base and adapter episodes decoded in one batch (fp32, greedy) give the same matrix,
    in the same order; a policy that cannot mix weights in a batch decodes weight by weight."""
    import trace_lib.evaluation.runner as ev

    envs = {"e1": (KVEnv, [kv_task(1), kv_task(4)]), "e2": (KVEnv, [kv_task(2), kv_task(3), kv_task(5)])}
    cfg = CFG.model_copy(update={"batch_size": 8})
    alone = interference_matrix(policy, ["a", "b"], envs, cfg, seed=0)
    batches = []
    real = ev.collect_routed_rollouts

    def counted(pol, factory, jobs, *args, **kwargs):
        batches.append(sorted({tuple(w.items()) for _, w in jobs}))
        return real(pol, factory, jobs, *args, **kwargs)

    monkeypatch.setattr(ev, "collect_routed_rollouts", counted)
    monkeypatch.setattr(ev, "collect_rollouts", lambda *a, **k: pytest.fail("decoded weight by weight"))
    assert interference_matrix(policy, ["a", "b"], envs, cfg, seed=0, together=True) == alone
    assert batches == [[(), (("a", 1.0),), (("b", 1.0),)]] * 2  # one batch per environment, every route in it
    monkeypatch.undo()
    monkeypatch.setattr(type(policy), "plays_turns", property(lambda self: False))
    monkeypatch.setattr(ev, "collect_routed_rollouts", lambda *a, **k: pytest.fail("decoded in one batch"))
    assert interference_matrix(policy, ["a", "b"], envs, cfg, seed=0, together=True) == alone


# --- routing quality ---------------------------------------------------------------------------------
def test_routing_quality_on_constructed_decisions():
    adapters = ["precondition_verification", "structured_data_reasoning"]
    tasks = [tagged(0, ["precondition_verification", "tool_call_precision"]),
             tagged(1, ["structured_data_reasoning"]),
             tagged(2, ["communicate_result"]),  # no adapter for its tags: the oracle says none
             tagged(3, [])]  # untagged: not scored
    labels = [" A", " B", " C"]

    def dec(i, probs):
        return RouteDecision(task_id=f"t{i}", mode="argmax", candidates=adapters, labels=labels, probs=probs,
                             label_mass=0.5)

    ds = [dec(0, [0.7, 0.2, 0.1]), dec(1, [0.6, 0.3, 0.1]), dec(2, [0.1, 0.1, 0.8]), dec(3, [0.1, 0.1, 0.8])]
    q = routing_quality(ds, tasks, adapters, seed=0)
    assert q["tasks"] == 4 and q["scored"] == 3 and q["labels"] == [*adapters, "none"]
    assert q["confusion"]["precondition_verification"]["precondition_verification"] == 1
    assert q["confusion"]["structured_data_reasoning"]["precondition_verification"] == 1
    assert q["confusion"]["none"]["none"] == 1
    assert q["router_accuracy"] == pytest.approx(2 / 3) and q["random_expected"] == pytest.approx(1 / 3)
    assert q["random_accuracy"] == routing_quality(ds, tasks, adapters, seed=0)["random_accuracy"]
    assert q["none_share"] == 0.5 and q["mean_label_mass"] == 0.5 and q["note"] == ""
    none = routing_quality(ds[3:], tasks[3:], adapters)
    assert none["scored"] == 0 and none["router_accuracy"] is None and "no task carries" in none["note"]
    assert q["majority_accuracy"] == pytest.approx(1 / 3) and q["solved_on_none"] is None
    solved = routing_quality(ds, tasks, adapters, solved={"t0", "t2", "t3", "elsewhere"})
    assert solved["solved_tasks"] == 3 and solved["solved_on_none"] == pytest.approx(2 / 3)
    assert oracle_decisions(tasks, adapters) == {"t0": {"precondition_verification": 1.0},
                                                 "t1": {"structured_data_reasoning": 1.0}, "t2": {}, "t3": {}}


# --- tables and budgets ------------------------------------------------------------------------------
def _runs() -> list[MethodRun]:
    def outcomes(pattern: str) -> list[Trajectory]:
        return [outcome_trajectory(f"t{i}", c == "1", family="x" if i % 2 else "y") for i, c in enumerate(pattern)]

    return [
        MethodRun("base", "base", "base", outcomes("0000011111"), budget=0),
        MethodRun("grpo_target", "grpo_target", "GRPO on target", outcomes("1000011111"), budget=660,
                  budget_source="data/train/_baselines/grpo_target/rollouts.jsonl"),
        MethodRun("gepa", "gepa", "GEPA (system prompt)", None, reason=RULES_REASON),
        MethodRun("merged_data", "merged_data", "merged data (one adapter)", None, reason="no adapter at x"),
        MethodRun("linear_merge", "linear_merge", "linear merge (α = 1/n)", outcomes("1100011111"), budget=660),
        MethodRun("single", "single_a", "single: a", outcomes("1110011111"), budget=300),
        MethodRun("single", "single_b", "single: b", outcomes("0000001111"), budget=340),
        MethodRun("oracle_route", "oracle_route", "oracle routing", outcomes("1111011111"), budget=660),
        MethodRun("trace", "trace_argmax", "TRACE (argmax)", outcomes("1111111111"), budget=660),
        MethodRun("trace", "trace_top_p", "TRACE (top-p)", None, reason="evaluate.route_mode is 'argmax'"),
    ]


def test_table1_renders_not_run_rows_budget_and_best_single():
    runs = _runs()
    summarize_runs(runs, n_boot=200, seed=0)
    df = table1(runs, ["y", "x"], trace_total=660)
    assert list(df.columns) == ["method", "overall", "rollouts", "budget vs TRACE", "note", "y", "x"]
    assert list(df["method"]) == ["base", "GRPO on target", "GEPA (system prompt)", "merged data (one adapter)",
                                  "linear merge (α = 1/n)", "single-capability (best: a)", "single: a", "single: b",
                                  "TRACE (argmax)", "TRACE (top-p)"]
    rows = df.set_index("method")
    gepa = rows.loc["GEPA (system prompt)"]
    assert (gepa[["y", "x", "overall"]] == "not run").all() and gepa["note"] == f"not run: {RULES_REASON}"
    assert gepa["rollouts"] == "—" and rows.loc["TRACE (top-p)"]["note"].startswith("not run: evaluate.route_mode")
    assert rows.loc["base", "overall"].startswith("50.0 [")
    assert rows.loc["TRACE (argmax)", "overall"] == "100.0 [72.2, 100.0] 10/10"  # Wilson: a width at n of n
    assert rows.loc["GRPO on target", "rollouts"] == "660" and rows.loc["GRPO on target", "budget vs TRACE"] == "1.00×"
    assert rows.loc["single: b", "budget vs TRACE"] == "0.52×" and rows.loc["base", "budget vs TRACE"] == "0.00×"
    assert "chosen on this split" in rows.loc["single-capability (best: a)", "note"]
    md = markdown(df)
    assert md.splitlines()[0].startswith("| method | overall | rollouts | budget vs TRACE | note | y | x |")
    assert f"| not run: {RULES_REASON} |" in md and md.count("\n") == len(df) + 2
    long = table1_long(runs, ["y", "x"])
    assert len(long) == 3 * len(df) and set(long["status"]) == {"run", "not run"}
    assert long.query("key == 'trace_argmax' and column == 'overall'")["success_rate"].item() == 1.0
    routing = routing_table(runs, 660).set_index("method")
    assert list(routing.index) == ["TRACE (argmax)", "TRACE (top-p)", "oracle routing", "linear merge (α = 1/n)",
                                   "merged data (one adapter)", "single-capability (best: a)"]
    assert routing.loc["TRACE (argmax)", "Δ vs base (pp)"].startswith("+50.0 [")
    assert float(routing.loc["TRACE (argmax)", "McNemar p"]) == pytest.approx(2 / 2**5)
    paired = paired_table(runs).set_index("method")
    assert list(paired.index) == ["GRPO on target", "linear merge (α = 1/n)", "single-capability (best: a)",
                                  "single: a", "single: b", "TRACE (argmax)"]
    # TRACE (argmax) solves all 10 tasks, GRPO on target 6: TRACE wins 4 tasks and loses none
    assert paired.loc["GRPO on target", "TRACE − method (pp)"].startswith("+40.0 [")
    assert float(paired.loc["GRPO on target", "McNemar p (TRACE vs method)"]) == pytest.approx(2 / 2**4)
    assert paired.loc["GRPO on target", "method − base (pp)"].startswith("+10.0 [")
    assert paired.loc["TRACE (argmax)", "TRACE − method (pp)"] == "—"  # not compared with itself
    assert paired.loc["TRACE (argmax)", "method − base (pp)"] == routing.loc["TRACE (argmax)", "Δ vs base (pp)"]
    assert [r for r in runs if r.key == "base"][0].summary["trace_vs"]["trace"] == "trace_argmax"


def test_every_table_and_figure_shows_a_success_rate_with_its_wilson_interval(tmp_path: Path):
    """Table 1, the per-environment table, the scaling table and both figures draw the same interval."""
    import pandas as pd

    from trace_lib.evaluation.scaling import pct
    from trace_lib.evaluation.environments import EnvBlock, env_block_cells
    from trace_lib.plots.evaluate import scaling_curve, success_by_method

    runs = _runs()
    summarize_runs(runs, n_boot=200, seed=0)
    trace = next(r for r in runs if r.key == "trace_argmax").summary["overall"]
    assert (trace["ci_low"], trace["ci_high"]) == (1.0, 1.0)  # the bootstrap's collapses at 10 of 10
    lo, hi = success_interval(trace)
    assert (round(100 * lo, 1), hi) == (72.2, pytest.approx(1.0))
    assert success_interval({"ci_low": 0.1, "ci_high": 0.3}) == (0.1, 0.3)  # rows written without Wilson's
    assert success_interval({"ci_low": 0.1, "ci_high": 0.3, "wilson_low": None, "wilson_high": None}) == (0.1, 0.3)

    path = tmp_path / "table1.csv"
    table1_long(runs, ["y", "x"]).to_csv(path, index=False)
    rate, _, rollouts = env_block_cells(EnvBlock("retail", "this run", pd.read_csv(path)), "trace_argmax")
    assert rate == "100.0 [72.2, 100.0] (10/10)" and rollouts == "660"
    assert pct({**trace, "n": 10}) == "100.0 [72.2, 100.0] (10)"

    fig = success_by_method(runs)
    row = [r.key for r in runs].index("trace_argmax")
    segments = [seg for c in fig.axes[0].collections for seg in c.get_segments()]  # the error bars
    (start, end), = [seg for seg in segments if seg[0][1] == row]
    assert (start[0], end[0]) == (pytest.approx(lo), pytest.approx(1.0))
    assert "Wilson" in fig.axes[0].get_xlabel()
    curve = scaling_curve([{"method": "trace", "budget": 660, **trace}])
    assert "Wilson" in curve.axes[0].get_ylabel()


def test_best_single_is_chosen_on_validation_when_every_single_played_it():
    runs = _runs()  # on this split a (6/10) beats b (4/10); on validation b wins
    summarize_runs(runs, n_boot=50, seed=0)
    runs[5].validation, runs[6].validation = (1, 4), (3, 4)
    best = best_single(runs)
    assert best is not None and best.label == "single-capability (best: b)" and best.trajectories is runs[6].trajectories
    assert best.note == "best of 2 single adapters on the validation split (a 1/4, b 3/4)"
    runs[5].validation = None  # one single without validation episodes: the split's own choice, said so
    assert "chosen on this split (no validation split" in best_single(runs).note
    only = [r for r in runs if r.key != "single_b"]
    assert best_single(only).note == "the only single adapter: no choice made"


def test_hindsight_route_takes_a_solving_route_per_task_and_scores_routers_by_it():
    runs = _runs()  # base 0000011111, single a 1110011111, single b 0000001111
    solvers = route_solvers(runs)
    assert solvers == {"t0": ["a"], "t1": ["a"], "t2": ["a"], "t5": ["none", "a"],
                       **{f"t{i}": ["none", "a", "b"] for i in range(6, 10)}}
    bound = hindsight_route(runs, budget=660)
    assert bound is not None and bound.key == "hindsight_route" and bound.budget == 660
    assert [t.success for t in bound.trajectories] == [True] * 3 + [False] * 2 + [True] * 5
    assert [t.id for t in bound.trajectories] == [t.id for t in runs[0].trajectories]
    assert bound.trajectories[0] is runs[5].trajectories[0] and bound.trajectories[3] is runs[0].trajectories[3]
    assert hindsight_route([r for r in runs if r.method != "single"]) is None  # no single adapter: no bound
    assert hindsight_route([r for r in runs if r.key != "base"]) is None
    summarize_runs([*runs, bound], n_boot=200, seed=0)
    row = routing_table([*runs, bound], 660).set_index("method").loc["best route per task, in hindsight (bound)"]
    assert row["overall"].startswith("80.0 [") and row["Δ vs base (pp)"].startswith("+30.0 [")

    adapters = ["a", "b"]
    tasks = [tagged(i, ["a"] if i < 3 else ["b"] if i == 3 else []) for i in range(10)]

    def dec(i, probs):
        return RouteDecision(task_id=f"t{i}", mode="argmax", candidates=adapters, labels=[" A", " B", " C"],
                             probs=probs, label_mass=0.5)

    to_a, to_b, to_none = [0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]
    ds = [dec(0, to_a), dec(1, to_b), dec(2, to_none), dec(3, to_a), dec(4, to_b), dec(5, to_b),
          *(dec(i, to_none) for i in range(6, 10))]
    q = routing_quality(ds, tasks, adapters, solvers=solvers)
    # 8 tasks solvable (t3, t4 by no route); the router's route solves t0 and t6-t9, not t1, t2, t5
    assert q["solvable_tasks"] == 8 and q["router_solvable_hits"] == pytest.approx(5 / 8)
    # the oracle routes the tagged solvable tasks t0-t2 to a: all solved
    assert q["oracle_solvable_hits"] == 1.0
    plain = routing_quality(ds, tasks, adapters)
    assert plain["solvable_tasks"] is None and plain["router_solvable_hits"] is None


def _adapter(root, name, used, baseline=False):
    folder = root / "data" / "adapters" / ("_baselines" if baseline else "") / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    write_json(folder / "manifest.json", AdapterManifest(
        capability_id=name, path=str(folder), base_model="tiny", env_sha256="", backend="trl",
        rollouts_used=used, iterations=1).model_dump(mode="json"))


def test_baseline_row_at_equal_budget_from_ledgers(tmp_path):
    _adapter(tmp_path, "a", 300)
    _adapter(tmp_path, "b", 999)  # stale manifest number: the ledger wins
    _adapter(tmp_path, "grpo_target", 0, baseline=True)
    (tmp_path / "data" / "adapters" / ".a.ckpt").mkdir()  # checkpoints and temp folders are skipped
    for name, rows in (("a", [160, 140]), ("b", [340])):
        ledger = RolloutLedger(Paths(tmp_path).train_ledger(name))
        for n in rows:
            ledger.add("train", n, key=name)
    RolloutLedger(tmp_path / "data" / "envs" / "rollouts.jsonl").add("band", 20, key="a")
    RolloutLedger(Paths(tmp_path).train_ledger("grpo_target", baseline=True)).add("train", 660, key="grpo_target")

    caps, baselines = find_adapters(tmp_path)
    assert sorted(caps) == ["a", "b"] and sorted(baselines) == ["grpo_target"]
    assert adapter_budget(tmp_path, "a") == (300, "data/train/a/rollouts.jsonl")
    budget = trace_budget(tmp_path, ["a", "b"])
    assert budget == {"total": 660, "by_adapter": {"a": 300, "b": 340}, "synthesize": 20, "discovery": 0}
    rollouts = Paths(tmp_path).rollouts("train")
    rollouts.parent.mkdir(parents=True, exist_ok=True)
    rollouts.write_text("{}\n{}\n\n{}\n")  # three discovery episodes on the target (blank lines skipped)
    charged = trace_budget(tmp_path, ["a", "b"], "train")
    assert (charged["total"], charged["discovery"]) == (663, 3)
    rollouts.unlink()
    n, src = adapter_budget(tmp_path, "grpo_target", baseline=True)
    assert (n, src) == (660, "data/train/_baselines/grpo_target/rollouts.jsonl")
    Paths(tmp_path).train_ledger("a").unlink()
    assert adapter_budget(tmp_path, "a") == (300, "manifest")  # no ledger: the manifest's count

    runs = [MethodRun("base", "base", "base", [outcome_trajectory("t0", False)], budget=0),
            MethodRun("grpo_target", "grpo_target", "GRPO on target", [outcome_trajectory("t0", True)], budget=n, budget_source=src)]
    summarize_runs(runs, n_boot=0)
    row = table1(runs, ["f"], budget["total"]).set_index("method").loc["GRPO on target"]
    assert (row["rollouts"], row["budget vs TRACE"]) == ("660", "1.00×")


def test_gepa_row_reason(monkeypatch):
    params = Params()
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    assert gepa_status(params.analyst, params.evaluate) == RULES_REASON
    anthropic = Params.model_validate({"analyst": {"backend": "anthropic"}})
    assert gepa_status(anthropic.analyst, anthropic.evaluate) is None  # an LLM analyst and gepa installed: it runs


def test_evaluate_config_rejects_repeated_greedy_samples():
    with pytest.raises(ValueError, match="identical greedy"):
        EvaluateConfig(samples_per_task=2)
    assert EvaluateConfig(samples_per_task=2, temperature=0.7).samples_per_task == 2
    with pytest.raises(ValueError):
        EvaluateConfig(methods=["base", "magic"])


# --- the stage ---------------------------------------------------------------------------------------
def evaluate_tree(root, tiny_model_dir, lora_dirs, distilled: bool = False, **sections) -> Params:
    """Two (random) capability adapters (and, with `distilled`, a distilled student that spent 4 rollouts), the
    train rollouts and labels the kNN router learns from, and the params of a small evaluate run on 2 retail
    test tasks (`sections` override)."""
    import shutil

    if distilled:
        folder = Paths(root).adapter("distilled", baseline=True)
        shutil.copytree(lora_dirs["b"], folder)
        write_json(folder / "manifest.json", AdapterManifest(
            capability_id="distilled", path=str(folder), base_model=tiny_model_dir.name, env_sha256="",
            backend="trl", rollouts_used=4, iterations=1).model_dump(mode="json"))
        RolloutLedger(Paths(root).train_ledger("distilled", baseline=True)).add("train", 4, key="distilled")

    for cap, src in (("precondition_verification", "a"), ("structured_data_reasoning", "b")):
        folder = root / "data" / "adapters" / cap
        shutil.copytree(lora_dirs[src], folder)
        write_json(folder / "manifest.json", AdapterManifest(
            capability_id=cap, path=str(folder), base_model=tiny_model_dir.name, env_sha256="", backend="trl",
            rollouts_used=8, iterations=1).model_dump(mode="json"))
    params = Params.model_validate({
        "model": {"out_dir": str(tiny_model_dir), "dtype": "float32"},
        "env": {"tasks_per_family": 1, "families": ["order_total", "refuse_cancel"], "max_steps": 2},
        "rollout": {"max_new_tokens": 6, "constrained": False, "batch_size": 4},
        "evaluate": {"interference_seeds": 0, "n_boot": 100, "router": "knn", "knn_k": 1}, **sections,
    })
    # the rollout and score stages' outputs the kNN router learns from: order_total lacked
    # structured_data_reasoning, refuse_cancel lacked nothing an adapter trains (and was solved)
    paths = Paths(root)
    write_jsonl(paths.rollouts("train"), [
        Trajectory(id=f"{f}-train-000#0", task_id=f"{f}-train-000", env="retail", family=f, split="train",
                   policy_id="p", seed=0, messages=[], reward=float(ok), success=ok, termination="agent_stop",
                   tool_calls=0, invalid_actions=0, tool_errors=0, turns=1, prompt_tokens=1, completion_tokens=1)
        for f, ok in (("order_total", False), ("refuse_cancel", True))])
    write_jsonl(paths.labels, [
        Label(trajectory_id="order_total-train-000#0", capability_id="structured_data_reasoning", label="LACKING"),
        Label(trajectory_id="refuse_cancel-train-000#0", capability_id="communicate_result", label="LACKING")])
    return params


def test_router_auto_is_chosen_on_the_validation_split(tmp_path, tiny_model_dir, lora_dirs, monkeypatch):
    """`evaluate.router: auto`: the base model plays the validation tasks, the analyst labels them, and the
    router that agrees most with those labels drives the TRACE rows; the test split plays no part in the choice."""
    from trace_lib.evaluation.router_side import ROUTERS, chosen_router
    from trace_lib.stages.evaluate import run_evaluate

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    env = {"tasks_per_family": 1, "families": ["order_total", "refuse_cancel"], "max_steps": 2,
           "validation_fraction": 0.2}
    params = evaluate_tree(tmp_path, tiny_model_dir, lora_dirs, env=env,
                           evaluate={"interference_seeds": 0, "n_boot": 100, "router": "auto", "knn_k": 1,
                                     "methods": ["base", "single", "trace"]})
    metrics = run_evaluate(params, tmp_path, progress=False)
    singles = {k: v for k, v in metrics["methods"].items() if k.startswith("single_") and k != "single_best"}
    assert len(singles) == 2 and all(v["validation"][1] == 2 for v in singles.values())  # each on validation too
    assert metrics["methods"]["single_best"]["note"].startswith("best of 2 single adapters on the validation split")
    routers = metrics["routers"]
    assert {r: routers[r]["validation"]["tasks"] for r in ROUTERS} == dict.fromkeys(ROUTERS, 2)
    assert metrics["router"] == chosen_router("auto", routers, list(ROUTERS))
    assert metrics["routing"] == routers[metrics["router"]]["test"]
    labels = read_jsonl(Paths(tmp_path).validation_labels, Label)
    assert {lab.trajectory_id.split("#")[0].rsplit("-", 2)[1] for lab in labels} == {"validation"}


def test_chosen_router_takes_the_best_validation_accuracy_first_in_order_on_a_tie():
    from trace_lib.evaluation.router_side import chosen_router

    def acc(*values):
        return {r: {"validation": {"router_accuracy": v}} for r, v in zip(("logits", "calibrated", "knn"), values)}

    scored = ["logits", "calibrated", "knn"]
    assert chosen_router("knn", acc(0.9, 0.1, 0.0), scored) == "knn"
    assert chosen_router("auto", acc(0.2, 0.5, 0.4), scored) == "calibrated"
    assert chosen_router("auto", acc(0.5, 0.2, 0.5), scored) == "logits"
    assert chosen_router("auto", acc(None, None, 0.0), scored) == "knn"


def test_run_evaluate_smoke(tmp_path, tiny_model_dir, lora_dirs, monkeypatch):
    """The whole stage on 2 retail test tasks with two (random) capability adapters and no synthetic envs."""
    from trace_lib.stages.evaluate import run_evaluate

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    params = evaluate_tree(tmp_path, tiny_model_dir, lora_dirs, distilled=True)
    metrics = run_evaluate(params, tmp_path, progress=False)
    assert metrics["numerics"]["device"] == "cpu" and metrics["numerics"]["torch"]
    routers = metrics["routers"]
    assert set(routers) == {"logits", "calibrated", "knn"}
    assert routers["knn"]["train"]["solved_tasks"] == 1 and routers["knn"]["train"]["scored"] == 2
    assert metrics["routing"] == routers["knn"]["test"] and metrics["routing"]["router"] == "knn"
    methods = metrics["methods"]
    ran = {k for k, v in methods.items() if v["status"] == "run"}
    assert ran == {"base", "linear_merge", "single_best", "single_precondition_verification",
                   "single_structured_data_reasoning", "oracle_route", "trace_argmax", "trace_top_p", "distilled",
                   "hindsight_route"}
    assert methods["hindsight_route"]["rollouts"] == 18
    assert methods["hindsight_route"]["overall"]["successes"] >= max(
        methods[k]["overall"]["successes"] for k in ("base", "single_precondition_verification",
                                                     "single_structured_data_reasoning"))
    assert metrics["routing"]["solvable_tasks"] == methods["hindsight_route"]["overall"]["successes"]
    assert routers["knn"]["train"]["solvable_tasks"] is None
    assert methods["gepa"]["reason"] == RULES_REASON and "no adapter at" in methods["grpo_target"]["reason"]
    # TRACE's budget: 2 x 8 training rollouts plus the 2 discovery rollouts on the target; the student adds its 4
    assert methods["trace_argmax"]["rollouts"] == 18 and metrics["trace_budget"]["total"] == 18
    assert methods["distilled"]["rollouts"] == 22 and metrics["baselines"] == ["distilled"]
    assert methods["distilled"]["trace_vs"]["trace"] == "trace_argmax"
    student = [json.loads(x) for x in (tmp_path / "data/evaluate/trajectories/distilled.jsonl").open()]
    assert len(student) == 2 and {t["adapter"] for t in student} == {"distilled"}
    assert metrics["trace_budget"]["discovery"] == 2 == metrics["analysis_rollouts"]
    assert metrics["routing"]["scored"] == 2 and metrics["tasks"] == 2
    # base, linear merge, the two singles and the student decode 2 tasks each; oracle and TRACE argmax reuse
    # them (top-p merges may add new weight states)
    assert 10 <= metrics["episodes_decoded"] <= 12
    out = tmp_path / "data" / "evaluate"
    base = [json.loads(x) for x in (out / "trajectories" / "base.jsonl").read_text().splitlines()]
    assert len(base) == 2 and {b["adapter"] for b in base} == {None}
    # the labels oracle: the rules analyst's labels of the base model's two episodes, each task to the capability
    # labelled lacking (none where none is)
    labels = read_jsonl(out / "oracle_labels.jsonl", Label)
    assert sorted((lb.trajectory_id, lb.capability_id) for lb in labels) == sorted(
        (b["id"], c) for b in base for c in ("precondition_verification", "structured_data_reasoning"))
    lacking = lacking_labels(labels, {b["id"]: b["task_id"] for b in base},
                             ["precondition_verification", "structured_data_reasoning"])
    oracle = [json.loads(x) for x in (out / "trajectories" / "oracle_route.jsonl").read_text().splitlines()]
    assert {o["task_id"]: o["adapter"] for o in oracle} == lacking
    assert methods["oracle_route"]["label"] == "oracle routing (lacking capability)"
    assert metrics["routing"]["oracle"] == "labels" and routers["knn"]["train"]["oracle"] == "labels"
    assert sum(sum(row.values()) for row in metrics["routing"]["confusion"].values()) == 2
    # on train the oracle is the score stage's labels: order_total lacked structured_data_reasoning, refuse_cancel
    # nothing with an adapter; each task's one neighbour (leave-one-out) votes the other's label
    train_confusion = routers["knn"]["train"]["confusion"]
    assert train_confusion["structured_data_reasoning"]["none"] == 1 == train_confusion["none"]["structured_data_reasoning"]
    assert len((out / "routes" / "trace_top_p.jsonl").read_text().splitlines()) == 2
    knn = {d["task_id"].split("-")[0]: d for d in map(json.loads, (out / "routes" / "trace_argmax.jsonl").open())}
    assert {f: (d["router"], d["weights"]) for f, d in knn.items()} == {  # each test task's one neighbour
        "order_total": ("knn", {"structured_data_reasoning": 1.0}), "refuse_cancel": ("knn", {})}
    assert sorted(p.name for p in (out / "routes").iterdir()) == [
        "router_calibrated.jsonl", "router_logits.jsonl", "trace_argmax.jsonl", "trace_top_p.jsonl"]
    assert "knn (test)" in (tmp_path / "reports" / "tables" / "routing.md").read_text()
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in results} == ran - {"single_best"}
    skipped = not_run_table(metrics)
    assert list(skipped.columns) == ["method", "reason"] and len(skipped) == len(methods) - len(ran)
    assert skipped.set_index("method").loc["GEPA (system prompt)", "reason"] == RULES_REASON
    table = (tmp_path / "reports" / "tables" / "table1.md").read_text()
    assert "| method | overall | rollouts | budget vs TRACE | note |\n" in table  # fits a screen: families below
    assert "## Per family" in table and "| method | order_total | refuse_cancel |\n" in table
    assert f"not run: {RULES_REASON}" in table
    for name in ("routing.md", "interference.md", "capabilities.md", "table1.csv"):
        assert (tmp_path / "reports" / "tables" / name).is_file()
    for name in ("evaluate_success.png", "evaluate_routing_confusion.png", "evaluate_interference.png"):
        assert (tmp_path / "reports" / "figures" / name).is_file()
    assert json.loads((tmp_path / "reports" / "metrics" / "evaluate.json").read_text())["tasks"] == 2


def test_run_evaluate_decoding_methods_together_writes_the_same_episodes(tmp_path, tiny_model_dir, lora_dirs,
                                                                         monkeypatch):
    """`evaluate.decode_together`: every method's episodes in one batch, rows under different weights; the
    stage writes the same trajectories (fp32, greedy) and says how many it decoded that way."""
    from trace_lib.stages.evaluate import run_evaluate

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    out = {}
    for together in (False, True):
        root = tmp_path / str(together)
        params = evaluate_tree(root, tiny_model_dir, lora_dirs, distilled=True)
        params = params.model_copy(update={"evaluate": params.evaluate.model_copy(
            update={"decode_together": together, "interference_seeds": 0})})
        metrics = run_evaluate(params, root, progress=False)
        out[together] = {f.name: f.read_text() for f in sorted((root / "data/evaluate/trajectories").iterdir())}
        assert metrics["episodes_decoded_together"] == (metrics["episodes_decoded"] if together else 0)
    assert out[True] == out[False] and len(out[True]) >= 8


def test_run_evaluate_on_a_server_without_a_local_model(tmp_path, tiny_model_dir, lora_dirs, monkeypatch):
    """policy.backend openai: adapters loaded into the server by name, routes scored from its top
    log-probabilities, merges served as concatenated adapters; the same records and tables."""
    from fake_openai import FakeOpenAI, serving

    from trace_lib.stages.evaluate import run_evaluate

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with FakeOpenAI(serving) as api:
        params = evaluate_tree(tmp_path, tiny_model_dir, lora_dirs, policy={
            "backend": "openai", "base_url": api.url, "served_model": tiny_model_dir.name,
            "route_dir": str(tmp_path / "routes")}, evaluate={"interference_seeds": 0, "n_boot": 100, "router": "knn",
                                                               "knn_k": 1, "oracle": "tags"})
        params = params.model_copy(update={"model": params.model.model_copy(update={"out_dir": "no/such/model"})})
        metrics = run_evaluate(params, tmp_path, progress=False)
    assert metrics["numerics"]["device"] == "server" and metrics["policy_id"] == tiny_model_dir.name
    ran = {k for k, v in metrics["methods"].items() if v["status"] == "run"}
    assert ran == {"base", "linear_merge", "single_best", "single_precondition_verification",
                   "single_structured_data_reasoning", "oracle_route", "trace_argmax", "trace_top_p",
                   "hindsight_route"}
    loads = {b["lora_name"]: b["lora_path"] for path, b in api.requests if path == "/v1/load_lora_adapter"}
    caps = {"precondition_verification", "structured_data_reasoning"}
    assert caps < set(loads) and all(Path(loads[c]) == (tmp_path / "data" / "adapters" / c).resolve() for c in caps)
    merges = set(loads) - caps  # the linear merge (1/2 each) at least, each from a folder under route_dir
    assert merges and all(n.startswith("route-") and Path(loads[n]).parent == tmp_path / "routes" for n in merges)
    assert {b["model"] for b in api.bodies()} == {tiny_model_dir.name, *caps, *merges}
    logits = [json.loads(x) for x in (tmp_path / "data/evaluate/routes/router_logits.jsonl").read_text().splitlines()]
    # the server puts ' B' first and ' A' second; ' C' (none, with two candidates) is not among its alternatives
    assert all(d["probs"][1] > d["probs"][0] > d["probs"][2] > 0 for d in logits) and len(logits) == 2
    merged = [json.loads(x) for x in (tmp_path / "data/evaluate/trajectories/linear_merge.jsonl").open()]
    assert {t["adapter"] for t in merged} == {merge_label({c: 0.5 for c in caps})}
    assert (tmp_path / "reports" / "tables" / "table1.md").is_file() and not Path("no/such/model").exists()
    # the tags oracle: each task's most specific tag with an adapter; no labels written
    oracle = [json.loads(x) for x in (tmp_path / "data/evaluate/trajectories/oracle_route.jsonl").open()]
    assert {o["task_id"].split("-")[0]: o["adapter"] for o in oracle} == {
        "order_total": "structured_data_reasoning", "refuse_cancel": "precondition_verification"}
    assert metrics["methods"]["oracle_route"]["label"] == "oracle routing (task tags)"
    assert metrics["routing"]["oracle"] == "tags" and not (tmp_path / "data/evaluate/oracle_labels.jsonl").exists()


def test_findings_are_sentences_computed_from_the_metrics():
    from trace_lib.evaluation.tables import findings

    def cmp(diff, lo, hi, p, a, b):
        return {"tasks": 48, "diff": diff, "ci_low": lo, "ci_high": hi,
                "mcnemar": {"p_value": p, "only_a": a, "only_b": b}}

    metrics = {"methods": {
        "base": {"label": "base", "status": "run", "rollouts": 0},
        "grpo_target": {"label": "GRPO on target", "status": "run", "rollouts": 352,
                        "vs_base": cmp(0.0, -0.05, 0.05, 1.0, 1, 1), "trace_vs": cmp(0.125, 0.02, 0.23, 0.03, 7, 1)},
        "grpo_target_late": {"label": "GRPO on target (reads played)", "status": "not run", "reason": "no adapter"},
        "trace_argmax": {"label": "TRACE (argmax)", "status": "run", "rollouts": 352,
                         "vs_base": cmp(0.125, 0.04, 0.21, 0.0078, 8, 1)}},
        "router": "knn", "routers": {"knn": {"validation": {"router_accuracy": 0.75}}},
        "routing": {"router_accuracy": 0.5}}
    lines = findings(metrics)
    assert len(lines) == 6  # no routing counts, no best single adapter: nothing said of them
    assert lines[0] == ("TRACE (argmax) − base: +12.5 pp [+4.0 pp, +21.0 pp] over 48 tasks; exact McNemar p = 0.0078 "
                        "(8 solved only by TRACE (argmax), 1 only by base).")
    assert lines[1].startswith("GRPO on target − base: +0.0 pp") and lines[1].endswith("at 352 rollouts.")
    assert lines[2].startswith("TRACE (argmax) − GRPO on target: +12.5 pp") and lines[2].endswith(
        "at 352 rollouts against 352.")
    assert lines[3] == "GRPO on target (reads played) did not run: no adapter."
    assert lines[4] == "Methods that differ from the base model at p < 0.05: TRACE (argmax)."
    assert lines[5] == "Router: knn; agreement with the oracle 0.75 on validation, 0.50 on test."
    routed = {**metrics, "routing": {"router_accuracy": 0.5, "tasks": 48, "none_share": 0.25},
              "methods": {**metrics["methods"], "single_best": {
                  "label": "single-capability (best: a)", "status": "run", "trace_vs": cmp(0.0, 0.0, 0.0, 1.0, 0, 0)}}}
    assert findings(routed)[6:] == [
        "The router sent 36 of 48 test tasks to an adapter and 12 to none.",
        "What routing changed: TRACE (argmax) − single-capability (best: a): +0.0 pp [+0.0 pp, +0.0 pp] over 48 "
        "tasks; exact McNemar p = 1 (0 solved only by TRACE (argmax), 0 only by single-capability (best: a)) "
        "(the best single adapter on every task)."]
    # no TRACE row: the baselines still against the base model
    alone = {"methods": {"trace_argmax": {"status": "not run", "reason": "no capability adapters"},
                         "grpo_target": {**metrics["methods"]["grpo_target"], "trace_vs": None}}}
    assert findings(alone) == ["TRACE did not run: no capability adapters.", lines[1],
                               "Methods that differ from the base model at p < 0.05: none."]


def test_why_no_adapters_says_what_the_earlier_stages_recorded(tmp_path):
    from trace_lib.evaluation.inputs import why_no_adapters
    from trace_lib.records import SyntheticEnvManifest

    assert why_no_adapters(tmp_path) == "no capability adapters under data/adapters/"
    write_jsonl(Paths(tmp_path).env_manifests, [])
    assert why_no_adapters(tmp_path) == "no capability adapters: the score stage kept no capability"
    dropped = SyntheticEnvManifest(capability_id="communicate_result", source="template", path="", sha256="",
                                   target_env="retail", valid=False,
                                   reason="calibration: no setting in band (success in [0.1, 0.6]): ...")
    write_jsonl(Paths(tmp_path).env_manifests, [dropped])
    assert why_no_adapters(tmp_path) == ("no capability adapters: no environment to train on (communicate_result: "
                                         "calibration: no setting in band)")
