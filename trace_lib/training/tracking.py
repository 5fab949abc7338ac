"""A training's curves as DVCLive writes them, updated every iteration while it runs, and read back for the figures.

Per adapter `<name>` (the train stage's paths):

    reports/train/<name>/plots/metrics/<metric>.tsv   one row per iteration (`step`, value): what `dvc plots show`
                                                      draws, live while the stage runs
    reports/metrics/train/<name>.json                 the last iteration's values (`dvc metrics show`,
                                                      a column of `dvc exp show` per adapter)
    reports/tables/train_episodes/<name>.tsv          a few sampled episodes per iteration: task, reward, tool
                                                      calls, the agent's last message

The metrics are the train log's rows (`trainer.TraceCallback`) under TRL's names where TRL logs the same quantity
(`TRL_NAMES`), the rubric's items as `rubric/<item>`, plus `frac_groups_mixed` and `success_sampled`, and the wall
times under `time/` (the only files that differ between two runs of one seed). `read_curves` gives the rows back
(train-log keys, the derived and wall-time metrics left out), so figures and tables read what a watcher saw.
A resumed training rewrites the files from its checkpoint's rows first: no step is logged twice.
The keys of a train-log row (`LOG_KEYS`, `EXTRA_LOG_KEYS`, `TRL_KEYS`) are defined here, where they are named live
and read back; the trainer builds its rows from them.
"""

from __future__ import annotations

import csv
import io
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trace_lib.io import atomic_write_text

LOG_KEYS = ("reward", "reward_std", "success_rate", "frac_reward_zero_std", "tool_calls", "tool_calls_correct",
            "l_t", "completion_tokens", "completion_length", "trained_tokens", "hinted", "success_rate_unhinted",
            "success_rate_hinted", "env_score", "rubric", "preplayed_steps")
"""Rollout statistics in each train_log row (`trainer.TraceCallback`); TRL's loss, kl, entropy, grad_norm, clip ratio
follow."""
EXTRA_LOG_KEYS = ("distill_kl", "references", "reference_skipped", "success_rate_on_policy",
                  "frac_groups_mixed_by_reference")
"""Statistics only some trainings have. Distillation: `distill_kl`, the mean log π_student − log π_teacher of
the trained tokens before the step (the authors log its negative as `gap`): a sample of the reverse KL (the
student samples at temperature 1), which falls as the student matches its teachers; under grammar-constrained
sampling the tokens come from the masked distribution, so it can be negative. Reference samples
(`train.reference_samples`, `grpo.reference_stats`): their count, the references skipped, on-policy success without
them, and the share of groups only they made mixed."""
TRL_KEYS = {"loss": "loss", "kl": "kl", "entropy": "entropy", "grad_norm": "grad_norm",
            "clip_ratio": "clip_ratio/region_mean", "learning_rate": "learning_rate"}
"""Train-log key -> the key of TRL's logs it is taken from."""
TRL_NAMES = {"completion_length": "completions/mean_length", **{k: v for k, v in TRL_KEYS.items() if k != v}}
"""Train-log key -> the name TRL logs the same quantity under, where they differ (reward, reward_std,
frac_reward_zero_std, loss, kl, entropy, grad_norm and learning_rate are TRL's names already)."""
ALWAYS_KEYS = (*LOG_KEYS, *TRL_KEYS, "rollouts")
"""Keys every train-log row holds (None where it has no value, which logs nothing)."""
DERIVED = ("frac_groups_mixed", "success_sampled")
"""Metrics logged for watching that the rows do not hold: groups with mixed rewards (1 - frac_reward_zero_std),
and the success of the episodes the policy sampled on its own (`sampled_success`)."""
TIME = "time"
"""Folder of the wall-time metrics: seconds per iteration, per rollout, and spent sampling."""
RUBRIC = "rubric"
EPISODE_COLUMNS = ("step", "source", "seed", "sample", "reference", "reward", "success", "tool_calls", "last_message")
LAST_MESSAGE_CHARS = 240
"""The agent's last message is cut to this many characters in the episode table."""


def sampled_success(row: Mapping[str, Any]) -> float | None:
    """A log row's success rate over the rollouts the policy sampled without expert guidance (the hint swap's
    guided ones and the reference samples apart; all of them when both are off): what it does on its own."""
    if row.get("references"):
        return row.get("success_rate_on_policy")
    return row.get("success_rate_unhinted") if row.get("hinted") else row.get("success_rate")


