"""Equal-budget accounting: every episode any stage rolls out, counted in one format, and TRACE's total that the
baselines are trained to.

Methods are compared at equal rollout budget (paper §4: TRACE, GRPO on the target, merged training
and the baselines all spend the same number of episodes), so every stage that rolls out (band
checks in synthesize, train, the baselines) appends rows {stage, key, rollouts} to a JSONL ledger
it owns, e.g. `data/train/<name>/rollouts.jsonl` — one file per stage output, so DVC outputs never
collide — and `total_rollouts(paths)` sums any set of them for the report.

Appends are single `write` calls on an O_APPEND descriptor followed by fsync. A crash mid-write can
still leave a partial last line; reading skips it (and sets `truncated_tail`), and the next append
first cuts the file back to its last complete line so later rows are never glued onto it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trace_lib.io import atomic_write_text, dumps_json, read_json
from trace_lib.paths import Paths
from trace_lib.records import AdapterManifest


class RolloutLedger:
    """Append-only rollout counts of one stage output (a JSONL file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.truncated_tail = False
        """True when the last read found a partial last line (a crash mid-append); it is ignored."""

    # --- reading ------------------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """Every complete row, in append order."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline
        self.truncated_tail = bool(tail.strip())
        if self.truncated_tail:
            warnings.warn(f"{self.path}: ignoring a partial last line (interrupted append)", stacklevel=2)
        out = []
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{self.path}:{lineno}: not valid JSON ({err.msg})") from err
            out.append(row)
        return out

    def used(self, stage: str | None = None, key: str | None = None) -> int:
        """Rollouts recorded, optionally only for one stage and/or key."""
        return sum(int(r["rollouts"]) for r in self.rows()
                   if (stage is None or r["stage"] == stage) and (key is None or r["key"] == key))

    def remaining(self, budget: int, stage: str | None = None, key: str | None = None) -> int:
        """Rollouts left of `budget` after what `stage`/`key` already used (never negative)."""
        return max(0, int(budget) - self.used(stage, key))

    # --- writing ------------------------------------------------------------------------------
    def add(self, stage: str, rollouts: int, key: str = "") -> None:
        """Record `rollouts` episodes spent by `stage` (for `key`, e.g. an adapter or capability)."""
        if int(rollouts) < 0:
            raise ValueError(f"rollouts must be >= 0, got {rollouts}")
        line = (dumps_json({"stage": stage, "key": key, "rollouts": int(rollouts)}) + "\n").encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair_tail()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def reset(self, stage: str, key: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """Make `rows` the rows of (stage, key), after every other row; returns the rollouts dropped
        (negative when `rows` holds more than the file did).

        Used on resume with the rows saved in the checkpoint: the ledger then counts exactly the
        rollouts behind it, whether the file holds rows of work done after the checkpoint (a crash) or
        has lost rows (DVC removes a stage's outputs, this file among them, before it reruns the stage).
        """
        if any(r["stage"] != stage or r["key"] != key for r in rows):
            raise ValueError(f"rows to restore must all be ({stage!r}, {key!r})")
        current = self.rows()
        ours = [r for r in current if r["stage"] == stage and r["key"] == key]
        if ours != list(rows) or self.truncated_tail:
            out = [r for r in current if not (r["stage"] == stage and r["key"] == key)] + [dict(r) for r in rows]
            atomic_write_text(self.path, "".join(dumps_json(r) + "\n" for r in out))
        return sum(int(r["rollouts"]) for r in ours) - sum(int(r["rollouts"]) for r in rows)

    def _repair_tail(self) -> None:
        """Cut a partial last line (left by a crash mid-append) so the next row starts on its own line."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with self.path.open("rb") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) == b"\n":
                return
            data = self.path.read_bytes()
        keep = data[: data.rfind(b"\n") + 1]
        warnings.warn(f"{self.path}: dropping a partial last line (interrupted append)", stacklevel=3)
        atomic_write_text(self.path, keep.decode("utf-8"))


def total_rollouts(paths: Iterable[str | Path], missing_ok: bool = False) -> dict[str, Any]:
    """Sum several ledgers: {"total": n, "by_stage": {stage: n}, "by_key": {"stage/key": n}}."""
    by_stage: dict[str, int] = defaultdict(int)
    by_key: dict[str, int] = defaultdict(int)
    for path in paths:
        ledger = RolloutLedger(path)
        if not ledger.path.exists():
            if missing_ok:
                continue
            raise FileNotFoundError(f"rollout ledger {ledger.path} not found")
        for r in ledger.rows():
            by_stage[r["stage"]] += int(r["rollouts"])
            by_key[f"{r['stage']}/{r['key']}" if r["key"] else r["stage"]] += int(r["rollouts"])
    return {"total": sum(by_stage.values()), "by_stage": dict(sorted(by_stage.items())),
            "by_key": dict(sorted(by_key.items()))}


DISTILLED = "distilled"
"""The student of cross-skill distillation (train stage, `train.distill`); it lives beside the baselines."""
BASELINES = ("grpo_target", "grpo_target_late", "merged_data", DISTILLED)
"""Adapters the evaluate stage looks for under data/adapters/_baselines/ (the distilled student among them:
one adapter for every task, trained after the capability adapters)."""


def adapter_manifest(folder: Path) -> AdapterManifest | None:
    path = folder / "manifest.json"
    if not (path.is_file() and (folder / "adapter_config.json").is_file()):
        return None
    return AdapterManifest.model_validate(read_json(path))


def find_adapters(root: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """(capability adapters, baseline adapters): name -> folder, for folders with a PEFT config and a
    manifest. Hidden folders (temp, checkpoints) are skipped."""
    paths = Paths(root)
    base = paths.adapters
    caps = {}
    if base.is_dir():
        for folder in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
            if adapter_manifest(folder) is not None:
                caps[folder.name] = folder
    clash = sorted(set(caps) & set(BASELINES))
    if clash:
        raise ValueError(f"capability adapter(s) {clash} use a baseline's name; rename the capability")
    baselines = {n: paths.adapter(n, True) for n in BASELINES if adapter_manifest(paths.adapter(n, True))}
    return caps, baselines


def adapter_budget(root: Path, name: str, baseline: bool = False) -> tuple[int, str]:
    """(rollouts an adapter cost, where the number came from: the ledger path or 'manifest')."""
    ledger = Paths(root).train_ledger(name, baseline)
    if ledger.is_file():
        return int(total_rollouts([ledger])["total"]), ledger.relative_to(root).as_posix()
    manifest = adapter_manifest(Paths(root).adapter(name, baseline))
    if manifest is None:
        raise FileNotFoundError(f"no ledger {ledger} and no adapter manifest for {name!r}")
    return int(manifest.rollouts_used), "manifest"


def trace_budget(root: Path, names: list[str], rollout_split: str | None = None) -> dict[str, Any]:
    """TRACE's rollouts: the base agent's discovery rollouts on the target (`rollout_split`'s
    trajectories; None: not charged), every capability adapter's training and the synthesize stage's
    band checks, as the paper's scaling curves charge them.

    This is the budget a baseline (GRPO on the target, merged data, GEPA) is given."""
    by_adapter = {n: adapter_budget(root, n)[0] for n in names}
    synth = Paths(root).synth_rollouts
    band = int(total_rollouts([synth])["total"]) if synth.is_file() else 0
    discovery = analysis_rollouts(root, rollout_split) if rollout_split is not None else 0
    return {"total": sum(by_adapter.values()) + band + discovery, "by_adapter": by_adapter, "synthesize": band,
            "discovery": discovery}


def analysis_rollouts(root: Path, split: str) -> int:
    """Episodes the rollout stage spent on the target's train split (discovery; part of TRACE's budget)."""
    path = Paths(root).rollouts(split)
    if not path.is_file():
        return 0
    with path.open(encoding="utf-8") as fh:
        return sum(1 for line in fh if line.strip())
