"""Same seed, same bytes: every stage up to evaluate, forced to run again, rewrites its outputs unchanged.

A scratch copy of the repo (as in test_pipeline_e2e) runs `dvc repro evaluate` once on the tiny
settings of test_crash_safety; the bytes of every file each stage declares in dvc.yaml (`outs`,
`metrics`, `plots`) are the reference. Then, stage by stage, `dvc repro --force --single-item <stage>`
must give every file back byte for byte, and `dvc status evaluate` must stay clean.

Left out, because they hold wall times: the executed notebooks (papermill records each cell's start
and end), the wall-time keys of the metrics files (`_WALL_TIME_KEYS`, compared with those keys
dropped) and the wall-time curves of each training (`reports/train/<adapter>/plots/metrics/time/`). The trainer's seconds per iteration go to `data/logs/`, which no stage declares.

The reference runs under PYTHONHASHSEED=0 and the reruns under 1, so an output that follows the
iteration order of a set of strings (or a dict built from one) differs here every time rather than
by chance. The tiny random model never completes a tool call, so training sees identical rewards and
leaves LoRA B at zero; that weight updates repeat is tests/training/test_trainer.py's
`test_same_seed_same_bytes_and_resume_matches_a_straight_run`.

A little over two minutes on two cores (the reference run takes half of it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from scratch_repo import BIN, make_scratch_repo, rules_params

from trace_lib.paths import STAGES

COVERED = STAGES[: STAGES.index("evaluate") + 1]
_WALL_TIME_KEYS = {"timing", "seconds", "time"}
"""Top-level keys of reports/metrics/*.json that hold wall times (rollout, train: `timing`, evaluate:
`seconds`)."""

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _dvc(root: Path, *args: str, hash_seed: str) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
           "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run([str(BIN / "dvc"), *args], check=False, cwd=root, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def _declared(stage: dict) -> list[tuple[str, str]]:
    """(kind, path) of every output a dvc.yaml stage declares: `outs`, `metrics` and `plots`."""
    return [(kind, next(iter(entry)) if isinstance(entry, dict) else entry)
            for kind in ("outs", "metrics", "plots") for entry in stage.get(kind, [])]


def _bytes(path: Path, kind: str) -> bytes:
    if kind == "metrics" and path.suffix == ".json":
        data = json.loads(path.read_bytes())
        return json.dumps({k: v for k, v in data.items() if k not in _WALL_TIME_KEYS}, indent=1).encode()
    return path.read_bytes()


def _outputs(root: Path, stage: str) -> dict[str, bytes]:
    """The bytes of every file the stage declares, wall times aside (see the module docstring)."""
    declared = yaml.safe_load((root / "dvc.yaml").read_text())["stages"][stage]
    out: dict[str, bytes] = {}
    for kind, name in _declared(declared):
        if name.endswith(".ipynb"):
            continue
        top = root / name
        for path in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if path.is_file() and "time" not in path.relative_to(top).parts[:-1]:  # a training's wall-time curves
                out[str(path.relative_to(root))] = _bytes(path, kind)
    return out


def _first_difference(a: bytes, b: bytes) -> str:
    """Where two files first differ: the line and column, with the two lines around that column (or
    the byte offset, for binary files)."""
    try:
        lines_a, lines_b = a.decode().splitlines(), b.decode().splitlines()
    except UnicodeDecodeError:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"binary, {len(a)} vs {len(b)} bytes, first difference at byte {at}"
    row = next((i for i, (x, y) in enumerate(zip(lines_a, lines_b)) if x != y), min(len(lines_a), len(lines_b)))
    x, y = (lines[row] if row < len(lines) else "<no line>" for lines in (lines_a, lines_b))
    if x == y:
        return "the same lines, other line endings"
    col = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    lo = max(0, col - 60)
    return f"line {row + 1}, column {col + 1}:\n- {x[lo:col + 60]}\n+ {y[lo:col + 60]}"


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_model_dir) -> Path:
    # two iterations: a checkpoint and a snapshot (iter-1) before the final adapter
    train = {"iterations": 2, "groups": 1, "group_size": 2, "reference_samples": 1, "max_new_tokens": 8, "max_steps_per_episode": 2,
             "threads": 1}
    return make_scratch_repo(tmp_path_factory.mktemp("determinism_repo"), rules_params(Path(tiny_model_dir), train))


@pytest.fixture(scope="module")
def ref(repo: Path) -> dict[str, dict[str, bytes]]:
    """Per stage, the bytes of its outputs after one uninterrupted `dvc repro evaluate`."""
    out = _dvc(repo, "repro", "evaluate", hash_seed="0")
    assert all(f"Running stage '{s}'" in out for s in COVERED)
    outputs = {s: _outputs(repo, s) for s in COVERED}
    assert all(outputs.values()), {s: len(o) for s, o in outputs.items()}
    assert len([p for p in outputs["train"] if p.endswith("adapter_model.safetensors")]) >= 2  # two adapters, iter-1
    assert any(p.startswith("data/evaluate/trajectories/") for p in outputs["evaluate"])
    return outputs


@pytest.mark.parametrize("stage", COVERED)
def test_a_forced_rerun_writes_the_same_bytes(repo: Path, ref: dict[str, dict[str, bytes]], stage: str):
    out = _dvc(repo, "repro", "--force", "--single-item", stage, hash_seed="1")
    assert [s for s in COVERED if f"Running stage '{s}'" in out] == [stage]
    for name, want in ref.items():
        got = _outputs(repo, name)
        assert sorted(got) == sorted(want), f"{name}: other files after rerunning {stage}"
        differ = [p for p in want if got[p] != want[p]]
        assert not differ, f"rerunning {stage} changed {differ}; {differ[0]} at " + \
            _first_difference(want[differ[0]], got[differ[0]])
    status = json.loads(_dvc(repo, "status", "evaluate", "--json", hash_seed="1"))
    stale = {s: sorted(dep for entry in changes if isinstance(entry, dict) for dep in entry.get("changed deps", {}))
             for s, changes in status.items()}
    assert stale == {}, status
