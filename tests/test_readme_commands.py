"""The README's commands work as written in a fresh shell: no activated environment, a bare PATH."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def shell_lines(path: Path) -> list[str]:
    """Every line of the file's bash code blocks."""
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", path.read_text(encoding="utf-8"), re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_no_command_runs_dvc_from_the_venv_without_activating_it():
    """dvc.yaml's stages call papermill from the PATH: `.venv/bin/dvc repro` in a fresh shell stops at
    'papermill: command not found'. The docs activate the environment or go through make."""
    found = [f"{p.name}: {line}" for p in DOCS for line in shell_lines(p) if re.search(r"\.venv/bin/dvc\b", line)]
    assert not found, found
    stage_cmds = re.findall(r"cmd: (.*)", (REPO / "dvc.yaml").read_text())
    assert stage_cmds and all("papermill " in c for c in stage_cmds)


def test_activating_the_environment_puts_the_pipelines_tools_on_a_bare_path():
    venv = REPO / ".venv"
    if not (venv / "bin" / "activate").is_file():
        pytest.skip("no .venv in this checkout (make test creates it)")
    done = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", "HOME=/tmp", "bash", "-c",
                           "source .venv/bin/activate && command -v papermill dvc python"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [Path(line).parent for line in done.stdout.split()] == [venv / "bin"] * 3
