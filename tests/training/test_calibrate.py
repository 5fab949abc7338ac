"""Calibration: the ladder of settings, the band judgement, and a whole calibration with a scripted policy."""

from __future__ import annotations

import pytest
from scripted_tokens import ScriptedPolicy
from tiny_training import FAST, kv_tasks
from toy import KVEnv, kv_task

from trace_lib.config import CalibrationConfig, TrainConfig
from trace_lib.records import Trajectory
from trace_lib.training.calibrate import (CALIBRATION_SEED0, Setting, calibrate, judge, ladder, next_rung, tasks_behind,
                                          transfer_check)
from trace_lib.training.grpo import TrainSource
from trace_lib.training.hints import reference_steps
from trace_lib.training.trainer import load_trainable


def test_the_ladder_runs_easiest_first_and_each_step_moves_toward_the_band():
    rungs = ladder(0, 2)
    assert rungs[:3] == [Setting(0, True), Setting(0, False), Setting(1, True)] and rungs[-1] == Setting(2, False)
    assert [s.start for s in ladder(1, 1)] == ["reads played", "opening"]
    cfg = CalibrationConfig(success_lo=0.1, success_hi=0.6)  # the band's middle: 0.35
    at = Setting(1, False)
    assert next_rung(rungs, {at: {"success": 0.0}}, at, cfg) == Setting(1, True)  # too hard: play the reads
    assert next_rung(rungs, {at: {"success": 0.9}}, at, cfg) == Setting(2, True)  # too easy: the next difficulty
    assert next_rung(rungs, {at: {"success": 0.9}, Setting(2, True): {"success": 0.0}}, at, cfg) is None
    assert next_rung(rungs, {rungs[0]: {"success": 0.0}}, rungs[0], cfg) is None  # nothing easier
    assert next_rung(rungs, {rungs[-1]: {"success": 1.0}}, rungs[-1], cfg) is None  # nothing harder


def test_judge_needs_the_rate_in_band_and_enough_mixed_groups():
    cfg = CalibrationConfig(success_lo=0.1, success_hi=0.6, min_mixed=0.4)
    assert judge([[True, False], [False, False], [True, False]], cfg) == {
        "success": round(2 / 6, 4), "mixed_groups": round(2 / 3, 4), "in_band": True}
    assert not judge([[True, True], [False, False], [False, False]], cfg)["in_band"]  # 1/3 but no mixed group
    assert not judge([[True, False], [True, True], [True, True]], cfg)["in_band"]  # 5/6 too easy
    assert not judge([], cfg)["in_band"]
    with pytest.raises(ValueError, match="success_lo"):
        CalibrationConfig(success_lo=0.7, success_hi=0.6)


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    policy, _ = load_trainable(tiny_model_dir, TrainConfig(), "trl", seed=0)
    return ScriptedPolicy(policy.model, policy.tokenizer, "tiny")


def _source_at(asked: list[int]):
    def source_at(difficulty: int) -> TrainSource:
        asked.append(difficulty)
        return TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks, reference=reference_steps)
    return source_at


def test_a_setting_in_band_is_kept_with_its_rollouts(scripted):
    asked: list[int] = []
    train = TrainConfig(**FAST, start_late=0.25)
    out = calibrate(scripted, _source_at(asked), CalibrationConfig(seeds=3, samples=2, success_lo=0.0,
                                                                   success_hi=1.0, min_mixed=0.0), train, 1, seed=0)
    assert (out["ok"], out["difficulty"], out["start_late"], out["rollouts"], asked) == (True, 1, 0.25, 6, [1])
    (attempt,) = out["attempts"]
    assert attempt["start"] == "opening" and 0 < attempt["success"] < 1 and attempt["in_band"]


def test_no_setting_in_band_is_a_reason_listing_every_attempt(scripted):
    asked: list[int] = []
    cfg = CalibrationConfig(seeds=3, samples=2, success_lo=0.99, success_hi=1.0, max_attempts=3)
    out = calibrate(scripted, _source_at(asked), cfg, TrainConfig(**FAST), 1, seed=0)
    assert not out["ok"] and out["difficulty"] is None and out["rollouts"] == 18 and asked == [1, 1, 0]
    assert [(a["difficulty"], a["start"]) for a in out["attempts"]] == [(1, "opening"), (1, "reads played"),
                                                                       (0, "opening")]
    # a band no success rate reaches from below: the walk goes up to the generator's hardest setting, then stops
    asked.clear()
    cfg = CalibrationConfig(seeds=3, samples=2, success_lo=0.0, success_hi=0.0, min_mixed=0.0, max_attempts=9)
    out = calibrate(scripted, _source_at(asked), cfg, TrainConfig(**FAST), 1, seed=0, difficulties=(0, 2))
    assert not out["ok"] and asked == [1, 2, 2] and out["attempts"][0]["success"] > 0
    assert [(a["difficulty"], a["start"]) for a in out["attempts"]] == [(1, "opening"), (2, "reads played"),
                                                                       (2, "opening")]
    assert out["reason"].startswith("no setting in band") and out["reason"].count("difficulty") == 3
    assert [a["rollouts"] for a in out["attempts"]] == [6, 6, 6] and not any(a["in_band"] for a in out["attempts"])
    assert CALIBRATION_SEED0 > TrainConfig().seed_offset