def live_metrics(row: Mapping[str, Any], timing: Mapping[str, Any] | None = None,
                 rollouts_before: int = 0) -> dict[str, float]:
    """One train-log row as {metric name: value}: TRL's names, `rubric/<item>`, the derived metrics and, given the
    iteration's `timing` row (`seconds`, `rollout_seconds`), `time/...`; keys without a value are left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "iteration" or value is None:
            continue
        if key == RUBRIC:
            out.update({f"{RUBRIC}/{item}": v for item, v in value.items() if v is not None})
        else:
            out[TRL_NAMES.get(key, key)] = value
    if row.get("frac_reward_zero_std") is not None:
        out["frac_groups_mixed"] = round(1.0 - row["frac_reward_zero_std"], 6) + 0.0
    if (sampled := sampled_success(row)) is not None:
        out["success_sampled"] = sampled
    if timing:
        spent = (row.get("rollouts") or 0) - rollouts_before
        out[f"{TIME}/seconds_per_iteration"] = round(timing["seconds"], 3)
        if spent > 0:
            out[f"{TIME}/seconds_per_rollout"] = round(timing["seconds"] / spent, 4)
        if timing.get("rollout_seconds") is not None:
            out[f"{TIME}/sampling_seconds"] = round(timing["rollout_seconds"], 3)
    return out


def row_from_metrics(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The train-log row of one step back from its logged metrics (the inverse of `live_metrics`)."""
    back = {live: key for key, live in TRL_NAMES.items()}
    row: dict[str, Any] = {"iteration": step, **dict.fromkeys(ALWAYS_KEYS)}
    rubric: dict[str, Any] = {}
    for name, value in metrics.items():
        if name in DERIVED or name.startswith(f"{TIME}/"):
            continue
        if name.startswith(f"{RUBRIC}/"):
            rubric[name.split("/", 1)[1]] = value
        else:
            row[back.get(name, name)] = value
    row[RUBRIC] = rubric or None
    return row


def episode_rows(step: int, episodes: Sequence[Any], cap: int) -> list[dict[str, Any]]:
    """The episode table's rows of one iteration: its first `cap` episodes (one or two per group in the order
    played: `cap` spread over the groups), each with its task, reward and the agent's last message."""
    if cap <= 0 or not episodes:
        return []
    stride = max(1, math.ceil(len(episodes) / cap))
    rows = []
    for ep in list(episodes)[::stride][:cap]:
        said = next((m for m in reversed(ep.context) if m.role == "assistant"), None)
        text = ""
        if said is not None:
            calls = [f"{c.name}({_compact(c.arguments)})" for c in said.tool_calls or []]
            text = " ".join([said.content or "", *calls]).strip()
        rows.append({"step": step, "source": ep.source, "seed": ep.seed, "sample": ep.sample,
                     "reference": int(ep.reference), "reward": round(float(ep.reward), 6) + 0.0,
                     "success": int(ep.success), "tool_calls": ep.env.state.tool_calls,
                     "last_message": " ".join(text.split())[:LAST_MESSAGE_CHARS]})
    return rows


def _compact(arguments: Any) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in arguments.items()) if isinstance(arguments, dict) else str(arguments)


