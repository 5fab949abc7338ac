"""Scaling stage: budget points from adapter snapshots, routing renamed per point, ablation rows, the stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from lora_files import save_lora
from toy import outcome_trajectory

from trace_lib.config import Params, ScalingConfig
from trace_lib.evaluation.scaling import (
    Snapshot,
    ablation_rows,
    ablation_table,
    budget_points,
    find_snapshots,
    point_routing,
    routed_adapters,
    scaling_table,
)
from trace_lib.io import write_json, write_jsonl
from trace_lib.records import AdapterManifest, RouteDecision


def snap(cap: str, k: int, n: int) -> Snapshot:
    return Snapshot(cap, k, n, Path(f"/x/{cap}/snapshots/iter-{k}"))


def test_budget_points_every_snapshot_then_final():
    snaps = {"a": [snap("a", 1, 8), snap("a", 2, 16)], "b": [snap("b", 1, 8), snap("b", 2, 16)]}
    points = budget_points(snaps, {"a": 24, "b": 24}, extra=4)
    # one adapter's next snapshot at a time, in turn: between two rounds, "a" is one snapshot ahead
    assert [(p["total"], p["iteration"]) for p in points] == [
        (0, 0), (12, "a 1, b 0"), (20, 1), (28, "a 2, b 1"), (36, 2), (44, "a final, b 2"), (52, None)]
    assert points[1]["adapters"] == {"a": snaps["a"][0], "b": None}
    assert points[3]["adapters"]["a"].rollouts == 16 and points[-1]["adapters"] == {"a": "final", "b": "final"}
    # requested budgets take the largest point that fits; duplicates merge; below the first point: base
    picked = budget_points(snaps, {"a": 24, "b": 24}, extra=4, budgets=[10, 19, 40, 1000])
    assert [p["total"] for p in picked] == [0, 12, 36, 52]
    above = budget_points(snaps, {"a": 24, "b": 24}, extra=4, budgets=[40, 60])
    assert [p["total"] for p in above] == [0, 36, 52]  # the base model is drawn even when no budget is below 20
    # ... and the final adapters (the evaluate stage's row) even when every budget is below them
    assert [p["total"] for p in budget_points(snaps, {"a": 24, "b": 24}, extra=64, budgets=[16, 32, 44, 60])] == [
        0, 112]
    assert [p["total"] for p in budget_points(snaps, {"a": 24, "b": 24}, extra=4, budgets=[])] == [0, 52]
    # adapters with fewer snapshots reach their final adapter sooner; a snapshot with the final's rollouts
    # is the final adapter, and a step that spends nothing is no point of its own
    uneven = budget_points({"a": [snap("a", 1, 8), snap("a", 2, 16)], "b": [snap("b", 1, 0)]}, {"a": 16, "b": 16})
    assert [(p["total"], p["iteration"]) for p in uneven] == [(0, 0), (8, 1), (16, "a final, b 1"), (32, None)]
    assert budget_points({}, {}) == [{"total": 0, "iteration": 0, "adapters": {}}]


def test_budget_points_three_adapters_and_sparse_budgets():
    snaps = {"a": [snap("a", 1, 4)], "b": [snap("b", 1, 4), snap("b", 2, 8)], "c": []}
    points = budget_points(snaps, {"a": 8, "b": 12, "c": 6})
    assert [(p["total"], p["iteration"]) for p in points] == [
        (0, 0), (4, "a 1, b 0, c 0"), (8, "a 1, b 1, c 0"), (14, "a 1, b 1, c final"), (18, "a final, b 1, c final"),
        (22, "a final, b 2, c final"), (26, None)]
    # a budget between two points takes the one below it, whether or not its neighbours are drawn
    picked = budget_points(snaps, {"a": 8, "b": 12, "c": 6}, budgets=[10, 20])
    assert [p["total"] for p in picked] == [0, 8, 18, 26]
    assert picked[2]["adapters"] == {"a": "final", "b": snaps["b"][0], "c": "final"}


def test_memo_key_normalises_weights_as_route_groups():
    from types import SimpleNamespace

    from trace_lib.evaluation.runner import memo_key, route_groups

    task = SimpleNamespace(id="t1")
    for weights in ({}, {"b": 1.0, "a": 0.5, "c": 0}, {"a@iter-1": 1}):
        (cleaned, _), = route_groups([task], {"t1": weights})
        assert memo_key("env", weights, "t1") == ("env", tuple(cleaned.items()), "t1")
    assert memo_key("env", {"b": 1, "a": 0.5}, "t1") == memo_key("env", {"a": 0.5, "b": 1.0, "c": 0.0}, "t1")


def test_point_routing_renames_adapters_and_keeps_none():
    points = budget_points({"a": [snap("a", 1, 8)], "b": [snap("b", 1, 8)]}, {"a": 16, "b": 16})
    ds = [RouteDecision(task_id="t1", mode="argmax", candidates=["a", "b"], labels=["A", "B", "C"],
                        probs=[0.7, 0.2, 0.1], weights={"a": 1.0}),
          RouteDecision(task_id="t2", mode="argmax", candidates=["a", "b"], labels=["A", "B", "C"],
                        probs=[0.1, 0.2, 0.7], weights={})]
    choices = routed_adapters(ds)
    assert choices == {"t1": ["a"], "t2": []}
    assert point_routing(choices, points[0]) == {"t1": {}, "t2": {}}
    assert point_routing(choices, points[1]) == {"t1": {"a@iter-1": 1.0}, "t2": {}}
    assert point_routing(choices, points[2]) == {"t1": {"a@iter-1": 1.0}, "t2": {}}  # b advanced: a unchanged
    assert point_routing(choices, points[3]) == {"t1": {"a": 1.0}, "t2": {}}
    b_first = budget_points({"a": [snap("a", 1, 8)], "b": [snap("b", 1, 8)]}, {"a": 16, "b": 16})
    b_first[1]["adapters"] = {"a": None, "b": snap("b", 1, 8)}
    assert point_routing(choices, b_first[1]) == {"t1": {}, "t2": {}}  # a not yet trained: the base model


def test_find_snapshots_needs_config_and_meta(tmp_path):
    for k, complete in ((2, True), (1, True), (3, False)):
        folder = tmp_path / "a" / "snapshots" / f"iter-{k}"
        folder.mkdir(parents=True)
        write_json(folder / "snapshot.json", {"iteration": k, "rollouts": 8 * k})
        if complete:
            (folder / "adapter_config.json").write_text("{}")
    assert [(s.iteration, s.rollouts) for s in find_snapshots(tmp_path / "a")] == [(1, 8), (2, 16)]
    assert find_snapshots(tmp_path / "b") == []


def test_ablation_rows_this_run_other_runs_and_how_to(tmp_path):
    def put(root: Path, key: str, outcomes: list[bool], calls: int = 2):
        rows = [outcome_trajectory(f"t{i}", ok).model_copy(update={"tool_calls": calls}) for i, ok in enumerate(outcomes)]
        write_jsonl(root / "data" / "evaluate" / "trajectories" / f"{key}.jsonl", rows)

    put(tmp_path, "base", [False, False, True, False])
    put(tmp_path, "trace_argmax", [True, False, True, False], calls=3)
    other = tmp_path / "sweeps" / "eff"
    put(other, "trace_argmax", [True, True, True, False], calls=1)
    evaluated = {"methods": {"trace_top_p": {"status": "not run", "reason": "evaluate.route_mode is 'argmax'"}}}
    cfg = ScalingConfig(ablation_runs={"efficiency_on": "sweeps/eff"})
    rows = {r["method"]: r for r in ablation_rows(tmp_path, cfg, evaluated, efficiency_on=False, n_boot=50)}
    assert rows["trace_argmax"]["success_rate"] == 0.5 and rows["trace_argmax"]["tool_calls_per_success"] == 3
    assert rows["efficiency_off"]["success_rate"] == 0.5  # this run trained without it
    assert rows["efficiency_on"]["success_rate"] == 0.75 and rows["efficiency_on"]["source"] == "sweeps/eff"
    assert rows["trace_top_p"]["reason"] == "evaluate.route_mode is 'argmax'"
    assert "score.delta=-1" in rows["no_filter"]["reason"]
    table = ablation_table(list(rows.values()))
    assert "not run: needs a run that keeps every candidate" in table.to_string()
    assert scaling_table([rows["base"] | {"budget": 0, "iteration": 0}])["iteration"].tolist() == ["base"]


@pytest.fixture(scope="module")
def loras(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling_loras")
    return {"a": save_lora(tiny_model_dir, root / "a", 1, ["q_proj", "v_proj"], b_std=0.5),
            "a1": save_lora(tiny_model_dir, root / "a1", 3, ["q_proj", "v_proj"], b_std=0.5),
            "b": save_lora(tiny_model_dir, root / "b", 2, ["k_proj", "o_proj"], b_std=0.5),
            "b1": save_lora(tiny_model_dir, root / "b1", 4, ["k_proj", "o_proj"], b_std=0.5),
            "zero": zero_lora(save_lora(tiny_model_dir, root / "zero", 5, ["q_proj", "v_proj"], b_std=0.5))}


def zero_lora(folder: Path) -> Path:
    """A saved adapter with its B matrices set to zero: PEFT's starting point, the base model exactly."""
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file({k: v.zero_() if "lora_B" in k else v for k, v in tensors.items()}, str(path))
    return folder


