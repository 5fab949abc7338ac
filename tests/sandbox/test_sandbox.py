"""trace_lib.sandbox: static checks, and the worker process's defenses.

The process tests load `synth_fixtures/probe_host.py` (hostile on purpose) with `trusted=True`, so
they exercise the process-level fences without the static check or the builtins fence in front.
Each sandbox start costs ~1-2 s (the worker imports tau2), so starts are kept few.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from toy import CONTRACT_STUB as CONTRACT

from trace_lib.config import ValidationConfig
from trace_lib.sandbox import (
    ALLOWED_IMPORTS,
    SandboxError,
    SandboxLimits,
    SandboxProcess,
    check_source,
    child_env,
    limits_from_config,
    network_isolation,
    nproc_limit_works,
)

FIXTURES = Path(__file__).parents[1] / "synth_fixtures"
PROBE = FIXTURES / "probe_host.py"


# --- static checks ------------------------------------------------------------------------------
def test_allowed_imports():
    assert {"json", "random", "re", "dataclasses", "trace_lib.synth_sdk", "tau2.domains"} <= ALLOWED_IMPORTS
    assert not {"os", "sys", "subprocess", "socket", "importlib", "pathlib", "shutil"} & ALLOWED_IMPORTS


def test_contract_stub_passes():
    assert check_source(CONTRACT) == []
    assert check_source((FIXTURES / "good_lookup.py").read_text()) == []


@pytest.mark.parametrize("line, expected", [
    ("import os", "line 11: import of 'os' is not allowed"),
    ("import os.path as p", "import of 'os.path'"),
    ("from subprocess import run", "import from 'subprocess'"),
    ("import socket", "import of 'socket'"),
    ("import importlib", "import of 'importlib'"),
    ("import builtins", "import of 'builtins'"),
    ("from . import helper", "relative imports"),
    ("from trace_lib import config", "import from 'trace_lib'"),
    ("from trace_lib.synth_sdk import _retail", "private name '_retail'"),
    ("import trace_lib.synth_sdk", "binds the whole 'trace_lib' package"),
    ("x = __import__('os')", "'__import__'"),
    ("x = open('f', 'w')", "the builtin 'open'"),
    ("x = eval('1')", "the builtin 'eval'"),
    ("f = exec", "the builtin 'exec'"),
    ("x = compile('1', 'f', 'eval')", "the builtin 'compile'"),
    ("x = globals()", "the builtin 'globals'"),
    ("x = vars()", "the builtin 'vars'"),
    ("breakpoint()", "the builtin 'breakpoint'"),
    ("x = input()", "the builtin 'input'"),
    ("x = getattr(int, '__subclasses__')", "getattr() of '__subclasses__'"),
    ("setattr(int, '__bases__', ())", "setattr() of '__bases__'"),
    ("x = ().__class__", "attribute '__class__'"),
    ("x = (lambda: 0).__globals__", "attribute '__globals__'"),
    ("x = object.__subclasses__()", "attribute '__subclasses__'"),
    ("x = __builtins__", "the name '__builtins__'"),
    ("x = __loader__", "the name '__loader__'"),
    ("import random\nx = random._os", "private attribute '_os'"),
    ("x = '{0.__class__}'.format(1)", "mentions '__class__'"),
    ("import typing\nx = typing.sys", "attribute 'sys'"),
    ("import string\nx = string.Formatter().get_field", "attribute 'get_field'"),
])
def test_check_source_rejects(line, expected):
    problems = check_source(CONTRACT + line + "\n")
    assert any(expected in p for p in problems), problems


def test_check_source_allows_ordinary_code():
    ok = CONTRACT + (
        "import json, random, re, math\nfrom dataclasses import dataclass\nfrom trace_lib import synth_sdk\n"
        "from trace_lib.synth_sdk import ToolError\nimport trace_lib.synth_sdk as sdk\n"
        "from tau2.domains.retail.data_model import RetailDB\n"
        "class W:\n    def __init__(self):\n        self._x = 1\n    def __repr__(self):\n        return str(self._x)\n"
        "if __name__ == '__main__':\n    pass\nx = getattr(W(), 'name', None)\n"
    )
    assert check_source(ok) == []


def test_check_source_syntax_error_and_missing_names():
    problems = check_source("x = 1\ndef f(:\n")
    assert len(problems) == 1 and problems[0].startswith("line 2: syntax error")
    problems = check_source("CAPABILITY = 'c'\n")
    assert "missing contract name 'generate_task' (define it at module level)" in problems
    assert not any("'CAPABILITY'" in p for p in problems)


def test_child_env_drops_secrets_and_proxies():
    parent = {"PATH": "/bin", "ANTHROPIC_API_KEY": "sk-secret", "HF_TOKEN": "hf", "HTTPS_PROXY": "http://p",
              "http_proxy": "http://p", "AWS_SECRET_ACCESS_KEY": "a", "HOME": "/root"}
    env = child_env(parent, scratch="/tmp/s")
    assert env["PATH"] == "/bin" and env["HF_HUB_OFFLINE"] == "1" and env["PYTHONHASHSEED"] == "0"
    assert env["HOME"] == env["TMPDIR"] == "/tmp/s"
    assert not {"ANTHROPIC_API_KEY", "HF_TOKEN", "HTTPS_PROXY", "http_proxy", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert Path(env["PYTHONPATH"], "trace_lib", "sandbox", "__init__.py").is_file()


def test_child_env_keeps_the_parents_import_path_after_trace(tmp_path):
    # packages installed onto a path (pip install --target, as on a GPU node) must load in the worker too;
    # relative entries (they would resolve in the worker's scratch), missing folders and the scratch do not
    site, more, scratch = tmp_path / "site", tmp_path / "more", tmp_path / "scratch"
    for folder in (site, more, scratch / "x"):
        folder.mkdir(parents=True)
    given = os.pathsep.join([str(site), "", ".", "rel", "/no/such/dir", str(more), str(scratch / "x")])
    env = child_env({"PYTHONPATH": given, "HF_TOKEN": "x"}, scratch=str(scratch))
    root, *rest = env["PYTHONPATH"].split(os.pathsep)
    assert Path(root, "trace_lib", "sandbox", "__init__.py").is_file()
    assert rest == [str(site), str(more)] and "HF_TOKEN" not in env


def test_nproc_limit_only_where_the_kernel_enforces_it():
    if os.geteuid() == 0:  # root is exempt from RLIMIT_NPROC; the worker's os.fork fence covers it
        assert not nproc_limit_works()
    else:
        assert nproc_limit_works()


def test_limits_from_config():
    limits = limits_from_config(ValidationConfig(timeout_s=7, cpu_s=9, memory_mb=1500))
    assert (limits.timeout_s, limits.cpu_s, limits.memory_mb) == (7, 9, 1500)


# --- the process ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def probe():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ANTHROPIC_API_KEY", "sk-must-not-leak")
        mp.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
        box = SandboxProcess(PROBE, SandboxLimits(timeout_s=10, memory_mb=2048, cpu_s=60), trusted=True)
    yield box
    box.close()


def _probe(box: SandboxProcess, seed: int) -> dict:
    return box.request("generate_task", seed=seed, difficulty=1)["meta"]


def test_worker_sees_no_secrets_and_runs_in_scratch(probe):
    seen = _probe(probe, 0)
    assert "ANTHROPIC_API_KEY" not in seen["env"] and "HTTPS_PROXY" not in seen["env"]
    assert seen["env"]["HF_HUB_OFFLINE"] == "1"
    assert os.path.realpath(seen["cwd"]) == os.path.realpath(probe.scratch)


def test_rlimits_and_session(probe):
    seen = _probe(probe, 9)
    assert seen["as"] == 2048 * 2**20 and seen["cpu"] == 60 and seen["fsize"] == 16 * 2**20
    assert seen["session_leader"]
    assert probe.nproc_limited == nproc_limit_works()


def test_network_is_blocked(probe):
    seen = _probe(probe, 1)
    assert seen["patched"].startswith("PermissionError")
    assert probe.isolation == ("unshare" if network_isolation() else "socket-patch")
    if probe.isolation == "unshare":  # even the raw C socket finds no route
        assert seen["raw"].startswith("OSError") and "unreachable" in seen["raw"].lower()


def test_processes_are_blocked(probe):
    seen = _probe(probe, 2)
    assert all(v.startswith("PermissionError") for v in seen.values()), seen


def test_files_only_in_scratch(probe):
    seen = _probe(probe, 3)
    assert seen["outside"].startswith("PermissionError") and seen["remove_outside"].startswith("PermissionError")
    assert seen["inside"] == "ok: 1"
    assert not Path("/tmp/trace-sandbox-escape.txt").exists()
    assert (Path(probe.scratch) / "inside.txt").is_file()


def test_module_errors_are_not_fatal(probe):
    with pytest.raises(SandboxError, match=r"generate_task: raised ValueError: boom \(module line \d+") as err:
        probe.request("generate_task", seed=8, difficulty=1)
    assert not err.value.fatal
    with pytest.raises(SandboxError, match="generate_task: returned a value that is not JSON-serialisable"):
        probe.request("generate_task", seed=6, difficulty=1)
    with pytest.raises(SandboxError, match="unknown episode handle"):
        probe.request("call_tool", handle="nope", name="x", arguments={})
    assert probe.alive and _probe(probe, 0)["cwd"]


@pytest.mark.parametrize("seed, message, tail", [
    (5, r"timed out after 2s in generate_task", "looping forever"),
    (4, r"worker exited with code 7 in generate_task", "about to die"),
    (7, r"reply of generate_task exceeds 8000000 bytes", None),
])
def test_fatal_failures_kill_and_clean_up(seed, message, tail):
    box = SandboxProcess(PROBE, SandboxLimits(timeout_s=2), trusted=True)
    start = time.monotonic()
    with pytest.raises(SandboxError, match=message) as err:
        box.request("generate_task", seed=seed, difficulty=1)
    assert time.monotonic() - start < 2 + 8  # the deadline holds; the parent never hangs
    assert err.value.fatal
    if tail:
        assert tail in str(err.value)  # the stderr tail comes with the error
    assert box._proc.poll() is not None and not box.alive
    assert not Path(box.scratch).exists()
    with pytest.raises(SandboxError, match="sandbox is closed"):
        box.request("meta")
    box.close()
    box.close()  # idempotent


def test_load_runs_the_static_check():
    with pytest.raises(SandboxError, match="load: static check failed: line 6: import of 'os'"):
        SandboxProcess(PROBE, SandboxLimits(timeout_s=10))
