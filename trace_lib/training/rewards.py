"""Training rewards: the environment's score, or the efficiency-aware trajectory reward.

Reads nothing and writes nothing; the GRPO trainer (training/trainer.py) calls it once per finished
episode and once per epoch. Implements the efficiency-aware trajectory reward, the second idea this
package carries next to TRACE (a reward option of the trainer, not a separate pipeline):

    R = R+ - λ·max(0, tool_calls - l_t)    for a correct trajectory
    R = R- + c·s·(R+ - λ·M - R-)           for a wrong one

where s in [0, 1) is the environment's partial score (multi-level rewards: a synthetic environment's
rubric, `trace_lib.synth.rubric`; 0 where the environment is all-or-nothing), c = `partial_credit`
and M = `max_tool_calls`, so a wrong trajectory earns a share of the way to the lowest correct reward
and never reaches it. Without the efficiency option R+ = 1, R- = 0 and λ = 0.

and, at the end of every epoch after W warm-up epochs, l_t ← min(l_t, fewest tool calls among that
epoch's correct trajectories), so the threshold never rises. In the trainer an epoch is one GRPO
iteration (its G×K rollouts). `RewardConfig` (config.py) already rejects parameters under which a
wrong trajectory could outscore a correct one (R- >= R+ - λ·max_tool_calls); the penalty counts at
most `max_tool_calls` calls so that guarantee holds even for an env that allows more.
"""

from __future__ import annotations

from typing import Any

from trace_lib.config import RewardConfig


class EfficiencyReward:
    """R+ − λ·max(0, calls − l_t) for a correct trajectory, R− for a wrong one; l_t only tightens."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.threshold: int = cfg.warmup_threshold
        """l_t: tool calls a correct trajectory may make without penalty."""
        self.epochs: int = 0
        """Epochs ended so far."""
        self.history: list[dict[str, Any]] = []
        """Per epoch: l_t used, l_t after the update, correct trajectories and their mean tool calls."""

    def reward(self, success: bool, tool_calls: int, partial: float = 0.0) -> float:
        """R for a correct trajectory with `tool_calls` calls, or a wrong one with partial score `partial`."""
        if not success:
            lowest_correct = self.cfg.r_pos - self.cfg.lam * self.cfg.max_tool_calls
            return failure_reward(partial, self.cfg.partial_credit, self.cfg.r_neg, lowest_correct)
        excess = max(0, min(tool_calls, self.cfg.max_tool_calls) - self.threshold)
        return self.cfg.r_pos - self.cfg.lam * excess

    def score(self, env_reward: float, success: bool, tool_calls: int) -> float:
        """The training reward of a finished episode (the env's score decides success and partial credit)."""
        return self.reward(success, tool_calls, env_reward)

    def end_epoch(self, correct_tool_calls: list[int]) -> dict[str, Any]:
        """Close an epoch; after W warm-up epochs, tighten l_t to the fewest calls of a correct run.

        Returns the epoch's log row (also appended to `history`).
        """
        self.epochs += 1
        used = self.threshold
        if self.epochs > self.cfg.warmup_epochs and correct_tool_calls:
            self.threshold = min(self.threshold, min(correct_tool_calls))
        row = {
            "epoch": self.epochs,
            "l_t": used,
            "l_t_next": self.threshold,
            "correct": len(correct_tool_calls),
            "tool_calls_correct": (sum(correct_tool_calls) / len(correct_tool_calls)) if correct_tool_calls else None,
        }
        self.history.append(row)
        return row

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "epochs": self.epochs, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.threshold = int(state["threshold"])
        self.epochs = int(state["epochs"])
        self.history = list(state.get("history", []))


def failure_reward(partial: float, credit: float, r_neg: float, lowest_correct: float) -> float:
    """R- + c·s·(lowest correct reward - R-) for partial score s and credit c: stays below every success."""
    s = min(max(float(partial), 0.0), 1.0)
    return r_neg + credit * s * (lowest_correct - r_neg)


class EnvReward:
    """The environment's score: 1 for a success, c·s for a failure with partial score s (multi-level
    rewards; `RewardConfig.partial_credit`), with EfficiencyReward's bookkeeping (l_t stays None)."""

    threshold = None

    def __init__(self, cfg: RewardConfig | None = None) -> None:
        self.credit = (cfg or RewardConfig()).partial_credit
        self.epochs = 0
        self.history: list[dict[str, Any]] = []

    def score(self, env_reward: float, success: bool, tool_calls: int) -> float:
        return 1.0 if success else failure_reward(env_reward, self.credit, 0.0, 1.0)

    def end_epoch(self, correct_tool_calls: list[int]) -> dict[str, Any]:
        self.epochs += 1
        calls = correct_tool_calls
        row = {"epoch": self.epochs, "l_t": None, "l_t_next": None, "correct": len(calls),
               "tool_calls_correct": (sum(calls) / len(calls)) if calls else None}
        self.history.append(row)
        return row

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": self.epochs, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epochs = int(state["epochs"])
        self.history = list(state.get("history", []))


def make_reward(cfg: RewardConfig) -> EfficiencyReward | EnvReward:
    """The trainer's reward: efficiency-aware when `cfg.efficiency`, else the environment's reward."""
    return EfficiencyReward(cfg) if cfg.efficiency else EnvReward(cfg)
