"""Run untrusted synthesized environment modules: static checks, then a locked-down subprocess.

Reads a module's source (`data/envs/<capability>/attempts/NN.py` or `env.py`); writes nothing but a
scratch folder that is removed on close. Paper §3.2 has an LLM write each training environment as
code; before such code is used for validation or training it must not be able to touch the host.
Two layers:

* `check_source` (static, in the parent, nothing runs): imports outside `ALLOWED_IMPORTS`, forbidden
  builtins (`open`, `exec`, `eval`, ...), dunder introspection (`__globals__`, `__subclasses__`, ...)
  and missing contract names (see `trace_lib.synth_sdk`) are rejected with a line number each.
* `SandboxProcess` (dynamic): the module is imported only inside a worker process (`WORKER`, `python -m`),
  started in a new session with a scratch cwd, a minimal environment (no API keys, no proxies),
  rlimits on address space, CPU time and file size, its own empty network namespace when `unshare`
  permits it, and a worker that fences the module's builtins and the host's process / network / file
  functions. The parent talks JSON lines over pipes with a wall-clock deadline per request, kills the
  process group on a timeout, a crash or an oversized reply, and raises `SandboxError`; it never hangs
  and never imports the module.

What this does not give: in-process Python fences stop accidents and naive escapes, not a determined
adversary (CPython offers no in-process sandbox), and the worker runs as the same user with the same
view of the filesystem. What holds regardless is the process boundary: no network (with `unshare`),
no secrets in the environment, bounded memory, CPU and file size, and a kill on every deadline. For
modules from an untrusted LLM, run the pipeline in a container or as an unprivileged user.
"""

from __future__ import annotations

import ast
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from trace_lib.config import ValidationConfig

STDLIB_IMPORTS = frozenset({
    "__future__", "abc", "collections", "copy", "dataclasses", "datetime", "decimal", "enum",
    "fractions", "functools", "hashlib", "itertools", "json", "math", "operator", "random", "re",
    "statistics", "string", "textwrap", "typing",
})
ALLOWED_IMPORTS = STDLIB_IMPORTS | {"trace_lib.synth_sdk", "tau2.domains"}
"""Top-level standard modules a module may import, plus two package prefixes (dotted entries)."""

CONTRACT_NAMES = ("CAPABILITY", "TARGET", "DIFFICULTY", "tool_schemas", "generate_task", "init_state",
                  "call_tool", "evaluate", "solve")
"""Module-level names every synthesized module defines (the contract in `trace_lib.synth_sdk`)."""
CONTRACT_FUNCTIONS = CONTRACT_NAMES[3:]

FORBIDDEN_BUILTINS = frozenset({"open", "exec", "eval", "compile", "__import__", "globals", "locals", "vars",
                                "breakpoint", "input", "memoryview", "help", "exit", "quit"})
ATTR_BUILTINS = frozenset({"getattr", "setattr", "delattr", "hasattr"})
# Dunders a module may touch; everything else (`__class__`, `__globals__`, `__dict__`, ...) is the
# usual way out of a Python sandbox, so it is rejected rather than enumerated.
ALLOWED_DUNDERS = frozenset({
    "__name__", "__doc__", "__init__", "__post_init__", "__all__", "__repr__", "__str__", "__eq__", "__ne__",
    "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__len__", "__iter__", "__next__", "__contains__",
    "__getitem__", "__setitem__", "__bool__", "__enter__", "__exit__",
})
# Frame / code internals reachable without dunders, modules that allowed modules re-export
# (`typing.sys`), and `string.Formatter.get_field`, which walks dotted paths to real objects.
FORBIDDEN_ATTRS = frozenset({"tb_frame", "tb_next", "f_globals", "f_locals", "f_builtins", "f_back", "f_code",
                             "gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "co_code",
                             "mro", "sys", "os", "posix", "modules", "builtins", "subprocess", "socket",
                             "importlib", "get_field"})
