"""DVC's lock table after a kill: an unreadable one is removed so that `dvc repro` starts, a readable one stays."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_lib.dvc_locks import main, repair_rwlock, rwlock_path

BIN = Path(sys.executable).parent
CORRUPTED = "Unable to read RWLock-file"


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(BIN / "dvc"), *args], cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A DVC repository (no git) with one stage that copies a file; run once, so dvc wrote its lock table."""
    assert _dvc(tmp_path, "init", "-q", "--no-scm").returncode == 0
    (tmp_path / "a.txt").write_text("one\n")
    (tmp_path / "dvc.yaml").write_text("stages:\n  copy:\n    cmd: cp a.txt b.txt\n    deps: [a.txt]\n"
                                       "    outs: [b.txt]\n")
    assert _dvc(tmp_path, "repro").returncode == 0
    assert rwlock_path(tmp_path).is_file()
    return tmp_path


@pytest.mark.parametrize("left", [b"", b'{"read": {"a.txt": [{"pid": 12', b"\xff\xfe", b'{"write": []}'],
                         ids=["empty", "cut", "not-utf8", "not-dvc-format"])
def test_an_unreadable_lock_table_is_removed_and_dvc_runs_again(repo: Path, left: bytes):
    rwlock_path(repo).write_bytes(left)
    (repo / "a.txt").write_text("two\n")
    refused = _dvc(repo, "repro")
    assert refused.returncode != 0 and "failed to reproduce 'copy'" in refused.stderr  # dvc refuses to start
    if left == b"":
        assert CORRUPTED in refused.stderr

    done = repair_rwlock(repo)
    assert done is not None and "could not be read" in done and f"{len(left)} bytes" in done
    assert not rwlock_path(repo).exists()
    ran = _dvc(repo, "repro")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert (repo / "b.txt").read_text() == "two\n"
    assert json.loads(rwlock_path(repo).read_text()) is not None  # dvc wrote a fresh table


def test_a_readable_lock_table_is_left_as_it_is(repo: Path):
    # a dead process's read lock: dvc drops it itself when it blocks someone
    table = json.dumps({"read": {"a.txt": [{"pid": 2**22 + 12345, "cmd": "dvc repro"}]}, "write": {}})
    rwlock_path(repo).write_text(table)
    assert repair_rwlock(repo) is None
    assert rwlock_path(repo).read_text() == table
    (repo / "a.txt").write_text("three\n")
    assert _dvc(repo, "repro").returncode == 0


def test_nothing_to_mend_without_a_table_and_the_command_line(repo: Path, tmp_path_factory, capsys):
    rwlock_path(repo).unlink()
    assert repair_rwlock(repo) is None
    assert main([str(repo)]) == 0
    rwlock_path(repo).write_text("")
    assert main([str(repo)]) == 0 and "was removed" in capsys.readouterr().err
    elsewhere = tmp_path_factory.mktemp("not_dvc")
    assert main([str(elsewhere)]) == 2 and "not a DVC repository" in capsys.readouterr().err
    assert main(["a", "b"]) == 2


def test_a_guard_held_by_another_process_is_reported_not_waited_on(repo: Path):
    rwlock_path(repo).write_text("")
    guard = rwlock_path(repo).parent / "rwlock.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from dvc.lock import make_lock; "
                               "g = make_lock(sys.argv[1], tmp_dir=sys.argv[2]); g.lock(); print('held', flush=True); "
                               "time.sleep(60)", str(guard), str(guard.parent)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        done = repair_rwlock(repo)
        assert done is not None and "held by another process" in done
        assert rwlock_path(repo).exists()  # not touched without the guard
    finally:
        holder.kill()
        holder.wait()
    assert "was removed" in repair_rwlock(repo)  # the guard is free once its holder is gone

