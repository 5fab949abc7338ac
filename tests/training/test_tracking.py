"""A training's curves as DVCLive files (`training/tracking.py`): TRL's metric names, one row per iteration, the
summary, the episode table, the rows read back, a restart from a checkpoint's rows, and `train.report_to`."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
from tiny_training import log_row

from trace_lib.config import TrainConfig
from trace_lib.records import Message, ToolCall
from trace_lib.training.tracking import (
    LiveCurves,
    episode_rows,
    keep_only,
    live_metrics,
    read_curves,
    read_episodes,
    read_rows,
    sampled_success,
)


def tsv(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def curves(tmp_path, name="cap", **kw) -> LiveCurves:
    return LiveCurves(tmp_path / "reports/train" / name, tmp_path / "reports/metrics/train" / f"{name}.json",
                      tmp_path / "reports/tables/train_episodes" / f"{name}.tsv", **kw)


def episode(seed: int, reward: float, said: Message, reference: bool = False) -> SimpleNamespace:
    return SimpleNamespace(source="cap", seed=seed, sample=0, reference=reference, reward=reward, success=reward == 1.0,
                           env=SimpleNamespace(state=SimpleNamespace(tool_calls=2)),
                           context=[Message(role="user", content="hi"), said, Message(role="user", content="ok")])


def test_metrics_take_trls_names_and_leave_out_what_was_not_logged():
    got = live_metrics(log_row(2, 0.25, kl=0.0123))
    assert got["reward"] == 0.25 and got["reward_std"] == 0.46291 and got["frac_reward_zero_std"] == 0.5
    assert got["completions/mean_length"] == 175.5 and got["clip_ratio/region_mean"] == 0.0 and got["kl"] == 0.0123
    assert got["loss"] == -0.068 and got["grad_norm"] == 0.38 and got["rollouts"] == 16
    assert "completion_length" not in got and "iteration" not in got
    assert "l_t" not in got and "kl" not in live_metrics(log_row(1, 0.5))  # beta = 0, efficiency off: not invented
    assert got["frac_groups_mixed"] == 0.5 and got["success_sampled"] == 0.25
    assert not any(name.startswith("time/") for name in got)  # wall times only when given
    timed = live_metrics(log_row(2, 0.25), {"iteration": 2, "seconds": 12.34567, "rollout_seconds": 9.5}, 8)
    assert (timed["time/seconds_per_iteration"], timed["time/seconds_per_rollout"], timed["time/sampling_seconds"]) \
        == (12.346, 1.5432, 9.5)


def test_on_policy_success_leaves_out_the_reference_samples_and_the_guided_episodes():
    assert sampled_success(log_row(1, 0.5)) == 0.5
    assert sampled_success(log_row(1, 0.5, hinted=4, success_rate_unhinted=0.25)) == 0.25
    assert sampled_success(log_row(1, 0.3, references=16, success_rate_on_policy=0.05)) == 0.05
    assert live_metrics(log_row(1, 0.3, references=16, success_rate_on_policy=0.05))["success_sampled"] == 0.05


def test_the_files_hold_one_row_per_iteration_and_give_the_rows_back(tmp_path):
    rows = [log_row(1, 0.0, env_score=0.25, rubric={"orders_read": 0.5, "facts_said": 0.0}),
            log_row(2, 0.5, kl=0.01, l_t=3, rubric={"orders_read": 1.0, "facts_said": 0.5}, references=2,
                    success_rate_on_policy=0.25)]
    timings = [{"iteration": 1, "seconds": 3.0}, {"iteration": 2, "seconds": 4.0}]
    live = curves(tmp_path)
    live.start([], [], [])
    for row, timing in zip(rows, timings, strict=True):
        live.log(row, timing, [])
    live.end()
    folder = tmp_path / "reports/train/cap/plots/metrics"
    assert tsv(folder / "reward.tsv") == [{"step": "1", "reward": "0.0"}, {"step": "2", "reward": "0.5"}]
    assert tsv(folder / "rubric/facts_said.tsv")[1] == {"step": "2", "facts_said": "0.5"}
    assert tsv(folder / "kl.tsv") == [{"step": "2", "kl": "0.01"}]  # logged where TRL computed it
    assert tsv(folder / "completions/mean_length.tsv")[0] == {"step": "1", "mean_length": "175.5"}
    assert [r["seconds_per_rollout"] for r in tsv(folder / "time/seconds_per_rollout.tsv")] == ["0.375", "0.5"]
    summary = json.loads((tmp_path / "reports/metrics/train/cap.json").read_text())
    assert summary["step"] == 2 and summary["reward"] == 0.5 and summary["rubric"] == {"orders_read": 1.0,
                                                                                       "facts_said": 0.5}
    assert read_rows(tmp_path / "reports/train/cap") == rows  # what the figures read is what was logged
    assert read_curves(tmp_path / "reports/train") == {"cap": rows} and read_curves(tmp_path / "nothing") == {}


def test_the_episode_table_shows_the_agents_last_message_a_few_per_iteration(tmp_path):
    call = Message(role="assistant", tool_calls=[ToolCall(name="get_value", arguments={"key": "k1"})])
    said = Message(role="assistant", content="The value\tis\n10." + " x" * 300)
    episodes = [episode(1001, 0.0, call), episode(1001, 1.0, said), episode(1002, 0.0, call, reference=True),
                episode(1002, 0.0, call)]
    rows = episode_rows(3, episodes, cap=2)
    assert [(r["seed"], r["reward"], r["reference"]) for r in rows] == [(1001, 0.0, 0), (1002, 0.0, 1)]
    assert rows[0]["last_message"] == "get_value(key='k1')" and rows[0]["tool_calls"] == 2
    assert len(episode_rows(3, episodes, cap=8)) == 4 and episode_rows(3, episodes, cap=0) == []
    long = episode_rows(1, [episodes[1]], cap=1)[0]["last_message"]
    assert long.startswith("The value is 10. x") and len(long) == 240  # one line, cut
    live = curves(tmp_path, episodes=2)
    live.start([], [], [])
    live.log(log_row(1, 0.25), None, episodes)
    live.log(log_row(2, 0.5), None, episodes[1:])
    table = read_episodes(tmp_path / "reports/tables/train_episodes/cap.tsv")
    assert [(r["step"], r["seed"], r["success"]) for r in table] == [(1, 1001, 0), (1, 1002, 0), (2, 1001, 1),
                                                                      (2, 1002, 0)]


def test_a_restart_from_a_checkpoint_replaces_the_later_steps_instead_of_logging_them_twice(tmp_path):
    rows = [log_row(i, i / 4) for i in range(1, 5)]
    first = curves(tmp_path, episodes=1)
    first.start([], [], [])
    for row in rows[:3]:  # killed during iteration 4, after iteration 3 was logged; the checkpoint is iteration 2
        first.log(row, {"iteration": row["iteration"], "seconds": 1.0}, [episode(row["iteration"], 0.0, Message(
            role="assistant", content="hm"))])
    kept = first.episode_rows[:2]
    again = curves(tmp_path, episodes=1)
    again.start(rows[:2], [{"iteration": 1, "seconds": 1.0}, {"iteration": 2, "seconds": 1.0}], kept)
    assert [r["step"] for r in tsv(tmp_path / "reports/train/cap/plots/metrics/reward.tsv")] == ["1", "2"]
    for row in rows[2:]:
        again.log(row, None, [])
    again.end()
    assert [r["step"] for r in tsv(tmp_path / "reports/train/cap/plots/metrics/reward.tsv")] == ["1", "2", "3", "4"]
    assert read_rows(tmp_path / "reports/train/cap") == rows
    assert [r["step"] for r in read_episodes(tmp_path / "reports/tables/train_episodes/cap.tsv")] == [1, 2]
    assert json.loads((tmp_path / "reports/metrics/train/cap.json").read_text())["step"] == 4


def test_not_live_the_same_files_are_written_once_the_training_is_done(tmp_path):
    rows = [log_row(1, 0.25), log_row(2, 0.5, rubric={"a": 1.0})]
    live, later = curves(tmp_path / "live"), curves(tmp_path / "later", live=False)
    for c in (live, later):
        c.start([], [], [])
        for row in rows:
            c.log(row, {"iteration": row["iteration"], "seconds": 2.0}, [])
    assert not (tmp_path / "later/reports/train").exists()  # nothing while it trains
    live.end()
    later.end()
    files = {root: {p.relative_to(tmp_path / root): p.read_bytes() for p in sorted((tmp_path / root).rglob("*"))
                    if p.is_file()} for root in ("live", "later")}
    assert files["live"] == files["later"] and len(files["live"]) > 10


def test_keep_only_removes_what_an_earlier_run_left_for_other_adapters(tmp_path):
    for name in ("a", "old"):
        (tmp_path / "train" / name).mkdir(parents=True)
        (tmp_path / "summaries").mkdir(exist_ok=True)
        (tmp_path / "summaries" / f"{name}.json").write_text("{}")
    keep_only(tmp_path / "train", ["a", "b"])
    keep_only(tmp_path / "summaries", ["a", "b"], ".json")
    keep_only(tmp_path / "missing", ["a"])
    assert [p.name for p in (tmp_path / "train").iterdir()] == ["a"]
    assert [p.name for p in (tmp_path / "summaries").iterdir()] == ["a.json"]


def test_report_to_takes_a_name_a_list_or_none_and_refuses_a_tracker_that_is_not_installed(monkeypatch):
    import importlib.util

    assert TrainConfig().report_to == ["dvclive"]
    assert TrainConfig(report_to="none").report_to == [] and TrainConfig(report_to=[]).report_to == []
    assert TrainConfig(report_to="dvclive").report_to == ["dvclive"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"wandb is not installed.*pip install wandb"):
        TrainConfig(report_to=["dvclive", "wandb"])
    with pytest.raises(ValueError):
        TrainConfig(report_to=["tensorboard"])