DANGEROUS_DUNDERS = ("__subclasses__", "__globals__", "__builtins__", "__code__", "__class__", "__bases__",
                     "__mro__", "__loader__", "__spec__", "__dict__", "__import__", "__getattribute__",
                     "__closure__", "__func__", "__self__", "__reduce__", "__traceback__", "__base__")
"""Names also rejected inside string constants ("{0.__class__}".format(x) reaches them without an attribute)."""


WORKER = "trace_lib.synth.worker"
"""The worker module a `SandboxProcess` starts by default: the synthesized-environment contract's server. Named as
data, never imported here, so the sandbox stays below what it runs."""


class SandboxError(RuntimeError):
    """A sandbox request failed: timeout, worker death, oversized reply, or the module raised.

    `fatal` is True when the worker was killed or died (the sandbox cannot be used any more)."""

    def __init__(self, reason: str, fatal: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fatal = fatal


# --- static checks ----------------------------------------------------------------------------
def is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def import_allowed(name: str) -> bool:
    """Whether `import name` is allowed: an allowed standard module (or its submodule) or a package prefix."""
    if name.split(".")[0] in STDLIB_IMPORTS:
        return True
    return any("." in p and (name == p or name.startswith(p + ".")) for p in ALLOWED_IMPORTS)


def from_import_allowed(module: str, names: list[str]) -> bool:
    """`from module import names`: the module itself, or each `module.name`, must be allowed."""
    if import_allowed(module):
        return True
    return bool(names) and "*" not in names and all(import_allowed(f"{module}.{n}") for n in names)


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _node_problems(node: ast.AST) -> list[str]:
    line = getattr(node, "lineno", "?")
    out: list[str] = []
    if isinstance(node, ast.Import):
        for a in node.names:
            if not import_allowed(a.name):
                out.append(f"line {line}: import of '{a.name}' is not allowed")
            elif "." in a.name and a.name.split(".")[0] not in STDLIB_IMPORTS and a.asname is None:
                # `import trace_lib.synth_sdk` binds the whole `trace_lib` package, and every module under it
                head, _, tail = a.name.rpartition(".")
                out.append(f"line {line}: 'import {a.name}' binds the whole '{a.name.split('.')[0]}' package; "
                           f"write 'from {head} import {tail}' or 'import {a.name} as {tail}'")
    elif isinstance(node, ast.ImportFrom):
        names = [a.name for a in node.names]
        if node.level:
            out.append(f"line {line}: relative imports are not allowed")
        elif not from_import_allowed(node.module or "", names):
            out.append(f"line {line}: import from '{node.module}' is not allowed")
        out += [f"line {line}: importing the private name '{n}' is not allowed" for n in names if n.startswith("_")]
    elif isinstance(node, ast.Name):
        if node.id in FORBIDDEN_BUILTINS - {"input"}:
            out.append(f"line {line}: the builtin '{node.id}' is not allowed")
        elif is_dunder(node.id) and node.id not in ALLOWED_DUNDERS:
            out.append(f"line {line}: the name '{node.id}' is not allowed")
    elif isinstance(node, ast.Attribute):
        if (is_dunder(node.attr) and node.attr not in ALLOWED_DUNDERS) or node.attr in FORBIDDEN_ATTRS:
            out.append(f"line {line}: access to the attribute '{node.attr}' is not allowed")
        elif (node.attr.startswith("_") and not is_dunder(node.attr)
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            # `random._os`, `synth_sdk._retail`: private names of other objects lead out of the fence
            out.append(f"line {line}: access to the private attribute '{node.attr}' is not allowed "
                       "(only on self / cls)")
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "input":
            out.append(f"line {line}: the builtin 'input' is not allowed")
        if node.func.id in ATTR_BUILTINS and len(node.args) >= 2:
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and (
                    (is_dunder(arg.value) and arg.value not in ALLOWED_DUNDERS) or arg.value in FORBIDDEN_ATTRS):
                out.append(f"line {line}: {node.func.id}() of '{arg.value}' is not allowed")
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        out += [f"line {line}: a string mentions '{d}', which is not allowed" for d in DANGEROUS_DUNDERS
                if d in node.value]
    return out


def check_source(source: str) -> list[str]:
    """Problems that forbid running `source` as a synthesized environment (empty: none found).

    A first filter, not the security boundary: the worker also fences the module at run time."""
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        return [f"line {err.lineno}: syntax error: {err.msg}"]
    problems: list[str] = []
    for node in ast.walk(tree):
        problems += _node_problems(node)
    defined = _top_level_names(tree)
    problems += [f"missing contract name '{n}' (define it at module level)" for n in CONTRACT_NAMES if n not in defined]
    return list(dict.fromkeys(problems))


# --- limits and the child's environment -------------------------------------------------------
@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox process."""

    timeout_s: float = 30.0
    """Wall time per request before the worker is killed."""
    cpu_s: int = 120
    """CPU seconds over the process's life (RLIMIT_CPU)."""
    memory_mb: int = 2048
    """Address space (RLIMIT_AS). The worker's own imports (tau2, pandas, pyarrow) reserve ~1.5 GB of
    it, mostly never touched, so this is far above the worker's resident size."""
    fsize_mb: int = 16
    """Largest file the process may write (RLIMIT_FSIZE); its stderr log included."""
    max_reply_bytes: int = 8_000_000
    """A longer reply line kills the worker (a runaway result must not exhaust the parent)."""
    startup_timeout_s: float = 90.0
    """Wall time for the worker's own imports and the target database, before any module code runs."""


def limits_from_config(cfg: ValidationConfig) -> SandboxLimits:
    """The sandbox limits of the `synthesize.validation` params section."""
    return SandboxLimits(timeout_s=cfg.timeout_s, cpu_s=cfg.cpu_s, memory_mb=cfg.memory_mb)


_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


def child_env(parent: dict[str, str] | None = None, scratch: str | None = None) -> dict[str, str]:
    """The worker's whole environment: a few harmless variables of `parent` plus fixed settings.

    Everything else is dropped, API keys (ANTHROPIC_API_KEY, HF_TOKEN, ...) and proxies included."""
    parent = dict(os.environ) if parent is None else parent
    env = {k: parent[k] for k in _KEEP_ENV if k in parent}
    env.setdefault("PATH", "/usr/bin:/bin")
    package_root = str(Path(__file__).resolve().parents[2])
    # site-packages come from the interpreter (the venv) itself; the parent's own PYTHONPATH entries follow
    # trace's root, so packages installed onto a path (`pip install --target`, cluster modules) load too.
    # Only existing absolute folders outside the scratch: a relative entry ('', '.') would resolve in the
    # worker's cwd, the scratch the module may write to, and shadow the standard library
    extra = [p for p in parent.get("PYTHONPATH", "").split(os.pathsep)
             if os.path.isabs(p) and os.path.isdir(p) and p != package_root
             and not (scratch and Path(p).resolve().is_relative_to(Path(scratch).resolve()))]
    env.update({
        "PYTHONPATH": os.pathsep.join([package_root, *extra]),
        "PYTHONHASHSEED": "0",  # set/dict order of strings repeats across processes
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONIOENCODING": "utf-8",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OPENBLAS_NUM_THREADS": "1",  # no helper threads (they would also count against RLIMIT_NPROC)
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NO_COLOR": "1",
        "LOGURU_LEVEL": "ERROR",  # tau2's import-time warnings would crowd the stderr tail of errors
    })
    if scratch is not None:
        env.update({"HOME": scratch, "TMPDIR": scratch})
    return env


@lru_cache(maxsize=1)
def network_isolation() -> tuple[str, ...]:
    """Command prefix that gives the worker an empty network namespace, or () where none is permitted.

    Probed once per process: `unshare -n` (root / CAP_SYS_ADMIN), then `unshare -rn` (unprivileged
    user namespaces)."""
    if shutil.which("unshare") is None:
        return ()
    for prefix in (("unshare", "-n"), ("unshare", "-rn")):
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return prefix
    return ()


@lru_cache(maxsize=None)
def nproc_limit_works(worker: str = WORKER) -> bool:
    """Whether RLIMIT_NPROC=0 forbids forking without breaking the imports of `worker` (a module path).

    Root is exempt from RLIMIT_NPROC (the kernel ignores it), so it is not set there; elsewhere a
    probe imports `worker`, runs its `preload()` if it has one, under the limit, and must then fail to fork."""
    if os.geteuid() == 0:
        return False
    code = (f"import importlib, os\nm = importlib.import_module({worker!r})\n"
            "getattr(m, 'preload', lambda: None)()\n"
            "try:\n    os.fork()\nexcept OSError:\n    raise SystemExit(0)\nos._exit(3)\n")
    try:
        probe = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, timeout=120,
                               preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NPROC, (0, 0)))
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def _rlimits(limits: SandboxLimits, nproc: bool):
    """The `preexec_fn` of the worker: plain setrlimit calls on precomputed values (it runs between
    fork and exec, where a multi-threaded parent must not take locks)."""
    mem = limits.memory_mb * 1024 * 1024
    fsize = limits.fsize_mb * 1024 * 1024
    cpu = (limits.cpu_s, limits.cpu_s + 2)  # SIGXCPU first, SIGKILL two seconds later

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, cpu)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

    return apply


