"""The rollout-budget ledger: every episode any stage rolls out, counted in one format.

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

from trace_lib.io import atomic_write_text, dumps_json


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