def episodes_tsv(rows: Sequence[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, EPISODE_COLUMNS, delimiter="\t", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


class LiveCurves:
    """One training's DVCLive files (module docstring). `live`: update them every iteration (`train.report_to`
    holds 'dvclive'); else write them once, at `end`. `episodes` rows of sampled episodes per iteration."""

    def __init__(self, plots_dir: Path, summary: Path, episodes_table: Path, *, live: bool = True,
                 episodes: int = 8) -> None:
        self.plots_dir, self.summary, self.episodes_table = Path(plots_dir), Path(summary), Path(episodes_table)
        self.live, self.episodes = live, episodes
        self.rows: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
        self.episode_rows: list[dict[str, Any]] = []
        self._writer: Any = None

    def start(self, rows: Sequence[Mapping[str, Any]], timings: Sequence[Mapping[str, Any]],
              episode_rows: Sequence[Mapping[str, Any]]) -> None:
        """Begin (again) from the rows a checkpoint holds: whatever the files held is replaced by them."""
        by_step = {t["iteration"]: t for t in timings}
        self.rows = [(dict(r), by_step.get(r["iteration"])) for r in rows]
        self.episode_rows = [dict(e) for e in episode_rows]
        if self.live:
            self._rewrite()

    def log(self, row: Mapping[str, Any], timing: Mapping[str, Any] | None, episodes: Sequence[Any]) -> None:
        """One finished iteration: its train-log row, its timing row and the episodes it played."""
        self.rows.append((dict(row), dict(timing) if timing else None))
        self.episode_rows += episode_rows(row["iteration"], episodes, self.episodes)
        if self.live:
            before = (self.rows[-2][0].get("rollouts") or 0) if len(self.rows) > 1 else 0
            self._write_step(self.rows[-1], before)
            self._write_episodes()

    def end(self) -> None:
        """The training is done: the files hold every iteration (written now when not live)."""
        if not self.live:
            self._rewrite()
        self._writer = None

    def _rewrite(self) -> None:
        shutil.rmtree(self.plots_dir, ignore_errors=True)
        self.summary.unlink(missing_ok=True)
        self._writer = _dvclive_writer(self.plots_dir, self.summary)
        before = 0
        for row, timing in self.rows:
            self._write_step((row, timing), before)
            before = row.get("rollouts") or before
        if not self.rows:
            self._writer.make_summary()
        self._write_episodes()

    def _write_step(self, entry: tuple[dict[str, Any], dict[str, Any] | None], rollouts_before: int) -> None:
        if self._writer is None:
            self._writer = _dvclive_writer(self.plots_dir, self.summary)
        row, timing = entry
        self._writer.step = row["iteration"]
        for name, value in live_metrics(row, timing, rollouts_before).items():
            self._writer.log_metric(name, value)
        self._writer.make_summary()

    def _write_episodes(self) -> None:
        self.episodes_table.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.episodes_table, episodes_tsv(self.episode_rows))


def _dvclive_writer(plots_dir: Path, summary: Path) -> Any:
    """DVCLive's `Live` writing its metric files under `plots_dir/plots/metrics/` and its summary to `summary`.
    None of DVCLive's experiment bookkeeping or Studio posts: the train stage's dvc.yaml declares these files, and
    the stage runs inside `dvc repro` (or a notebook) where DVCLive would look for a git commit to attach an
    experiment to (and fails in a repository without one)."""
    from dvclive import Live

    class StageLive(Live):
        @property
        def metrics_file(self) -> str:
            return os.fspath(summary)

        def _init_dvc(self) -> None:
            return None

        def _init_studio(self) -> None:  # nothing is posted to DVC Studio: the files are the record
            return None

        def post_data_to_studio(self) -> None:
            return None

    Path(summary).parent.mkdir(parents=True, exist_ok=True)
    return StageLive(os.fspath(plots_dir), save_dvc_exp=False, dvcyaml=None, report=None)


def read_curves(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Adapter name -> its train-log rows, read from the metric files under `folder/<name>/plots/metrics/`
    (`LiveCurves`), adapters in name order; an adapter without files has none."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {d.name: read_rows(d) for d in sorted(folder.iterdir()) if d.is_dir()}


def read_rows(plots_dir: Path) -> list[dict[str, Any]]:
    """One adapter's train-log rows from its metric files, one per step, ascending."""
    metrics_dir = Path(plots_dir) / "plots" / "metrics"
    steps: dict[int, dict[str, Any]] = {}
    for tsv in sorted(metrics_dir.rglob("*.tsv")):
        name = tsv.relative_to(metrics_dir).with_suffix("").as_posix()
        with open(tsv, encoding="utf-8", newline="") as f:
            for rec in csv.DictReader(f, delimiter="\t"):
                steps.setdefault(int(rec["step"]), {})[name] = _number(rec[tsv.stem])
    return [row_from_metrics(step, steps[step]) for step in sorted(steps)]


def read_episodes(path: Path) -> list[dict[str, Any]]:
    """The rows of an episode table (`LiveCurves`), numbers as numbers."""
    if not Path(path).is_file():
        return []
    with open(path, encoding="utf-8", newline="") as f:
        return [{k: (v if k in ("source", "last_message") else _number(v)) for k, v in rec.items()}
                for rec in csv.DictReader(f, delimiter="\t")]


def _number(text: str) -> int | float | str:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def keep_only(folder: Path, names: Sequence[str], suffix: str = "") -> None:
    """Remove what `folder` holds for adapters not in `names` (left by an earlier run with other capabilities):
    sub-folders when `suffix` is empty, else files `<name><suffix>`."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for path in sorted(folder.iterdir()):
        stem = path.name.removesuffix(suffix) if suffix else path.name
        if (path.is_dir() if not suffix else path.name.endswith(suffix)) and stem not in names:
            shutil.rmtree(path) if path.is_dir() else path.unlink()

