"""The shape of the library and the pipeline: import graph, dvc deps and outs, one name per stage.

These tests read source and dvc.yaml only (no stage runs): a dvc stage that misses a file its notebook
imports or reads would let `dvc repro` report results that no longer match the code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml
from import_graph import (
    LIB, REPO, all_modules, closure, direct_imports, find_cycle, imports_in_source, module_file, stage_files,
)

from trace_lib.paths import STAGES, Paths, notebook, stage_outs

DVC = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


def _entries(items: list) -> list[str]:
    return [next(iter(i)) if isinstance(i, dict) else i for i in items]


def _covered(path: Path, deps: list[str]) -> bool:
    rel = path.relative_to(REPO)
    return any(rel == Path(d) or Path(d) in rel.parents for d in deps)


def test_dvc_has_the_nine_stages_in_order_each_running_its_own_notebook():
    assert list(DVC) == list(STAGES)
    for stage in STAGES:
        nb = notebook(stage)
        assert (REPO / nb).is_file(), nb
        assert f" {nb} " in DVC[stage]["cmd"] and str(nb) in _entries(DVC[stage]["deps"])


@pytest.mark.parametrize("stage", STAGES)
def test_stage_deps_cover_every_file_its_notebook_imports_or_reads(stage: str):
    deps = _entries(DVC[stage]["deps"])
    missing = sorted(str(p.relative_to(REPO)) for p in stage_files(REPO / notebook(stage)) if not _covered(p, deps))
    assert not missing, f"dvc.yaml stage {stage!r} misses deps: {missing}"
    earlier = {o for s in STAGES[: STAGES.index(stage)] for o in _entries(DVC[s].get("outs", []) + DVC[s].get("metrics", []))}
    absent = [d for d in deps if d not in earlier and not (REPO / d).exists()]
    assert not absent, f"{stage}: deps neither in the repo nor written by an earlier stage: {absent}"


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_depends_on_the_profile_and_seed(stage: str):
    params = _entries(DVC[stage].get("params", []))
    assert "params.yaml" in params or {"profile", "seed"} <= set(params), params


def test_every_param_a_stage_names_is_in_params_yaml():
    """dvc tracks params.yaml keys only; a key the profile sets but the file lacks stops `dvc repro`."""
    written = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    for stage, spec in DVC.items():
        for key in _entries(spec.get("params", [])):
            if key == "params.yaml":
                continue
            node = written
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, f"{stage}: params.yaml has no {key!r}"
                node = node[part]


def test_closure_follows_function_level_imports_and_module_strings():
    found = imports_in_source("def f():\n    from trace_lib.engine import policy\n"
                              "cmd = ['-m', 'trace_lib.synth.worker']\n", "")
    assert {"trace_lib", "trace_lib.engine", "trace_lib.engine.policy", "trace_lib.synth.worker"} <= found
    assert "trace_lib.config" in closure({"trace_lib.stages.rollout"})  # imported by what it imports
    assert imports_in_source('"""Written by trace_lib.stages.train."""\nx = "see trace_lib.io"\n', "") == set()


def test_a_missing_dep_is_reported(tmp_path: Path):
    files = stage_files(REPO / notebook("rollout"))
    prompt = LIB / "envs" / "retail" / "policy.md"
    assert prompt in files and (LIB / "config.py") in files and (LIB / "engine" / "kvcache.py") in files
    assert not _covered(prompt, ["trace_lib/engine", "trace_lib/config.py"])


@pytest.mark.parametrize("stage", STAGES)
def test_dvc_outs_are_the_paths_module(stage: str):
    """Each stage declares exactly the outputs trace_lib.paths names (plus its executed notebook)."""
    declared = {o for o in _entries(DVC[stage].get("outs", []) + DVC[stage].get("metrics", [])
                                    + DVC[stage].get("plots", []))
                if not o.startswith("reports/notebooks/")}
    assert declared == {str(p) for p in stage_outs(Paths(Path(".")))[stage]}
    assert f"reports/notebooks/{notebook(stage).name}" in _entries(DVC[stage]["outs"])


def test_no_import_cycles():
    assert find_cycle(all_modules()) is None, f"import cycle: {' -> '.join(find_cycle(all_modules()))}"


def test_stages_import_no_stage_and_packages_import_no_stage():
    for name in all_modules():
        bad = [m for m in direct_imports(name) if m.startswith("trace_lib.stages.")]
        if name.startswith("trace_lib.stages"):
            assert not bad, f"stage module {name} imports another stage: {bad}"
        else:
            assert not bad, f"{name} (a package) imports a stage: {bad}"


FLOORS = {
    "trace_lib.engine": ("trace_lib.config", "trace_lib.io", "trace_lib.records", "trace_lib.text"),
    "trace_lib.llm": ("trace_lib.config", "trace_lib.io", "trace_lib.records", "trace_lib.text", "trace_lib.engine"),
    "trace_lib.budget": ("trace_lib.io", "trace_lib.paths", "trace_lib.records"),
}
"""Lower floors and what each may import of the library (besides the `trace_lib` package itself and its own
modules): the engine knows nothing of the method, the LLM client and the budget sit below every stage."""
FORBIDDEN_BELOW = {"trace_lib.envs": ("trace_lib.synth", "trace_lib.analyst"),
                   "trace_lib.sandbox": ("trace_lib.envs", "trace_lib.synth", "trace_lib.analyst")}
"""Packages that must not import upward: the environments run below synthesis and the analyst; the sandbox below
everything it runs (the worker that speaks the synthesized-environment contract lives in `synth/`; `synth_sdk`
is matched by the `trace_lib.synth` prefix)."""


def _package_of(module: str) -> str:
    """`trace_lib.envs.retail.env` -> `trace_lib.envs`; a top-level module is its own package."""
    return ".".join(module.split(".")[:2])


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_cross_package_uses(source: str, module: str) -> list[str]:
    """`from pkg.mod import _x` and `mod._x` where `mod` is a trace_lib module of another package."""
    own = _package_of(module)
    bound: dict[str, str] = {}  # local name -> the trace_lib module it is bound to
    found = []
    nodes = list(ast.walk(ast.parse(source)))
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("trace_lib.") and a.asname:
                    bound[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trace_lib"):
            for a in node.names:
                target = f"{node.module}.{a.name}"
                if _private(a.name) and _package_of(node.module) != own:
                    found.append(f"{module}: from {node.module} import {a.name}")
                elif module_file(target):
                    bound[a.asname or a.name] = target
    for node in nodes:
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and _private(node.attr) and _package_of(bound[node.value.id]) != own):
            found.append(f"{module}: {bound[node.value.id]}.{node.attr}")
    return found


EDGES = ("trace_lib.stages", "trace_lib.config", "trace_lib.sweep", "trace_lib.notebook")
"""Modules that may read the whole `Params`: the stages, the config itself and the entry points that check a
params.yaml (sweeps, the notebook's setup)."""


def whole_params_uses(source: str, module: str) -> list[str]:
    """Where `source` takes the whole `Params`: imports of `Params`/`load_params`/`params_from_dict`, or a
    function parameter named `params` or annotated `Params` (a `**params` of keyword arguments and a
    `params: dict[...]` of JSON-schema properties are not)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "trace_lib.config":
            found += [f"{module}: imports {a.name}" for a in node.names
                      if a.name in ("Params", "load_params", "params_from_dict")]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                note = ast.unparse(a.annotation) if a.annotation else ""
                if note == "Params" or (a.arg == "params" and not note.startswith("dict")):
                    found.append(f"{module}: {node.name}({a.arg}: {note or '?'})")
    return found


def test_only_the_stages_take_the_whole_params():
    assert whole_params_uses("def f(params: Any, x): pass\n", "m") == ["m: f(params: Any)"]
    assert whole_params_uses("def f(cfg: Params): pass\ndef g(**params): pass\n", "m") == ["m: f(cfg: Params)"]
    found = [f for m in all_modules() if not any(_inside(m, e) for e in EDGES)
             for f in whole_params_uses(module_file(m).read_text(), m)]
    assert not found, "the whole Params below the stages:\n" + "\n".join(found)


def test_no_module_uses_a_private_name_of_another_package():
    assert private_cross_package_uses("from trace_lib.envs.retail import env as retail\nretail._Session()\n",
                                      "trace_lib.synth.world") == ["trace_lib.synth.world: trace_lib.envs.retail.env._Session"]
    assert private_cross_package_uses("from trace_lib.envs.retail.env import _x\n", "trace_lib.envs.tau2.env") == []
    found = [f for m in all_modules() for f in private_cross_package_uses(module_file(m).read_text(), m)]
    assert not found, "private names used across packages:\n" + "\n".join(found)


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_lower_floors_import_nothing_above_them():
    """Checked on imports written in code (module strings such as the worker's `-m` name are not imports)."""
    found = []
    for name in all_modules():
        for floor, allowed in FLOORS.items():
            if _inside(name, floor):
                found += [f"{name} imports {m}" for m in sorted(direct_imports(name, strings=False))
                          if m != "trace_lib" and not _inside(m, floor) and not any(_inside(m, a) for a in allowed)]
        for package, banned in FORBIDDEN_BELOW.items():
            if _inside(name, package):
                found += [f"{name} imports {m}" for m in sorted(direct_imports(name, strings=False))
                          if any(m.startswith(b) for b in banned)]
    assert not found, "imports across the floor order:\n" + "\n".join(found)


def test_the_sandbox_names_no_environment_even_as_a_string():
    """The sandbox runs what it is given: besides the SDK on its import allowlist and its default worker's
    module path, it names no module of the method, not even in a string a probe would import."""
    named = {m for name in all_modules() if _inside(name, "trace_lib.sandbox")
             for m in direct_imports(name, strings=True)}
    above = {m for m in named if any(m.startswith(b) for b in FORBIDDEN_BELOW["trace_lib.sandbox"])}
    assert above == {"trace_lib.synth", "trace_lib.synth.worker", "trace_lib.synth_sdk"}  # a module's parents count
    for path in sorted((LIB / "sandbox").rglob("*.py")):
        assert "trace_lib.envs" not in path.read_text(encoding="utf-8"), path


DECODING = ("generate", "generate_ids", "play_turns", "turn", "tool_processor")
"""`Policy` methods that decode a turn; the episode loop in `agent/` is the one place that calls them."""


def decoding_calls(source: str, module: str) -> list[str]:
    """Where `source` decodes: a call of a `DECODING` method, or an import of the assistant-turn parser (turning
    decoded text into an action is the episode loop's job too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DECODING:
            found.append(f"{module}:{node.lineno}: .{node.func.attr}(...)")
        elif isinstance(node, ast.ImportFrom) and node.module == "trace_lib.engine.chat":
            found += [f"{module}:{node.lineno}: imports {a.name}" for a in node.names if a.name == "parse_assistant"]
    return found


def test_decoding_calls_are_found():
    assert decoding_calls("x = policy.generate_ids([p], temperature=0)\n", "m") == ["m:1: .generate_ids(...)"]
    assert decoding_calls("from trace_lib.engine.chat import parse_assistant\n", "m") == ["m:1: imports parse_assistant"]
    assert decoding_calls("play(policy, episodes, cfg, seed=0)\nself.sampler.play(name)\n", "m") == []


def test_training_never_decodes():
    """`training/` turns recorded episodes into GRPO batches; every episode, sampled or scripted, is played by
    `agent/` (`agent/episode.py`), so a fix to the loop reaches training, evaluation and calibration alike."""
    found = [hit for name in sorted(all_modules()) if _inside(name, "trace_lib.training")
             for hit in decoding_calls(module_file(name).read_text(encoding="utf-8"), name)]
    assert not found, "decoding under training/:\n" + "\n".join(found)


def test_benchmarks_use_public_names_only():
    """A benchmark is a user of the library: it imports and touches no `_private` name of `trace_lib`."""
    found = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        found += private_cross_package_uses(path.read_text(encoding="utf-8"), f"benchmarks.{path.stem}")
    assert not found, "benchmarks use private names:\n" + "\n".join(found)


def test_one_run_function_per_stage_with_the_same_signature():
    for stage in STAGES:
        path = module_file(f"trace_lib.stages.{stage}")
        assert path is not None, f"trace_lib/stages/{stage}.py is missing"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        runs = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("run_")]
        assert [f.name for f in runs] == [f"run_{stage}"], (stage, [f.name for f in runs])
        assert [a.arg for a in runs[0].args.args] == ["params", "root"], stage


def test_every_module_opens_with_a_docstring():
    undocumented = [m for m in all_modules() if not ast.get_docstring(ast.parse(module_file(m).read_text()))]
    assert not undocumented, undocumented


def test_no_artifact_path_literals_outside_paths():
    """`data/...` and `reports/...` are spelled in trace_lib/paths.py only (config defaults aside)."""
    offenders = []
    for path in LIB.rglob("*.py"):
        if path.name == "paths.py" or path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in ("data", "reports"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders


def test_stages_read_the_prepared_model_from_the_working_directory():
    """A sweep runs stages under another root but shares the repo's prepared model (`model.out_dir` from
    the working directory); only prepare_model writes it under its root. A stage that looked for it
    under its root failed in a whole-pipeline sweep (`make phone`) at the train stage."""
    for stage in STAGES:
        if stage == "prepare_model":
            continue
        text = module_file(f"trace_lib.stages.{stage}").read_text(encoding="utf-8")
        assert not re.search(r"root\) ?/ ?(params\.)?model\.out_dir|root ?/ ?params\.model\.out_dir", text), stage


def test_no_dated_measurement_in_the_library():
    """Dated figures belong in docs/LOG.md and the benchmarks README; the library says what a thing is. An ISO
    timestamp (a date followed by 'T', as the phone's worlds use) is data, not a date of a run."""
    dated = re.compile(r"20\d\d-\d\d-\d\d(?!T)")
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in sorted(LIB.rglob("*"))
             if path.suffix in (".py", ".md") for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if dated.search(line)]
    assert not found, "dates in trace_lib (move the measurement to docs/LOG.md):\n" + "\n".join(found)


TIMING = re.compile(r"~ ?\d+(\.\d+)? ?(ms|µs|us|s|min)\b|\b\d+(\.\d+)? ?(ms|µs)\b|\d+(\.\d+)?x (faster|slower|longer)\b"
                    r"|[Mm]easured (on|in)\b|GFLOP")
"""A timing quoted as a measurement: '~35 ms', '0.23 ms', '1.5x slower', 'measured on', 'GFLOP/s'."""


def test_no_timing_in_the_library():
    """A timing belongs in `benchmarks/README.md` or the log, with its date and machine; the library says what a thing
    is and why it is so."""
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in sorted(LIB.rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if TIMING.search(line)]
    assert not found, "timings in trace_lib (move them to benchmarks/README.md or docs/LOG.md):\n" + "\n".join(found)
    assert TIMING.search("computing takes ~1 s") and TIMING.search("0.23 ms per row") and not TIMING.search("30 s")


def test_tests_mirror_the_library():
    """A module's tests lie in the folder of its package (`tests/engine/` for `trace_lib/engine/`), those of the
    top-level modules in `tests/`, and whole-pipeline runs in `tests/e2e/`."""
    tests = Path(__file__).resolve().parent
    packages = {p.parent.name for p in (tests.parent / "trace_lib").glob("*/__init__.py")}
    folders = {p.parent.name for p in tests.glob("*/test_*.py")}
    assert folders <= packages | {"e2e"}, folders - packages


def test_test_files_share_helpers_through_helper_modules_only():
    """A test file imports no other test file (not even inside a function or a script it writes): what tests
    share lies in a helper module at the top of `tests/` or in a `conftest.py`, the one folder on pytest's path."""
    import tomllib

    tests = Path(__file__).resolve().parent
    found = [f"{path.relative_to(tests)}:{i}" for path in sorted(tests.rglob("*.py"))
             for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.match(r"\s*(from test_\w+ import|import test_\w+)", line)]
    assert not found, found
    pytest_cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert pytest_cfg["pythonpath"] == ["tests"]


def test_each_environment_domain_is_one_folder_of_the_same_shape():
    """A domain is `envs/<name>/`: an `__init__.py` with the registry's entry points, `env.py`, a README; the
    registry names domain folders only."""
    from trace_lib.envs import _MODULES

    domains = sorted(set(_MODULES.values()))
    assert domains == ["trace_lib.envs.phone", "trace_lib.envs.retail", "trace_lib.envs.tau2"]
    for name in domains:
        folder = LIB / "envs" / name.rsplit(".", 1)[1]
        assert {"__init__.py", "env.py", "README.md"} <= {p.name for p in folder.iterdir()}, folder
        entry = {n.name for n in ast.walk(ast.parse((folder / "__init__.py").read_text()))
                 if isinstance(n, (ast.FunctionDef, ast.alias))}
        assert {"build_env", "build_tasks"} <= entry, folder