def test_adapter_is_identity(loras, tmp_path):
    from trace_lib.engine.adapters import adapter_is_identity

    assert adapter_is_identity(loras["zero"]) and not adapter_is_identity(loras["a"])
    assert not adapter_is_identity(tmp_path)  # no weights file


@pytest.mark.parametrize("backend", ["embedded", "embedded-together", "openai"])
def test_run_scaling_after_evaluate(tmp_path, tiny_model_dir, loras, monkeypatch, backend):
    """Evaluate on 2 tasks with two adapters that each have one snapshot, then the scaling stage; in-process
    (method by method, and with every method's and point's episodes in one batch: `evaluate.decode_together`),
    and on a (fake) server that loads every adapter and snapshot by name."""
    from fake_openai import FakeOpenAI, serving

    with FakeOpenAI(serving) as api:
        server = {"policy": {"backend": "openai", "base_url": api.url, "served_model": tiny_model_dir.name,
                             "route_dir": str(tmp_path / "routes")},
                  "model": {"out_dir": "no/such/model"}} if backend == "openai" else {}
        routed = run_scaling_test(tmp_path, tiny_model_dir, loras, monkeypatch, server,
                                  together=backend == "embedded-together")
    if backend == "openai":
        loaded = {b["lora_name"] for path, b in api.requests if path == "/v1/load_lora_adapter"}
        assert {*(f"{c}@iter-1" for c in routed), "grpo_target@iter-2", "grpo_target", "precondition_verification",
                "structured_data_reasoning"} <= loaded
        assert "grpo_target@iter-1" not in loaded  # B = 0: the base model, never loaded
        # a snapshot no routed task runs on is not loaded either
        unrouted = {"precondition_verification", "structured_data_reasoning"} - routed
        assert not {f"{c}@iter-1" for c in unrouted} & loaded


