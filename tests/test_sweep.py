"""Sweeps: grid expansion and validation (fast), a papermill sweep of the rollout notebook and
`dvc exp run -S` in a scratch git+dvc repo (e2e, tiny random model, about a minute together)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trace_lib.config import ConfigError
from trace_lib.sweep import (
    SweepRun, expand_grid, main, parse_assignment, run_sweep, stage_name, table_row, write_table,
)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ROLLOUT_NB = REPO / "notebooks" / "01_rollout.ipynb"


# --- grid expansion, parsing, validation -----------------------------------------------------------

def test_expand_grid_names_and_order():
    runs = expand_grid({"rollout.temperature": [0.3, 1.0], "seed": [0, 1]})
    assert [r.name for r in runs] == [
        "rollout.temperature=0.3_seed=0", "rollout.temperature=0.3_seed=1",
        "rollout.temperature=1.0_seed=0", "rollout.temperature=1.0_seed=1",
    ]
    assert runs[1].overrides == {"rollout.temperature": 0.3, "seed": 1}
    assert expand_grid({"rollout.temperature": [0.3, 1.0], "seed": [0, 1]}) == runs


def test_single_valued_keys_apply_to_every_run_but_stay_out_of_names():
    runs = expand_grid({"rollout.max_tasks": [2], "seed": [0, 1]})
    assert [r.name for r in runs] == ["seed=0", "seed=1"]
    assert all(r.overrides["rollout.max_tasks"] == 2 for r in runs)
    assert [r.name for r in expand_grid({"seed": [3]})] == ["seed=3"]


def test_names_are_filesystem_safe_and_unique():
    runs = expand_grid({"model.id": ["org/model a", "b"], "env.families": [["x", "y"]]})
    assert [r.name for r in runs] == ["model.id=org-model-a", "model.id=b"]
    with pytest.raises(ValueError, match="share the folder name"):
        expand_grid({"seed": [1, 1]})
    with pytest.raises(ValueError, match="seed: expected a non-empty list"):
        expand_grid({"seed": []})


def test_parse_assignment():
    assert parse_assignment("rollout.temperature=0.3,1.0") == ("rollout.temperature", [0.3, 1.0])
    assert parse_assignment("env.name=retail,tau2-retail") == ("env.name", ["retail", "tau2-retail"])
    assert parse_assignment("rollout.constrained=true,false") == ("rollout.constrained", [True, False])
    assert parse_assignment("rollout.max_tasks=null") == ("rollout.max_tasks", [None])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_assignment("rollout.temperature")


def test_stage_name_and_table_row():
    assert stage_name("notebooks/01_rollout.ipynb") == "rollout"
    row = table_row(SweepRun("seed=1", {"seed": 1}), {"n": 3, "seed": 9, "by_family": {"a": {"n": 1}}}, "rollout")
    assert row == {"run": "seed=1", "seed": 1, "n": 3, "rollout.seed": 9, "by_family.a.n": 1}


def test_write_table(tmp_path: Path):
    path = write_table([{"run": "a", "x": 0.3, "ok": True}, {"run": "b", "x": None, "y": [1]}], tmp_path / "t.csv")
    assert path.read_text() == "run,x,ok,y\na,0.3,true,\nb,,,[1]\n"
    assert [p.name for p in tmp_path.iterdir()] == ["t.csv"]  # no temp file left behind


def test_bad_key_fails_before_any_run(tmp_path: Path):
    """Every grid point is validated first: the bad value of the second point stops the first."""
    out = tmp_path / "sweep"
    with pytest.raises(ConfigError, match=r"rollout\.temperature=-1\.0: .*rollout\.temperature: Input should be"):
        run_sweep(ROLLOUT_NB, {"rollout.temperature": [0.3, -1.0]}, out, params_path=REPO / "params.yaml")
    assert not out.exists()


def test_cli_names_unknown_key(tmp_path: Path, capsys):
    out = tmp_path / "sweep"
    with pytest.raises(SystemExit) as exc:
        main([str(ROLLOUT_NB), "--set", "rollout.temperatur=0.3,1.0", "--set", "seed=0,1",
              "--out", str(out), "--params", str(REPO / "params.yaml")])
    assert exc.value.code == 2
    assert "rollout.temperatur: unknown key" in capsys.readouterr().err
    assert not out.exists()


def test_cli_dry_run_lists_runs(tmp_path: Path, capsys):
    main([str(ROLLOUT_NB), "--set", "rollout.temperature=0.3,1.0", "--out", str(tmp_path / "s"),
          "--params", str(REPO / "params.yaml"), "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [str(tmp_path / "s" / f"rollout.temperature={t}")
                                                      for t in ("0.3", "1.0")]
    assert not (tmp_path / "s").exists()


def test_cli_root_takes_one_point(tmp_path: Path, capsys):
    main([str(ROLLOUT_NB), "--set", "env.name=phone", "--root", str(tmp_path / "phone"),
          "--params", str(REPO / "params.yaml"), "--dry-run"])
    assert capsys.readouterr().out.splitlines() == [f"{tmp_path / 'phone'}: {{'env.name': 'phone'}}"]
    with pytest.raises(SystemExit) as exc:
        main([str(ROLLOUT_NB), "--set", "seed=0,1", "--root", str(tmp_path / "x"), "--params",
              str(REPO / "params.yaml"), "--dry-run"])
    assert exc.value.code == 2 and "--root takes a grid of one point, not 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one grid point, not 2"):
        run_sweep(ROLLOUT_NB, {"seed": [0, 1]}, tmp_path / "x", params_path=REPO / "params.yaml", as_root=True)
    with pytest.raises(ValueError, match="is the repo itself"):
        run_sweep(ROLLOUT_NB, {"seed": [0]}, ".", params_path="params.yaml", cwd=REPO, as_root=True)


def stage_notebook(path: Path, stage: str) -> Path:
    """A stand-in stage notebook: reads what the stage before wrote under `root`, writes its own metrics."""
    from nbformat.v4 import new_code_cell, new_notebook

    params = new_code_cell('params_path = "params.yaml"\noverrides = {}\nroot = "."')
    params.metadata["tags"] = ["parameters"]
    body = new_code_cell(
        "import json, pathlib\n"
        "m = pathlib.Path(root) / 'reports' / 'metrics'\n"
        "m.mkdir(parents=True, exist_ok=True)\n"
        "before = sorted(p.stem for p in m.glob('*.json'))\n"
        f"(m / '{stage}.json').write_text(json.dumps({{'before': before, 'env': overrides['env.name']}}))\n")
    nb = new_notebook(cells=[params, body], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                      "language": "python"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb))
    return path


def test_several_notebooks_run_in_order_under_one_root(tmp_path: Path):
    """A pipeline on another setting: each stage sees the one before it under the same root."""
    first = stage_notebook(tmp_path / "nb" / "01_alpha.ipynb", "alpha")
    second = stage_notebook(tmp_path / "nb" / "02_beta.ipynb", "beta")
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    table = run_sweep([first, second], {"env.name": ["phone"]}, "sweeps/phone", params_path="params.yaml",
                      cwd=tmp_path, as_root=True)
    assert table == tmp_path / "sweeps/phone/sweep.csv"
    rows = list(csv.DictReader(table.open()))
    assert rows == [{"run": "env.name=phone", "env.name": "phone", "alpha.before": "[]", "alpha.env": "phone",
                     "beta.before": '["alpha"]', "beta.env": "phone"}]
    assert (tmp_path / "sweeps/phone/01_alpha.ipynb").is_file() and (tmp_path / "sweeps/phone/02_beta.ipynb").is_file()


# --- end to end: papermill sweep and dvc experiments on the tiny model --------------------------------

def tiny_params(model_id: str, out_dir: str = "data/model") -> dict:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"].update({"id": model_id, "out_dir": out_dir})
    params["env"].update({"tasks_per_family": 1, "test_tasks_per_family": 1, "validation_tasks_per_family": 1,
                          "max_steps": 3})
    # a tiny random model is in no calibration band: the environments would all be dropped
    params["synthesize"]["calibration"] = {"enabled": False}
    params["rollout"].update({"samples_per_task": 1, "max_new_tokens": 24, "batch_size": 4, "threads": 1})
    return params


def _run(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
           "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.e2e
def test_papermill_sweep_of_rollout(tmp_path: Path, tiny_model_dir: Path):
    """Two temperatures: each run writes its own trajectories and notebook; sweep.csv has a row each."""
    from trace_lib.engine.model import resolve_model

    model_dir = resolve_model(str(tiny_model_dir), tmp_path / "model", "float32")  # the prepare_model stage
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(tiny_params(str(tiny_model_dir), str(model_dir))))

    table = run_sweep(ROLLOUT_NB, {"rollout.temperature": [0.3, 1.0], "rollout.max_tasks": [3]}, "sweeps/temp",
                      params_path="params.yaml", cwd=tmp_path)

    assert table == tmp_path / "sweeps/temp/sweep.csv"
    rows = list(csv.DictReader(table.open()))
    names = ["rollout.temperature=0.3", "rollout.temperature=1.0"]
    assert [r["run"] for r in rows] == names
    assert [r["rollout.temperature"] for r in rows] == ["0.3", "1.0"]
    assert [r["temperature"] for r in rows] == ["0.3", "1.0"]  # as the run's own metrics recorded it
    for name, row in zip(names, rows):
        run_root = tmp_path / "sweeps/temp" / name
        trajs = [json.loads(line) for line in (run_root / "data/rollouts/train.jsonl").read_text().splitlines()]
        assert len(trajs) == 3 and row["n"] == "3" and row["rollout.max_tasks"] == "3"
        assert 0 <= float(row["success_rate"]) <= 1
        assert (run_root / "01_rollout.ipynb").is_file()
        assert (run_root / "reports/figures/rollout_success_by_family.png").is_file()
    assert not (tmp_path / "data").exists() and not (tmp_path / "reports").exists()  # outputs only under root


@pytest.fixture(scope="module")
def exp_repo(tmp_path_factory, tiny_model_dir) -> Path:
    """A committed git+dvc copy of the pipeline with tiny params (dvc exp needs a commit)."""
    root = tmp_path_factory.mktemp("exp_repo")
    for name in ("trace_lib", "notebooks"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", ".gitignore"):
        shutil.copy(REPO / name, root / name)
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(str(tiny_model_dir))))
    _run(["git", "init", "-q"], root)
    _run(["git", "config", "user.name", "trace tests"], root)
    _run(["git", "config", "user.email", "tests@example.invalid"], root)
    _run([str(BIN / "dvc"), "init", "-q"], root)
    _run(["git", "add", "-A"], root)
    _run(["git", "commit", "-q", "-m", "tiny pipeline"], root)
    return root


@pytest.mark.e2e
def test_dvc_exp_run_set_param(exp_repo: Path):
    """A size the profile sets is not written in params.yaml, so dvc adds it with hydra's `+`."""
    _run([str(BIN / "dvc"), "exp", "run", "-S", "+rollout.temperature=0.9", "rollout"], exp_repo)
    shown = json.loads(_run([str(BIN / "dvc"), "exp", "show", "--json"], exp_repo).stdout)
    baseline = next(row for row in shown if row["rev"] != "workspace")
    assert "temperature" not in baseline["data"]["params"]["params.yaml"]["data"]["rollout"]
    (exp,) = baseline["experiments"]
    data = exp["revs"][0]["data"]
    assert data["params"]["params.yaml"]["data"]["rollout"]["temperature"] == 0.9
    metrics = data["metrics"]["reports/metrics/rollout.json"]["data"]
    assert metrics["temperature"] == 0.9 and metrics["n"] == 4 and 0 <= metrics["success_rate"] <= 1


@pytest.mark.e2e
def test_dvc_exp_run_typo_names_the_key(exp_repo: Path):
    """A typo is refused by dvc itself; forced in with hydra's `+`, the stage's notebook refuses it."""
    try:
        proc = _run([str(BIN / "dvc"), "exp", "run", "-S", "rollout.temperatur=0.9", "rollout"], exp_repo, check=False)
        assert proc.returncode != 0 and "Could not override 'rollout.temperatur'" in proc.stdout + proc.stderr
        proc = _run([str(BIN / "dvc"), "exp", "run", "-S", "+rollout.temperatur=0.9", "rollout"], exp_repo, check=False)
        assert proc.returncode != 0 and "rollout.temperatur: unknown key" in proc.stdout + proc.stderr
        assert not (exp_repo / "data/rollouts/train.jsonl").exists()  # dvc cleared the outs; nothing rewrote them
    finally:
        _run(["git", "checkout", "--", "params.yaml"], exp_repo)
