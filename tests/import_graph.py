"""The import graph of trace_lib, read statically: what each module and each stage notebook really uses.

Used by tests/test_layout.py. Every `import` statement counts, at any depth (a function-level import
is still a dependency and can still close a cycle), and so does a string constant that is exactly a
trace module's name (`[..., "-m", "trace_lib.synth.worker"]`, `import_module("trace_lib.envs.retail.env")`);
prose that mentions a module (docstrings, messages) does not.
Importing `trace_lib.a.b` also runs `trace_lib/__init__.py` and `trace_lib/a/__init__.py`.
"""

from __future__ import annotations

import ast
import json
import re
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIB = REPO / "trace_lib"
_MODULE_STRING = re.compile(r"trace_lib(?:\.\w+)+")


def module_file(name: str) -> Path | None:
    """`trace_lib.a.b` -> trace_lib/a/b.py or trace_lib/a/b/__init__.py (None when neither exists)."""
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> list[str]:
    return sorted(module_name(p) for p in LIB.rglob("*.py") if "__pycache__" not in p.parts)


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imports_in_source(source: str, package: str, strings: bool = True) -> set[str]:
    """trace_lib modules named by the import statements (and, with `strings`, the module-name strings)
    of `source`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and _MODULE_STRING.fullmatch(node.value):
            names = [node.value]  # a module named as data: `-m trace_lib.synth.worker`, importlib strings
        for name in names:
            if name.split(".")[0] == "trace_lib":
                found.update(n for n in _with_parents(name) if module_file(n))
    return found


@lru_cache(maxsize=None)
def direct_imports(name: str, strings: bool = True) -> frozenset[str]:
    """What module `name` imports; with `strings`, also the modules it runs by name (a subprocess's
    `-m` target is a dependency of the stage, though not an import that can close a cycle)."""
    path = module_file(name)
    assert path is not None, name
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return frozenset(imports_in_source(path.read_text(encoding="utf-8"), package, strings) - {name})


def closure(roots: set[str]) -> set[str]:
    seen: set[str] = set()
    todo = [n for r in roots for n in _with_parents(r) if module_file(n)]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(direct_imports(name) - seen)
    return seen


def notebook_imports(path: Path) -> set[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return imports_in_source(source, "")


def data_files(modules: set[str]) -> set[Path]:
    """Files other than Python source that the modules' folders hold (prompts, templates, policies):
    those next to a module, and everything in a sub-folder that is not itself a package."""
    out: set[Path] = set()
    for name in modules:
        folder = module_file(name).parent
        for path in folder.iterdir():
            if path.is_file() and path.suffix not in (".py", ".pyc"):
                out.add(path)
            elif path.is_dir() and path.name != "__pycache__" and not (path / "__init__.py").exists():
                out.update(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return out


def stage_files(notebook: Path) -> set[Path]:
    """Every library file a stage notebook runs or reads: its import closure plus their data files."""
    modules = closure(notebook_imports(notebook))
    return {module_file(m) for m in modules} | data_files(modules)


def find_cycle(modules: list[str]) -> list[str] | None:
    """One import cycle among `modules` (as a path a -> b -> ... -> a), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for nxt in sorted(direct_imports(name, strings=False)):
            # a package's __init__ importing its own submodule is how re-exports work, not a cycle
            if name == nxt.rpartition(".")[0] and module_file(name).name == "__init__.py":
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[name] = 2
        return None

    for name in modules:
        if name not in state and (found := visit(name)):
            return found
    return None