def run_scaling_test(tmp_path, tiny_model_dir, loras, monkeypatch, server: dict, together: bool = False) -> set[str]:
    """The stages on two tasks; returns the capabilities the router sent a task to."""
    from trace_lib.stages.evaluate import run_evaluate
    from trace_lib.stages.scaling import run_scaling

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    for cap, src in (("precondition_verification", "a"), ("structured_data_reasoning", "b")):
        folder = tmp_path / "data" / "adapters" / cap
        shutil.copytree(loras[src], folder)
        shutil.copytree(loras[src + "1"], folder / "snapshots" / "iter-1")
        write_json(folder / "snapshots" / "iter-1" / "snapshot.json", {"iteration": 1, "rollouts": 4})
        write_json(folder / "manifest.json", AdapterManifest(
            capability_id=cap, path=str(folder), base_model=tiny_model_dir.name, env_sha256="", backend="trl",
            rollouts_used=8, iterations=2).model_dump(mode="json"))
    # a baseline with two snapshots: the first never updated (B = 0), so it is the base model
    grpo = tmp_path / "data" / "adapters" / "_baselines" / "grpo_target"
    shutil.copytree(loras["b"], grpo)
    shutil.copytree(loras["zero"], grpo / "snapshots" / "iter-1")
    write_json(grpo / "snapshots" / "iter-1" / "snapshot.json", {"iteration": 1, "rollouts": 6})
    shutil.copytree(loras["a1"], grpo / "snapshots" / "iter-2")
    write_json(grpo / "snapshots" / "iter-2" / "snapshot.json", {"iteration": 2, "rollouts": 9})
    write_json(grpo / "manifest.json", AdapterManifest(
        capability_id="grpo_target", path=str(grpo), base_model=tiny_model_dir.name, env_sha256="", backend="trl",
        rollouts_used=12, iterations=2).model_dump(mode="json"))
    params = Params.model_validate({
        "model": {"out_dir": str(tiny_model_dir), "dtype": "float32"},
        "env": {"tasks_per_family": 1, "families": ["order_total", "refuse_cancel"], "max_steps": 2},
        "rollout": {"max_new_tokens": 6, "constrained": False, "batch_size": 4},
        "evaluate": {"interference_seeds": 0, "n_boot": 100, "methods": ["base", "trace", "grpo_target"],
                     "route_mode": "argmax", "decode_together": together}, **server,
    })
    run_evaluate(params, tmp_path, progress=False)
    metrics = run_scaling(params, tmp_path, progress=False)
    trace = [p for p in metrics["points"] if p["method"] == "TRACE"]
    pv, sdr = "precondition_verification", "structured_data_reasoning"
    assert [(p["budget"], p["iteration"]) for p in trace] == [
        (0, 0), (4, f"{pv} 1, {sdr} 0"), (8, 1), (12, f"{pv} final, {sdr} 1"), (16, None)]
    assert all(p["n"] == 2 for p in trace)
    final = json.loads((tmp_path / "reports" / "metrics" / "evaluate.json").read_text())["methods"]["trace_argmax"]
    assert trace[-1]["success_rate"] == final["overall"]["success_rate"]
    g = [p for p in metrics["points"] if p["method"] == "GRPO on target"]
    assert [(p["budget"], p["iteration"]) for p in g] == [(0, 0), (6, 1), (9, 2), (12, None)]
    assert all(p["n"] == 2 for p in g)

    def episodes(name: str) -> list[dict]:
        return [json.loads(x) for x in (tmp_path / f"data/{name}.jsonl").read_text().splitlines()]

    assert episodes("scaling/trajectories/grpo_target@6") == episodes("evaluate/trajectories/base")
    assert {m["adapter"] for m in episodes("scaling/trajectories/grpo_target@9")} == {"grpo_target@iter-2"}
    assert metrics["snapshots_same_as_base"] == ["grpo_target@iter-1"]
    routes = [json.loads(x) for x in (tmp_path / "data/evaluate/routes/trace_argmax.jsonl").read_text().splitlines()]
    mid = [json.loads(x) for x in (tmp_path / "data/scaling/trajectories/trace@8.jsonl").read_text().splitlines()]
    expect = {r["task_id"]: (f"{next(iter(r['weights']))}@iter-1" if r["weights"] else None) for r in routes}
    assert {m["task_id"]: m["adapter"] for m in mid} == expect
    # staggered points: a task whose adapter is not yet trained runs as the base model did, a task on a
    # final adapter as the evaluate stage's TRACE row did
    by_task = {n: {m["task_id"]: m for m in episodes(n)} for n in
               ("scaling/trajectories/trace@4", "scaling/trajectories/trace@12", "evaluate/trajectories/base",
                "evaluate/trajectories/trace_argmax", "scaling/trajectories/trace@8")}
    for r in routes:
        cap, t = next(iter(r["weights"]), None), r["task_id"]
        at4 = by_task["scaling/trajectories/trace@4"][t]
        at12 = by_task["scaling/trajectories/trace@12"][t]
        assert at4 == by_task["scaling/trajectories/trace@8" if cap == pv else "evaluate/trajectories/base"][t]
        assert at12 == by_task["evaluate/trajectories/trace_argmax" if cap == pv else
                               "scaling/trajectories/trace@8"][t]
    assert metrics["decoded_points"] == len({next(iter(r["weights"]), None) for r in routes} - {None}) + 1
    table = (tmp_path / "reports" / "tables" / "scaling.md").read_text()
    assert "| TRACE | 8 | 1 |" in table and "| GRPO on target | 6 | 1 |" in table
    assert "not run" in table  # the GEPA row says why
    assert "ablation" in (tmp_path / "reports" / "tables" / "ablations.md").read_text()
    assert (tmp_path / "reports" / "figures" / "scaling.png").stat().st_size > 1000
    routed = {next(iter(r["weights"])) for r in routes if r["weights"]}
    # a task the router keeps on the base model: one episode per task at every point (the base model's
    # and the final row's episodes of such a task are one memo entry, not two)
    none = [{**r, "weights": {}} if i == 0 else r for i, r in enumerate(routes)]
    (tmp_path / "data/evaluate/routes/trace_argmax.jsonl").write_text("".join(json.dumps(r) + "\n" for r in none))
    again = run_scaling(params, tmp_path, progress=False)
    assert all(p["n"] == 2 for p in again["points"] if p["method"] == "TRACE")
    # every task on the base model: TRACE's points decode nothing and load no snapshot
    import trace_lib.stages.scaling as stage

    opened: list[list[str]] = []

    def recording(*args, **kwargs):
        opened.append(sorted(args[3]))
        return real(*args, **kwargs)

    real = stage.open_policy
    monkeypatch.setattr(stage, "open_policy", recording)
    (tmp_path / "data/evaluate/routes/trace_argmax.jsonl").write_text(
        "".join(json.dumps({**r, "weights": {}}) + "\n" for r in routes))
    idle = run_scaling(params, tmp_path, progress=False)
    assert opened == [["grpo_target@iter-2"]] and idle["decoded_points"] == 1  # GRPO's point at 9 only
    # sampling (temperature > 0): no episode is shared, every point decodes every task, and a staggered
    # point loads the final adapters of the tasks routed to them from their capability folders
    (tmp_path / "data/evaluate/routes/trace_argmax.jsonl").write_text("".join(json.dumps(r) + "\n" for r in routes))
    opened.clear()
    hot = params.model_copy(update={"evaluate": params.evaluate.model_copy(update={"temperature": 0.7})})
    sampled = run_scaling(hot, tmp_path, progress=False)
    assert sampled["decoded_points"] == 5  # TRACE at 4, 8 and 12, GRPO at 6 and 9
    assert all(p["n"] == 2 for p in sampled["points"] if p["method"] != "GEPA")
    snaps = {f"{c}@iter-1" for c in routed} | ({pv} & routed)  # pv's final at 12, sdr's at no staggered point
    assert opened == [sorted(snaps), ["grpo_target@iter-2"]]  # B = 0 (grpo_target@iter-1) still never loaded
    assert {m["adapter"] for m in episodes("scaling/trajectories/grpo_target@6")} == {None}
    return routed
