"""Table 1 across environments: this run's block beside those of other runs of the pipeline on other environments.

Reads each run's reports/tables/table1.csv and reports/metrics/evaluate.json (`env_block`); writes nothing (the
report stage writes `environments_markdown` to reports/tables/environments.md). A block that cannot be read says
why, so a missing run is named, never silently dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from trace_lib.evaluation.tables import EMPTY, TABLE1_COLUMNS, markdown, success_interval
from trace_lib.paths import Paths


@dataclass(frozen=True)
class EnvBlock:
    """One environment's Table 1 (a run's table1.csv, as `table1_long` wrote it) and where it came from."""

    env: str
    source: str
    """'this run', or the root folder of the other run."""
    rows: pd.DataFrame | None
    """None when that run has no Table 1 (`reason` says why)."""
    graded: bool = False
    """Whether the environment's reward is graded (its block then shows the mean reward too)."""
    reason: str = ""
    detail: str = ""
    """What the run evaluated ('test split, 32 tasks')."""


def _number(v: Any) -> float | None:
    """A CSV cell as a finite number, or None (empty, NaN or not a number)."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) or math.isinf(x) else x


def env_block_cells(block: EnvBlock, key: str) -> tuple[str, str, str]:
    """(rate cell, mean-reward cell, rollouts) of method `key` in one environment's block."""
    if block.rows is None:
        return "no run", "no run", EMPTY
    found = block.rows[(block.rows["key"].astype(str) == key) & (block.rows["column"] == "overall")]
    if found.empty:
        return "not in that run", EMPTY, EMPTY
    r = found.iloc[0]
    rollouts = EMPTY if _number(r["rollouts"]) is None else str(round(_number(r["rollouts"])))
    n = _number(r["n"])
    if r["status"] != "run" or not n:
        return "not run", "not run", rollouts
    k, rate, lo, hi = (_number(r[c]) for c in ("successes", "success_rate", "ci_low", "ci_high"))
    w_lo, w_hi = (_number(r.get(c)) for c in ("wilson_low", "wilson_high"))
    if None in (k, rate, lo, hi):
        return "unreadable", EMPTY, rollouts
    lo, hi = success_interval({"ci_low": lo, "ci_high": hi, "wilson_low": w_lo, "wilson_high": w_hi})
    cell = f"{100 * rate:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] ({round(k)}/{round(n)})"
    mean, rlo, rhi = (_number(r.get(c)) for c in ("mean_reward", "reward_ci_low", "reward_ci_high"))
    reward = EMPTY if None in (mean, rlo, rhi) else f"{mean:.3f} [{rlo:.3f}, {rhi:.3f}]"
    return cell, reward, rollouts


def method_label_across(by_env: Mapping[str, str]) -> str:
    """One row label for a method whose label may differ between environments (the best single adapter
    is chosen per run): the shared label, or the shared head with each environment's own detail,
    'single-capability (best: retail a; phone b)'."""
    distinct = list(dict.fromkeys(by_env.values()))
    if len(distinct) == 1:
        return distinct[0]
    heads = {label.split(" (", 1)[0] for label in distinct}
    if len(heads) == 1 and all(label.endswith(")") and " (" in label for label in distinct):
        head = heads.pop()
        details = [label.split(" (", 1)[1][:-1] for label in by_env.values()]
        keys = {d.split(": ", 1)[0] for d in details if ": " in d}
        if len(keys) == 1 and all(": " in d for d in details):  # 'best: a' and 'best: b' -> 'best: retail a; ...'
            key = keys.pop()
            return f"{head} ({key}: " + "; ".join(f"{env} {d.split(': ', 1)[1]}" for env, d in
                                                   zip(by_env, details)) + ")"
        return f"{head} (" + "; ".join(f"{env}: {d}" for env, d in zip(by_env, details)) + ")"
    return "; ".join(f"{env}: {label}" for env, label in by_env.items())


def environments_table(blocks: Sequence[EnvBlock]) -> pd.DataFrame:
    """The paper's Table 1 across environments: one row per method (in the first block's order, then any
    method only a later block has), per environment its overall success % with the 95% CI and k/n
    ('perfect' on a graded environment, whose mean reward follows), and the rollouts behind it."""
    labels: dict[str, dict[str, str]] = {}  # key -> {env: that block's label}
    for block in blocks:
        if block.rows is not None:
            for key, label in zip(block.rows["key"], block.rows["method"]):
                if isinstance(key, str) and key:
                    labels.setdefault(key, {}).setdefault(block.env, str(label))
    methods = {key: method_label_across(by_env) for key, by_env in labels.items()}
    columns = ["method"]
    for block in blocks:
        columns.append(f"{block.env}: {'perfect' if block.graded else 'success'} % [95% CI] (k/n)")
        if block.graded:
            columns.append(f"{block.env}: mean reward [95% CI]")
        columns.append(f"{block.env}: rollouts")
    rows = []
    for key, label in methods.items():
        cells: list[str] = [label]
        for block in blocks:
            rate, reward, rollouts = env_block_cells(block, key)
            cells += [rate, reward, rollouts] if block.graded else [rate, rollouts]
        rows.append(cells)
    return pd.DataFrame(rows, columns=columns)


