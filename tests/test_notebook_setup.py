"""What the stage notebooks run first: the project root as working directory, no dependency notices, figures once."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import matplotlib.pyplot as plt

from trace_lib.notebook import project_root, setup_notebook
from trace_lib.plots import save_figure

REPO = Path(__file__).resolve().parents[1]


def test_a_notebook_opened_in_notebooks_runs_from_the_root(tmp_path: Path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    assert project_root("params.yaml", tmp_path / "notebooks") == tmp_path
    assert project_root("params.yaml", tmp_path) == tmp_path
    assert project_root("other.yaml", tmp_path / "notebooks") == tmp_path / "notebooks"  # nothing to find: stay
    (tmp_path / "elsewhere").mkdir()
    assert project_root("params.yaml", tmp_path / "elsewhere") == tmp_path / "elsewhere"  # only notebooks/ moves up


def test_setup_moves_to_the_root_and_silences_the_notices(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "")  # so the test's change is undone after it
    monkeypatch.delenv("TQDM_DISABLE")
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    monkeypatch.chdir(tmp_path / "notebooks")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert setup_notebook("params.yaml") == tmp_path and Path.cwd() == tmp_path
        warnings.warn("IProgress not found. Please update jupyter and ipywidgets.")
    assert not caught
    import os

    assert os.environ["TQDM_DISABLE"] == "1"  # a saved notebook keeps every refresh of a bar as a line


def test_with_bars_off_the_episode_loop_prints_one_summary_line(monkeypatch, capsys):
    from trace_lib.agent.rollout import Progress

    monkeypatch.setenv("TQDM_DISABLE", "1")
    bar = Progress(3, enabled=True)
    for _ in range(3):
        bar.update(1)
    bar.close()
    out = capsys.readouterr()
    assert out.out.startswith("rollout: 3 episodes in ") and out.out.count("\n") == 1 and "%|" not in out.err
    silent = Progress(3, enabled=False)
    silent.update(3)
    silent.close()
    assert capsys.readouterr().out == ""


def test_every_stage_notebook_calls_the_setup_first():
    for path in sorted((REPO / "notebooks").glob("0*.ipynb")):
        code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        first = "".join(code[1]["source"])  # the cell after the parameters
        assert first.startswith("from trace_lib.notebook import setup_notebook"), path.name
        assert "setup_notebook(params_path)" in first, path.name


def test_a_saved_figure_is_closed(tmp_path: Path):
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    save_figure(fig, tmp_path / "f.png")
    assert not plt.fignum_exists(fig.number) and (tmp_path / "f.png").read_bytes().startswith(b"\x89PNG")