def _episode(traj_id: str, task_id: str, success: bool) -> Trajectory:
    return Trajectory(id=traj_id, task_id=task_id, env="toy", family=task_id.split("/")[1], split="train",
                      policy_id="tiny", seed=0, messages=[], reward=float(success), success=success,
                      termination="agent_stop", tool_calls=0, invalid_actions=0, tool_errors=0, turns=0,
                      prompt_tokens=0, completion_tokens=0)


def test_the_tasks_behind_a_capability_are_its_evidence_failures_taken_in_turn_from_each_family():
    tasks = [kv_task(i, "read") for i in range(3)] + [kv_task(i, "write") for i in range(2)] + [kv_task(9, "other")]
    evidence = [_episode("e0", "toy/read/2", False), _episode("e1", "toy/read/0", False),
                _episode("e2", "toy/write/1", False), _episode("e3", "toy/read/1", True),  # solved: not behind it
                _episode("e4", "toy/read/0", False), _episode("e5", "toy/other/9", False)]  # e5 cited by no one
    cited = ["e0", "e1", "e2", "e3", "e4"]
    assert [t.id for t in tasks_behind(evidence, cited, tasks, 9)] == ["toy/read/0", "toy/write/1", "toy/read/2"]
    assert [t.id for t in tasks_behind(evidence, cited, tasks, 2)] == ["toy/read/0", "toy/write/1"]
    assert tasks_behind(evidence, cited, tasks, 0) == [] and tasks_behind([], cited, tasks, 4) == []


def test_the_transfer_check_plays_each_task_behind_it_and_counts_per_family(scripted):
    tasks = [kv_task(1, "read"), kv_task(2, "read"), kv_task(3, "write")]
    source = TrainSource("target", lambda: KVEnv(max_steps=3), kv_tasks, reference=reference_steps)
    out = transfer_check(scripted, source, tasks, False, CalibrationConfig(samples=2), TrainConfig(**FAST), seed=0)
    assert (out["start"], out["tasks"], out["rollouts"]) == ("opening", [t.id for t in tasks], 6)
    assert sorted(out["by_family"]) == ["read", "write"] and out["by_family"]["read"].endswith("/4")
    assert out["successes"] == sum(int(kn.split("/")[0]) for kn in out["by_family"].values())
    assert out["success"] == round(out["successes"] / 6, 4) and 0 <= out["mixed_groups"] <= 1
    late = transfer_check(scripted, source, tasks, True, CalibrationConfig(samples=2), TrainConfig(**FAST), seed=0)
    assert late["start"] == "reads played" and late["rollouts"] == 6


def test_with_reference_samples_the_band_has_only_its_upper_edge():
    cfg = CalibrationConfig(success_lo=0.1, success_hi=0.6, min_mixed=0.4)
    assert judge([[False, False], [False, False]], cfg, references=True)["in_band"]  # the references bring successes
    assert not judge([[False, False], [False, False]], cfg)["in_band"]
    assert not judge([[True, True], [True, False]], cfg, references=True)["in_band"]  # the base solves it already


def test_with_reference_samples_a_setting_fits_when_every_seed_s_reference_earns_full_reward(scripted):
    cfg = CalibrationConfig(seeds=3, samples=2, success_lo=0.9, success_hi=1.0, min_mixed=1.0)
    train = TrainConfig(**FAST, reference_samples=1)
    out = calibrate(scripted, _source_at([]), cfg, train, 1, seed=0)
    assert out["ok"] and out["rollouts"] == 6  # references are played, not sampled: no rollouts
    assert out["attempts"][0]["references_full"] == 3

    def wrong(task):  # a reference that reads but never answers
        return reference_steps(task)[:1]

    def broken_at(difficulty: int) -> TrainSource:
        return TrainSource("kv", lambda: KVEnv(max_steps=3), kv_tasks, reference=wrong)
    out = calibrate(scripted, broken_at, cfg.model_copy(update={"max_attempts": 1}), train, 1, seed=0)
    assert not out["ok"] and out["attempts"][0]["references_full"] == 0
    assert "every reference of full reward" in out["reason"] and "references of full reward 0/3" in out["reason"]