# --- the process --------------------------------------------------------------------------------
class SandboxProcess:
    """One worker process serving one module; a context manager. See the module docstring.

    `trusted=True` skips the static check and the module's builtins fence on load; only tests use
    it, to show that the process-level defenses hold for code that got past the Python-level ones.
    `worker`: the module started with `python -m` that loads the module and serves its requests."""

    def __init__(self, module_path: str | Path, limits: SandboxLimits | None = None, *,
                 trusted: bool = False, worker: str = WORKER) -> None:
        self.module_path = Path(module_path).resolve()
        self.limits = limits or SandboxLimits()
        self._lock = threading.Lock()
        self._closed: str | None = None
        self._next_id = 0
        self._handles = 0
        self._released: list[str] = []
        self.scratch = tempfile.mkdtemp(prefix="trace-sandbox-")
        self._stderr = tempfile.TemporaryFile()
        prefix = network_isolation()
        nproc = nproc_limit_works(worker)
        self.isolation = "unshare" if prefix else "socket-patch"
        """'unshare' (own empty network namespace) or 'socket-patch' (the worker's socket functions
        raise); the worker patches sockets in both cases."""
        self.nproc_limited = nproc
        """Whether RLIMIT_NPROC forbids forking (never for root, which the kernel exempts)."""
        # -P: the scratch cwd is not put on sys.path, so files written there can never shadow a module
        cmd = [*prefix, sys.executable, "-P", "-m", worker]
        try:
            self._proc = subprocess.Popen(
                cmd, cwd=self.scratch, env=child_env(scratch=self.scratch), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=self._stderr, start_new_session=True,
                preexec_fn=_rlimits(self.limits, nproc), close_fds=True)
            self._buffer = b""
            os.set_blocking(self._proc.stdin.fileno(), False)  # a stuck worker must not block our writes
            ready = self._await_reply("startup", self.limits.startup_timeout_s)
            if not ready.get("ready"):
                self._fail(str(ready.get("error", "worker did not start")))
            self.meta: dict[str, Any] = self.request("load", path=str(self.module_path), trusted=trusted)
        except BaseException:
            self.close()
            raise

    # --- RPC ---------------------------------------------------------------------------------
    def request(self, method: str, **params: Any) -> Any:
        """Call `method` in the worker and return its JSON result; SandboxError on any failure."""
        with self._lock:
            if self._closed is not None:
                raise SandboxError(f"sandbox is closed ({self._closed}); cannot run {method}", fatal=True)
            self._next_id += 1
            line = json.dumps({"id": self._next_id, "method": method, "params": params}) + "\n"
            self._send(line.encode("utf-8"), method)
            reply = self._await_reply(method, self.limits.timeout_s)
            if reply.get("id") != self._next_id:
                self._fail(f"protocol error in {method}: reply to request {reply.get('id')}, "
                           f"expected {self._next_id}")
            if not reply.get("ok"):
                raise SandboxError(f"{method}: {reply.get('error', 'unknown error')}")
            return reply.get("result")

    def new_handle(self) -> str:
        """A fresh episode handle (the worker keeps one state per handle)."""
        with self._lock:
            self._handles += 1
            return f"h{self._handles}"

    def release(self, handle: str) -> None:
        """Queue `handle`'s state for freeing with the next `init` request. No I/O and no lock, so a
        garbage-collector finalizer may call it at any point, even inside `request`."""
        self._released.append(handle)

    def take_released(self) -> list[str]:
        """The queued handles, emptying the queue (pass them as `init`'s `release`)."""
        taken, self._released = self._released, []
        return taken

    def _send(self, data: bytes, method: str) -> None:
        deadline = time.monotonic() + self.limits.timeout_s
        fd = self._proc.stdin.fileno()
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"timed out after {self.limits.timeout_s:g}s sending {method}")
            try:
                _, ready, _ = select.select([], [fd], [], left)
                if ready:
                    view = view[os.write(fd, view[: 65536]):]
            except BlockingIOError:
                continue
            except OSError:  # broken pipe: the worker is gone
                self._fail(self._death_reason(method))

    def _await_reply(self, method: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"timed out after {timeout:g}s in {method}")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._fail(self._death_reason(method))
            self._buffer += chunk
            if len(self._buffer) > self.limits.max_reply_bytes and b"\n" not in self._buffer:
                self._fail(f"reply of {method} exceeds {self.limits.max_reply_bytes} bytes")
        line, _, self._buffer = self._buffer.partition(b"\n")
        if len(line) > self.limits.max_reply_bytes:
            self._fail(f"reply of {method} exceeds {self.limits.max_reply_bytes} bytes")
        try:
            return json.loads(line)
        except ValueError:
            self._fail(f"protocol error in {method}: reply is not JSON: {line[:200]!r}")
            raise AssertionError("unreachable")  # _fail raises

    # --- failure and shutdown ----------------------------------------------------------------
    def _death_reason(self, method: str) -> str:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return f"worker closed its output in {method}"
        if code < 0:
            sig = -code
            why = {signal.SIGXCPU: f", CPU limit of {self.limits.cpu_s}s",
                   signal.SIGKILL: f", likely the memory limit of {self.limits.memory_mb} MB or the CPU limit",
                   signal.SIGXFSZ: f", file size limit of {self.limits.fsize_mb} MB (too much output?)",
                   signal.SIGSEGV: f", possibly the memory limit of {self.limits.memory_mb} MB",
                   signal.SIGABRT: f", possibly the memory limit of {self.limits.memory_mb} MB"}.get(sig, "")
            return f"worker died ({signal.strsignal(sig) or sig}, signal {sig}{why}) in {method}"
        return f"worker exited with code {code} in {method}"

    def _fail(self, reason: str) -> None:
        self._kill()
        tail = self.stderr_tail()
        message = f"{reason}; worker stderr tail:\n{tail}" if tail.strip() else reason
        self._closed = reason
        self._cleanup()
        raise SandboxError(message, fatal=True)

    def stderr_tail(self, chars: int = 2000) -> str:
        """The last `chars` characters the worker (and the module's prints) wrote to stderr."""
        try:
            self._stderr.flush()
            size = self._stderr.seek(0, os.SEEK_END)
            self._stderr.seek(max(0, size - chars))
            return self._stderr.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    def _kill(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def _cleanup(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None:
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
        shutil.rmtree(self.scratch, ignore_errors=True)

    def close(self) -> None:
        """Kill the worker's process group (it holds nothing worth flushing) and remove the scratch folder."""
        if self._closed is not None and getattr(self, "_stderr", None) is None:
            return
        self._kill()
        self._cleanup()
        if self._closed is None:
            self._closed = "closed"
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    @property
    def alive(self) -> bool:
        return self._closed is None and self._proc.poll() is None

    def __enter__(self) -> SandboxProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: best effort only
            pass
