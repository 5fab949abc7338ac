"""Mends what a killed `dvc repro` can leave in DVC's own lock table, so that the next run starts.

Reads and may remove `<repo>/.dvc/tmp/rwlock`; writes nothing else. `make repro` runs it before `dvc repro`
(`python -m trace_lib.dvc_locks [REPO]`).

Why: DVC records which process reads or writes which path in `.dvc/tmp/rwlock`, a JSON table it rewrites in
place (truncate, then write) under its guard lock `rwlock.lock`. A process killed between the two leaves an
empty or cut file, and every later `dvc repro` then stops at once with "Unable to read RWLock-file
'.dvc/tmp/rwlock'. JSON structure is corrupted", though no process holds anything: the run cannot be resumed
without deleting the file by hand. The entries of dead processes in a readable table are no problem (DVC drops
them when they block someone), so a readable table is left as it is.

The check runs under the same guard lock DVC takes to edit the table (its kind from `core.hardlink_lock`),
so it never reads a table that a live DVC process is halfway through writing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rwlock_path(repo: Path) -> Path:
    from dvc.rwlock import RWLOCK_FILE

    return repo / ".dvc" / "tmp" / RWLOCK_FILE


def _hardlink_lock(repo: Path) -> bool:
    """DVC's `core.hardlink_lock` for `repo` (its repo, local and global configs): which guard lock it takes."""
    from dvc.config import Config

    return bool(Config(dvc_dir=str(repo / ".dvc"))["core"].get("hardlink_lock", False))


def repair_rwlock(repo: Path) -> str | None:
    """Remove `repo`'s DVC lock table when it cannot be read (empty, cut, not DVC's format); returns what was
    done, or None when there was nothing to mend (no table, or a readable one)."""
    from dvc.lock import LockError, make_lock
    from dvc.rwlock import RWLOCK_LOCK, SCHEMA
    from voluptuous import Invalid

    path = rwlock_path(repo)
    if not path.exists():
        return None
    # wait=False: DVC's own few retries (a few seconds), as dvc itself does; a guard held longer (a stopped dvc,
    # or a hard-link claim a killed process left, which never expires) is reported, not waited on forever
    guard = make_lock(str(path.parent / RWLOCK_LOCK), tmp_dir=str(path.parent), hardlink_lock=_hardlink_lock(repo),
                      wait=False)
    try:
        with guard:
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # removed by another repair in the meantime
                return None
            try:
                SCHEMA(json.loads(data.decode("utf-8")))
                return None
            except (ValueError, Invalid) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                path.unlink()
                return (f"{path}: DVC's lock table could not be read ({type(exc).__name__}, {len(data)} bytes; a "
                        f"dvc process was killed while writing it) and was removed")
    except LockError:
        return (f"{path.parent / RWLOCK_LOCK}: held by another process, so DVC's lock table was not checked; if no "
                f"dvc process is running, remove that file and {path.name}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print("usage: python -m trace_lib.dvc_locks [REPO]", file=sys.stderr)
        return 2
    repo = Path(args[0] if args else ".")
    if not (repo / ".dvc").is_dir():
        print(f"{repo}: not a DVC repository (no .dvc folder)", file=sys.stderr)
        return 2
    done = repair_rwlock(repo)
    if done:
        print(done, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