TABLE1_NEEDS = ("method", "key", "column", "status", "n", "successes", "success_rate", "ci_low", "ci_high")


def env_block(env: str, root: Path, source: str, own: bool = False) -> EnvBlock:
    """One environment's Table 1 block from a run's root (this one, `own`, or another), or why there is
    none: no such folder, no evaluation there, an unreadable file, or a run of another environment."""
    paths = Paths(root)
    table, metrics = paths.table("table1", ".csv"), paths.metrics("evaluate")
    if not Path(root).is_dir():
        return EnvBlock(env, source, None, reason=f"{source}: no such folder")
    if not table.is_file() or not metrics.is_file():
        missing = "reports/tables/table1.csv" if not table.is_file() else "reports/metrics/evaluate.json"
        return EnvBlock(env, source, None, reason=f"{source}: no {missing} (has its evaluate stage run?)")
    try:
        info = json.loads(metrics.read_text(encoding="utf-8"))
        if not isinstance(info, dict):
            raise ValueError("evaluate.json is not a JSON object")
        rows = pd.read_csv(table)
        lacking = [c for c in TABLE1_NEEDS if c not in rows.columns]
        if lacking:
            raise ValueError(f"table1.csv has no column {lacking}")
    except (OSError, ValueError, pd.errors.ParserError) as err:  # EmptyDataError is a ValueError
        return EnvBlock(env, source, None, reason=f"{source}: unreadable ({err})")
    envs = info.get("envs") if isinstance(info.get("envs"), list) else []
    if own:  # this run's block is what this run evaluated (several environments under `evaluate.envs`)
        env = ", ".join(map(str, envs)) or env
    elif envs != [env]:
        return EnvBlock(env, source, None, reason=f"{source}: evaluated on {envs}, not [{env!r}]")
    graded = bool(set(envs) & set(info.get("graded_envs", []))) if "graded_envs" in info else bool(
        "mean_reward" in rows and ((rows["mean_reward"] > 0) & (rows["mean_reward"] < 1)).any())
    detail = f"{info.get('split', '?')} split, {info.get('tasks', '?')} tasks"
    return EnvBlock(env, source, rows.reindex(columns=TABLE1_COLUMNS), graded=graded, detail=detail)


def environment_blocks(env: str, others: Mapping[str, str], root: Path) -> list[EnvBlock]:
    """This run's block (`env`, the run's `env.name`) first, then one per entry of `others` (`report.environments`:
    environment -> another run's root, relative roots from `root`)."""
    blocks = [env_block(env, root, "this run", own=True)]
    for other_env, other in others.items():
        if other_env == env:
            continue  # this run is that environment's block
        where = Path(other)
        where = where if where.is_absolute() else root / where
        if where.resolve() == Path(root).resolve():
            blocks.append(EnvBlock(other_env, other, None, reason=f"{other}: that is this run's own folder"))
            continue
        blocks.append(env_block(other_env, where, other))
    return blocks


def environments_markdown(blocks: list[EnvBlock]) -> str:
    """reports/tables/environments.md: the table, where each block comes from, and the missing ones' reasons. A run
    whose folder does not exist yet (e.g. the phone before `make phone`) is named in the note, not given a column."""
    sources = "; ".join(f"{b.env}: {b.source}" + (f" ({b.detail})" if b.detail else "")
                        + (f" (not shown: {b.reason})" if b.rows is None else "") for b in blocks)
    shown = [b for i, b in enumerate(blocks) if i == 0 or b.rows is not None or not b.reason.endswith("no such folder")]
    note = ("Each block is one run of the pipeline on that environment (its own discovered capabilities, "
            "adapters and evaluation split), read from the run's reports/tables/table1.csv: overall success % "
            "with its 95% Wilson interval (a run written without one: its bootstrap interval over tasks) and "
            "successes/tasks; on a graded environment success means a perfect score and the mean reward "
            "(milestone similarity) follows; rollouts = training episodes behind the method. Runs: " + sources
            + ". Another environment's block comes from `report.environments` in params.yaml (e.g. "
            "`{phone: sweeps/phone}`, which `make phone` fills).")
    return "# Table 1 across environments\n\n" + note + "\n\n" + markdown(environments_table(shown))
