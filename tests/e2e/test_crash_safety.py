"""Crash safety: `kill -9` in the middle of rollout, train and evaluate, then `dvc repro` again.

A scratch copy of the repo (as in test_pipeline_e2e) runs `dvc repro evaluate` once without
interruption on tiny settings; its outputs are the reference. Then each test starts `dvc repro` in a
session of its own and SIGKILLs it at a point read from its progress on disk or in the process
table, and runs `dvc repro evaluate` again, which must succeed with the reference's bytes, every
JSON artifact whole, no temp files, the train ledgers holding exactly the reference's rows (nothing
counted twice or lost) and `dvc status` clean.

Killing: papermill starts its kernel in a session of its own (jupyter_client), and the kernel starts
the sandbox workers in theirs, so the dvc process group alone does not hold them. `_kill` kills
either the whole tree (a machine going down: the kill point is exact) or only dvc's group (a user's
`kill -9`): then the kernel must notice its parent is gone and exit (ipykernel polls once a second),
and the workers must exit when their input closes; no process may outlive either kill.

The tests share the scratch repo and run in file order; about three minutes on two cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from scratch_repo import BIN, make_scratch_repo, rules_params

from trace_lib.training.lockstep import resume_points

UP_TO_DATE = "Data and pipelines are up to date."

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}


def _dvc(root: Path, *args: str) -> str:
    proc = subprocess.run([str(BIN / "dvc"), *args], check=False, cwd=root, env=_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def _repro_after_kill(root: Path) -> str:
    """`dvc repro evaluate` as `make repro` starts it after a kill: DVC's lock table mended first (a kill while
    dvc rewrote it leaves it unreadable, and dvc would refuse to start)."""
    subprocess.run([sys.executable, "-m", "trace_lib.dvc_locks", str(root)], check=True, cwd=root, env=_env(),
                   timeout=120)
    return _dvc(root, "repro", "evaluate")


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _running(procs: list[psutil.Process], needle: str) -> bool:
    for p in procs:
        try:
            if any(needle in part for part in p.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


def _gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes of `procs` still running after `timeout` s (zombies count as gone: whether a
    container's init reaps orphans is not ours to test)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _kernel_and(ready: Callable[[], bool] = lambda: True) -> Callable[[list[psutil.Process]], bool]:
    """A kill point: a kernel runs (so dvc has removed the stage's old outputs) and `ready()` holds."""
    return lambda tree: _running(tree, "ipykernel") and ready()


def _command_done() -> Callable[[list[psutil.Process]], bool]:
    """A kill point: the stage's command (papermill) has come and gone, and dvc is saving the outputs
    to its cache and writing dvc.lock."""
    seen: list[bool] = []

    def ready(tree: list[psutil.Process]) -> bool:
        if _running(tree, "papermill"):
            seen.append(True)
            return False
        return bool(seen)
    return ready


def _kill(root: Path, args: list[str], ready: Callable[[list[psutil.Process]], bool], *,
          whole_tree: bool = True, timeout: float = 300) -> None:
    """`dvc repro *args` in its own session, SIGKILLed once `ready(descendants)` holds; returns when
    every process it started is gone (the test fails if one outlives the kill by 30 s)."""
    proc = subprocess.Popen([str(BIN / "dvc"), "repro", *args], cwd=root, env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while True:
            tree = _tree(proc.pid)
            if ready(tree):
                break
            assert proc.poll() is None, f"dvc repro {' '.join(args)} ended (rc {proc.returncode}) before the kill point"
            assert time.monotonic() < deadline, f"kill point of dvc repro {' '.join(args)} not reached"
            time.sleep(0.01)
        tree = _tree(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        if whole_tree:
            for p in tree:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    alive = _gone(tree, timeout=30)
    for p in alive:  # fail, but leave nothing behind for the next test
        p.kill()
    assert not alive, f"processes outlived the kill of dvc: {[p.pid for p in alive]}"


def _is_temp(path: Path) -> bool:
    """Names of io.atomic_write_* temp files and of the trainer's temp / old adapter folders."""
    return path.name.startswith(".") and (path.name.endswith(".tmp") or ".tmp-" in path.name or ".old-" in path.name)


def _unfinished(path: Path, root: Path) -> bool:
    """A temp file, or a file of a checkpoint whose trace_state.json (written last) is missing: HF writes
    its checkpoint files in place, and the trainer never resumes from such a checkpoint."""
    if _is_temp(path) or any(_is_temp(p) for p in path.relative_to(root).parents):
        return True
    ckpt = next((p for p in path.parents if p.name.startswith("checkpoint-")), None)
    return ckpt is not None and not (ckpt / "trace_state.json").is_file()


def _assert_artifacts_whole(root: Path, *, notebooks: bool = True) -> None:
    """Every finished JSON / JSONL file under data/ and reports/ parses (papermill writes its executed
    notebook in place, so it may be cut short by a kill: `notebooks=False` skips them)."""
    checked = 0
    for path in [*(root / "data").rglob("*"), *(root / "reports").rglob("*")]:
        if not path.is_file() or _unfinished(path, root):
            continue
        text = path.read_text(encoding="utf-8") if path.suffix in (".json", ".jsonl", ".ipynb") else None
        if text is None or (path.suffix == ".ipynb" and not notebooks):
            continue
        try:
            [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
                else json.loads(text)
        except json.JSONDecodeError as err:
            raise AssertionError(f"{path.relative_to(root)} is not whole: {err}") from err
        checked += 1
    assert checked


def _outputs(root: Path, folders: tuple[str, ...]) -> dict[str, bytes]:
    """The bytes of every file under `folders`, the trainings' wall-time curves (`.../metrics/time/`) aside."""
    return {str(p.relative_to(root)): p.read_bytes() for f in folders for p in sorted((root / f).rglob("*"))
            if p.is_file() and "time" not in p.relative_to(root / f).parts[:-1]}


def _without_timing(path: Path) -> dict:
    """A stage's metrics without their wall times (the top-level `timing` key)."""
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "timing"}


def _ledgers(root: Path) -> dict[str, list[dict]]:
    return {str(p.relative_to(root)): [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted((root / "data/train").rglob("rollouts.jsonl"))}


def _assert_recovered(root: Path, ref: dict) -> None:
    """The state after `dvc repro evaluate` completed following a kill."""
    _assert_artifacts_whole(root)
    temps = [str(p.relative_to(root)) for d in ("data", "reports") for p in (root / d).rglob("*") if _is_temp(p)]
    assert not temps, f"temp files left behind: {temps}"
    assert not (root / "data/checkpoints").exists()  # the train stage removes them once it is done
    for folders, want in ref["outputs"].items():
        assert _outputs(root, folders) == want, f"{folders} differ from the uninterrupted run"
    assert _ledgers(root) == ref["ledgers"]
    assert UP_TO_DATE in _dvc(root, "status", "evaluate")
    # DVC releases a dead process's locks only when they block someone, so a killed run's read locks
    # on paths nobody writes stay in the file; none may belong to a live process.
    rwlock = json.loads((root / ".dvc/tmp/rwlock").read_text())
    holders = {i["pid"] for i in rwlock.get("write", {}).values()} | \
        {i["pid"] for infos in rwlock.get("read", {}).values() for i in infos}
    assert not [pid for pid in holders if psutil.pid_exists(pid)], rwlock


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_model_dir) -> Path:
    # two checkpoints per adapter, each two iterations after the last: room for a kill between them; no
    # baselines and no distilled student (the cpu profile's), so the kill points stay on the capability adapters
    train = {"iterations": 4, "save_every": 2, "groups": 1, "group_size": 2, "reference_samples": 1, "max_new_tokens": 8,
             "max_steps_per_episode": 2, "threads": 1, "baselines": [], "distill": {"iterations": 0}, "lockstep": True}
    return make_scratch_repo(tmp_path_factory.mktemp("crash_repo"), rules_params(Path(tiny_model_dir), train))


FOLDERS = {"rollout": ("data/rollouts",), "train": ("data/adapters", "data/train", "reports/train"),
           "evaluate": ("data/evaluate", "reports/tables")}


@pytest.fixture(scope="module")
def ref(repo: Path) -> dict:
    """The uninterrupted run's outputs, ledgers and metrics."""
    _dvc(repo, "repro", "evaluate")
    adapters = sorted(json.loads(line)["capability_id"]
                      for line in (repo / "data/adapters/manifests.jsonl").read_text().splitlines())
    assert len(adapters) >= 2, "the train kill points need two adapters"
    ledgers = _ledgers(repo)
    assert [sum(r["rollouts"] for r in rows) for rows in ledgers.values()] == [4 * 1 * 2] * len(adapters)
    _assert_recovered(repo, {"outputs": {}, "ledgers": ledgers})
    return {"adapters": adapters, "ledgers": ledgers,
            "outputs": {f: _outputs(repo, f) for f in FOLDERS.values()},
            "metrics": {s: _without_timing(repo / f"reports/metrics/{s}.json") for s in ("rollout", "train")}}


def test_rollout_killed_early_then_mid_stage(repo: Path, ref: dict):
    """Killed right after the kernel started (only dvc's process group: the kernel must exit by itself),
    then, rerun by `dvc repro evaluate`, killed while rolling out (tasks written, trajectories not)."""
    _kill(repo, ["--force", "-s", "rollout"], _kernel_and(), whole_tree=False)
    assert not (repo / "data/rollouts/train.jsonl").exists()  # dvc removed the outputs before the command
    _kill(repo, ["evaluate"], _kernel_and((repo / "data/rollouts/tasks-train.jsonl").exists))
    assert not (repo / "data/rollouts/train.jsonl").exists()
    _assert_artifacts_whole(repo, notebooks=False)

    out = _repro_after_kill(repo)
    assert "Running stage 'rollout'" in out and "Running stage 'train'" not in out  # same bytes: nothing downstream
    _assert_recovered(repo, ref)
    assert _without_timing(repo / "reports/metrics/rollout.json") == ref["metrics"]["rollout"]


def test_train_killed_before_and_after_a_checkpoint_resumes_without_double_counting(repo: Path, ref: dict):
    """Killed once the first adapter's ledger has rows but before any checkpoint (they are redone, not counted
    twice), then, rerun, killed once the second adapter passed its first checkpoint. The adapters train in
    lockstep here (`train.lockstep`), so the kill may fall between two adapters' updates of a round: the
    rerun resumes every adapter from the newest checkpoint all unfinished ones have (`lockstep.resume_points`)
    and ends with the uninterrupted run's bytes."""
    names = ref["adapters"][:2]
    first, second = (repo / "data/train" / a / "rollouts.jsonl" for a in names)
    ckpts = repo / "data/checkpoints"
    _kill(repo, ["--force", "-s", "train"], _kernel_and(lambda: first.exists() and first.read_text().count("\n") >= 1))
    assert not list(ckpts.glob("*/checkpoint-*/trace_state.json")), "killed too late: a checkpoint was saved"
    assert 1 <= first.read_text().count("\n") <= 2 and (not second.exists() or second.read_text().count("\n") <= 2)
    _assert_artifacts_whole(repo, notebooks=False)

    state = ckpts / names[1] / "checkpoint-2" / "trace_state.json"
    _kill(repo, ["evaluate"], _kernel_and(state.exists))
    _assert_artifacts_whole(repo, notebooks=False)
    saved = {a: {int(p.parent.name.split("-")[1]): json.loads(p.read_text())
                 for p in (ckpts / a).glob("checkpoint-*/trace_state.json")} for a in ref["adapters"]}
    assert set(saved[names[1]]) in ({2}, {2, 4}) and set(saved[names[0]]) in (set(), {2}, {2, 4})
    for a, states in saved.items():  # G x K = 2 rollouts per iteration
        assert all(sum(r["rollouts"] for r in s["ledger"]) == 2 * i for i, s in states.items())
    resumed = resume_points({a: max(states, default=0) for a, states in saved.items()}, dict.fromkeys(saved, 4))

    out = _repro_after_kill(repo)
    assert "Running stage 'train'" in out
    _assert_recovered(repo, ref)
    assert _without_timing(repo / "reports/metrics/train.json") == ref["metrics"]["train"]
    for name, states in saved.items():  # resumed: the iterations before the checkpoint kept the killed run's timings
        timing = json.loads((repo / f"data/logs/train/{name}.timing.json").read_text())["iterations"]
        at = max((i for i in states if resumed[name] is None or i <= resumed[name]), default=0)
        assert timing[:at] == (states[at]["timing"] if at else [])


def test_evaluate_killed_mid_stage_and_while_dvc_saves_its_outputs(repo: Path, ref: dict):
    """Killed (dvc's process group only) once evaluate has run the base episodes and opened the synthetic
    environments' sandboxes: the kernel and the sandbox workers must exit by themselves. Then, rerun,
    killed after the notebook finished, while dvc caches the outputs and writes dvc.lock."""
    _kill(repo, ["--force", "-s", "evaluate"], lambda tree: _running(tree, "trace_lib.synth.worker"),
          whole_tree=False)
    assert not (repo / "data/evaluate/results.jsonl").exists()
    _assert_artifacts_whole(repo, notebooks=False)
    _kill(repo, ["evaluate"], _command_done())
    _assert_artifacts_whole(repo)

    out = _repro_after_kill(repo)  # evaluate reruns unless the kill came after dvc.lock was written
    assert "Running stage 'train'" not in out
    _assert_recovered(repo, ref)
