"""Efficiency-aware trajectory reward: values, a threshold that only tightens, warm-up, resume."""

import pytest

from trace_lib.config import ConfigError, RewardConfig, params_from_dict
from trace_lib.training.rewards import EfficiencyReward, EnvReward, make_reward


def eff(**kw) -> EfficiencyReward:
    base = {"efficiency": True, "r_pos": 1.0, "r_neg": 0.0, "lam": 0.05, "warmup_threshold": 6,
            "warmup_epochs": 1, "max_tool_calls": 16}
    return EfficiencyReward(RewardConfig(**{**base, **kw}))


def test_reward_values():
    r = eff()
    assert r.reward(True, 3) == 1.0  # at or under l_t: no penalty
    assert r.reward(True, 6) == 1.0
    assert r.reward(True, 9) == pytest.approx(1.0 - 0.05 * 3)
    assert r.reward(False, 1) == 0.0
    assert r.score(0.0, False, 2) == 0.0 and r.score(1.0, True, 8) == pytest.approx(0.9)


def test_a_correct_trajectory_always_beats_a_wrong_one():
    r = eff(warmup_threshold=0)
    assert min(r.reward(True, n) for n in range(0, 100)) > r.reward(False, 0)  # calls past the cap count as the cap


def test_threshold_only_tightens_after_warmup():
    r = eff(warmup_epochs=1)
    row = r.end_epoch([2, 5])  # warm-up epoch: statistics ignored
    assert (r.threshold, row["l_t"], row["tool_calls_correct"]) == (6, 6, 3.5)
    r.end_epoch([4, 7])
    assert r.threshold == 4
    r.end_epoch([5, 9])  # fewer calls never seen again: l_t does not rise
    assert r.threshold == 4
    r.end_epoch([3])
    assert r.threshold == 3
    assert [h["l_t"] for h in r.history] == [6, 6, 4, 4]


def test_warmup_epochs_are_respected():
    r = eff(warmup_epochs=3)
    for _ in range(3):
        r.end_epoch([1])
    assert r.threshold == 6
    r.end_epoch([1])
    assert r.threshold == 1


def test_epoch_without_correct_trajectories_leaves_threshold():
    r = eff(warmup_epochs=0)
    row = r.end_epoch([])
    assert r.threshold == 6 and row["tool_calls_correct"] is None and row["correct"] == 0


def test_state_round_trip():
    r = eff(warmup_epochs=0)
    r.end_epoch([4])
    s = eff(warmup_epochs=0)
    s.load_state_dict(r.state_dict())
    assert (s.threshold, s.epochs, s.history) == (4, 1, r.history)
    s.end_epoch([2])
    assert s.threshold == 2 and r.threshold == 4  # independent copies


def test_config_rejects_a_wrong_trajectory_that_could_outscore_a_correct_one():
    with pytest.raises(ValueError, match="wrong trajectory can outscore"):
        RewardConfig(efficiency=True, r_pos=1.0, r_neg=0.3, lam=0.05, max_tool_calls=16)
    with pytest.raises(ConfigError, match="train.reward"):
        params_from_dict({"train": {"reward": {"efficiency": True, "r_neg": 0.5, "lam": 0.1}}})
    RewardConfig(efficiency=False, r_neg=0.5, lam=0.1)  # only checked when the reward is used


def test_without_efficiency_the_env_reward_is_used():
    r = make_reward(RewardConfig())
    assert isinstance(r, EnvReward) and r.threshold is None
    assert r.score(0.5, False, 3) == 0.25 and r.score(1.0, True, 3) == 1.0  # partial credit c = 0.5
    assert make_reward(RewardConfig(partial_credit=0)).score(0.5, False, 3) == 0.0
    assert r.end_epoch([2, 4])["tool_calls_correct"] == 3.0
    assert isinstance(make_reward(RewardConfig(efficiency=True)), EfficiencyReward)


def test_partial_credit_stays_below_every_success():
    """Multi-level rewards: a failure earns c·s of the way to the lowest correct reward, never past it."""
    r = eff(warmup_threshold=0, r_neg=-0.5, partial_credit=1.0)
    lowest_correct = min(r.reward(True, n) for n in range(0, 100))
    assert lowest_correct == pytest.approx(1.0 - 0.05 * 16)
    fails = [r.score(s, False, 1) for s in (0.0, 0.25, 0.5, 0.99)]
    assert fails[0] == -0.5 and fails == sorted(fails) and max(fails) < lowest_correct
    assert fails[2] == pytest.approx(-0.5 + 0.5 * (lowest_correct + 0.5))
    env = make_reward(RewardConfig(partial_credit=1.0))
    assert env.score(0.99, False, 1) < env.score(1.0, True, 1) == 1.0
    with pytest.raises(ConfigError, match="partial_credit"):
        params_from_dict({"train": {"reward": {"partial_credit": 1.5}}})
