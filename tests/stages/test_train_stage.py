"""The train stage (`stages/train.py`): what it writes for every adapter, with stand-in trainings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.mark.filterwarnings("ignore::trace_lib.config.ProfileOverride")
def test_the_train_stage_reports_each_adapters_seconds_per_rollout_in_its_metrics_only(tmp_path, monkeypatch):
    """`reports/metrics/train.json`'s `timing` gives every trained adapter (capability adapters and baselines) its
    wall seconds over the rollouts it spent; data/ holds no timing. The trainings are stand-ins that write what
    `train_adapter_mixture` writes."""
    from trace_lib.config import params_from_dict
    from trace_lib.io import read_json, write_json
    from trace_lib.records import AdapterManifest
    from trace_lib.stages import train as stage
    from trace_lib.training import plan
    from trace_lib.training.trainer import planned_rollouts

    params = params_from_dict({"train": {"groups": 1, "group_size": 2, "reference_samples": 0, "iterations": 2, "baselines": ["grpo_target"],
                                         "distill": {"iterations": 0}, "lockstep": False}})
    seconds = {"cap": [3.0, 4.5], "grpo_target": [2.0, 2.5, 1.0, 1.5, 3.0]}

    class Box:  # the sandbox the capability's environment would be served by
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    late = {}

    def fake_train(model_dir, sources, cfg, out_dir, *, name, timing_path, **kw):
        late[name] = cfg.start_late
        out_dir.mkdir(parents=True)
        (out_dir / "train_log.jsonl").write_text('{"iteration": 1, "reward": 0.5}\n')
        times = seconds[name]
        write_json(timing_path, {"iterations": [{"iteration": i + 1, "seconds": t} for i, t in enumerate(times)],
                                 "total_seconds": sum(times), "seconds_per_iteration": sum(times) / len(times)})
        return AdapterManifest(capability_id=name, path=str(out_dir), base_model="tiny", env_sha256="", backend="trl",
                               rollouts_used=planned_rollouts(cfg), iterations=len(times))

    calibration = {"ok": True, "difficulty": 0, "start_late": 1.0}  # the capability trains where it was calibrated
    monkeypatch.setattr(stage, "valid_envs", lambda root: [SimpleNamespace(
        capability_id="cap", path="envs/cap", sha256="0", calibration=calibration, difficulty={"value": 0})])
    monkeypatch.setattr(stage, "SandboxProcess", Box)
    monkeypatch.setattr(plan, "trace_budget", lambda root, names, split: {"total": 6 + 4 * len(names)})
    monkeypatch.setattr(plan, "target_source", lambda env, split, root: None)
    monkeypatch.setattr(plan, "train_adapter_mixture", fake_train)
    metrics = stage.run_train(params, tmp_path)

    assert metrics == read_json(tmp_path / "reports/metrics/train.json")
    rollouts = {name: row["rollouts"] for name, row in metrics["adapters"].items()}
    assert rollouts == {"cap": 4, "grpo_target": 10}  # the baseline at TRACE's budget (6 + 4)
    for name, row in metrics["timing"].items():
        assert row["total_seconds"] == sum(seconds[name])
        assert row["seconds_per_rollout"] == row["total_seconds"] / rollouts[name]
    assert metrics["timing"]["cap"]["seconds_per_rollout"] == 7.5 / 4
    assert late == {"cap": 1.0, "grpo_target": params.train.start_late}
    data = [p.read_text() for p in (tmp_path / "data").rglob("*") if p.is_file() and "logs" not in p.parts]
    assert data and not any("seconds" in text for text in data)  # wall times: metrics and data/logs only
    assert plan.per_rollout({"total_seconds": 5.0}, 0)["seconds_per_rollout"] is None  # nothing spent


def test_the_train_stage_with_no_environment_writes_its_outputs_empty(tmp_path):
    """No capability kept (e.g. a base model that never succeeds): nothing trains, and every DVC output of the
    stage still exists, so the pipeline goes on and says why."""
    from trace_lib.config import params_from_dict
    from trace_lib.io import read_json, write_jsonl
    from trace_lib.stages import train as stage

    write_jsonl(tmp_path / "data/envs/manifests.jsonl", [])
    metrics = stage.run_train(params_from_dict({}), tmp_path)
    assert metrics["adapters"] == {} and metrics["note"] == "no validated environments: no adapters trained"
    assert (tmp_path / "data/train").is_dir() and (tmp_path / "data/adapters/manifests.jsonl").read_text() == ""
    assert read_json(tmp_path / "reports/metrics/train.json") == metrics


def test_the_baselines_get_tracess_discovery_and_calibration_even_when_no_environment_survived(tmp_path, monkeypatch):
    """Every environment dropped by calibration: TRACE trained nothing but spent its discovery and calibration
    rollouts, and GRPO on the target gets exactly those (a whole number of iterations of them)."""
    from trace_lib.config import params_from_dict
    from trace_lib.io import write_json
    from trace_lib.records import AdapterManifest
    from trace_lib.stages import train as stage
    from trace_lib.training import plan
    from trace_lib.training.trainer import planned_rollouts

    params = params_from_dict({"train": {"groups": 1, "group_size": 2, "reference_samples": 0, "baselines": ["grpo_target", "grpo_target_late"],
                                         "distill": {"iterations": 0}, "lockstep": False}})
    budgets = {}

    def fake_train(model_dir, sources, cfg, out_dir, *, name, timing_path, **kw):
        budgets[name] = (cfg.rollout_budget, planned_rollouts(cfg), cfg.start_late)
        out_dir.mkdir(parents=True)
        (out_dir / "train_log.jsonl").write_text('{"iteration": 1, "reward": 0.0}\n')
        write_json(timing_path, {"iterations": [], "total_seconds": 1.0, "seconds_per_iteration": 1.0})
        return AdapterManifest(capability_id=name, path=str(out_dir), base_model="tiny", env_sha256="", backend="trl",
                               rollouts_used=planned_rollouts(cfg), iterations=cfg.iterations)

    monkeypatch.setattr(stage, "valid_envs", lambda root: [])
    monkeypatch.setattr(plan, "trace_budget", lambda root, names, split: {"total": 48 + 96 + 3})
    monkeypatch.setattr(plan, "target_source", lambda env, split, root: None)
    monkeypatch.setattr(plan, "train_adapter_mixture", fake_train)
    metrics = stage.run_train(params, tmp_path)
    assert budgets == {"grpo_target": (147, 146, params.train.start_late), "grpo_target_late": (147, 146, 1.0)}
    assert metrics["trace_budget"] == 147 and metrics["baselines_skipped"] == {}
