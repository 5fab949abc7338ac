"""The sandbox worker: imports one synthesized environment module and serves its contract over pipes.

Started only by `trace_lib.sandbox.SandboxProcess` (`python -m trace_lib.synth.worker`), already
under rlimits, in a scratch cwd and, where permitted, an empty network namespace. Reads JSON-line
requests `{"id", "method", "params"}` on stdin; writes one JSON-line reply per request,
`{"id", "ok": true, "result"}` or `{"id", "ok": false, "error"}`, on a private copy of the original
stdout. Paper §3.2: this is where LLM-written environment code runs, so before the module is
imported the worker

* points fd 1 and `sys.stdout` at stderr, so a module's prints never corrupt the protocol;
* loads the target's database and tool definitions (trusted code, before any fence is up);
* fences the host: socket connect/bind and name lookup raise, process creation and killing raise,
  files can be written only under the scratch cwd;
* executes the module with its own builtins: no `open`/`exec`/`eval`/`compile`, an `__import__`
  that enforces `trace_lib.sandbox.ALLOWED_IMPORTS`, and `getattr`-style builtins that refuse dunder
  names (the run-time half of the static check).

Methods: load, meta, tool_schemas, generate_task, init, call_tool, evaluate, solve, drop. A method
that raises is answered with an error naming it; `call_tool` turns exceptions into error text. The
worker exits on EOF.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import sys
import traceback
import types
from pathlib import Path
from typing import Any

MODULE_NAME = "trace_synth_env"
"""The fixed name the module is imported under (never the name of anything real)."""


class WorkerError(Exception):
    """A request the worker refuses (bad handle, wrong return type); the message is the reply."""


# --- fences ------------------------------------------------------------------------------------
def _denied(what: str):
    def deny(*args: Any, **kwargs: Any):
        raise PermissionError(f"{what} is not allowed in the sandbox")

    deny.__name__ = f"denied_{what.replace(' ', '_')}"
    return deny


_PROCESS_FUNCS = ("system", "popen", "fork", "forkpty", "vfork", "execv", "execve", "execvp", "execvpe", "execl",
                  "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle",
                  "posix_spawn", "posix_spawnp", "kill", "killpg", "setuid", "setgid", "chroot", "putenv",
                  "unsetenv")
_PATH_FUNCS = ("remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "chmod", "chown",
               "lchown", "symlink", "link", "truncate", "mkfifo", "mknod", "mkdir", "makedirs", "utime")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _inside(path: Any, root: str) -> bool:
    if isinstance(path, int):  # an already-open descriptor: opening it was checked
        return True
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return real == root or real.startswith(root + os.sep)


def fence_host(scratch: str) -> None:
    """Make the host's network, process and file-writing functions refuse (see the module docstring)."""
    import posix
    import socket
    import subprocess

    for name in ("connect", "connect_ex", "bind", "sendto", "sendmsg"):
        setattr(socket.socket, name, _denied(f"socket.{name}"))
    for name in ("create_connection", "create_server", "getaddrinfo", "gethostbyname", "gethostbyname_ex",
                 "socketpair", "fromfd"):
        if hasattr(socket, name):
            setattr(socket, name, _denied(f"socket.{name}"))
    subprocess.Popen._execute_child = _denied("subprocess")
    try:
        import _posixsubprocess

        _posixsubprocess.fork_exec = _denied("process creation")
    except ImportError:
        pass
    root = os.path.realpath(scratch)
    for mod in (os, posix):
        for name in _PROCESS_FUNCS:
            if hasattr(mod, name):
                setattr(mod, name, _denied(f"os.{name}"))
        for name in _PATH_FUNCS:
            if hasattr(mod, name):
                setattr(mod, name, _scratch_only(getattr(mod, name), root, f"os.{name}"))
        mod.open = _scratch_only_flags(mod.open, root)
    builtins.open = io.open = _scratch_only_mode(io.open, root)


def _scratch_only(func, root: str, what: str):
    def guarded(path: Any, *args: Any, **kwargs: Any):
        if not _inside(path, root) or any(isinstance(a, (str, bytes)) and not _inside(a, root) for a in args):
            raise PermissionError(f"{what} outside the sandbox's scratch folder is not allowed")
        return func(path, *args, **kwargs)

    return guarded


def _scratch_only_flags(os_open, root: str):
    def guarded(path: Any, flags: int, *args: Any, **kwargs: Any):
        if flags & _WRITE_FLAGS and not _inside(path, root):
            raise PermissionError("writing files outside the sandbox's scratch folder is not allowed")
        return os_open(path, flags, *args, **kwargs)

    return guarded


def _scratch_only_mode(io_open, root: str):
    def guarded(file: Any, mode: str = "r", *args: Any, **kwargs: Any):
        if any(c in mode for c in "wax+") and not _inside(file, root):
            raise PermissionError("writing files outside the sandbox's scratch folder is not allowed")
        return io_open(file, mode, *args, **kwargs)

    return guarded


def module_builtins() -> dict[str, Any]:
    """The builtins the module's code sees: the real ones minus evaluation, files and introspection."""
    from trace_lib.sandbox import ALLOWED_DUNDERS, FORBIDDEN_ATTRS, FORBIDDEN_BUILTINS, from_import_allowed, is_dunder

    real_import = builtins.__import__
    real_getattr, real_setattr, real_delattr, real_hasattr = getattr, setattr, delattr, hasattr

    def check_name(obj: Any, name: Any) -> None:
        if not isinstance(name, str):
            return
        if (is_dunder(name) and name not in ALLOWED_DUNDERS) or name in FORBIDDEN_ATTRS or (
                name.startswith("_") and isinstance(obj, types.ModuleType)):
            raise PermissionError(f"attribute '{name}' is not allowed in a synthesized environment")

    def safe_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level or not from_import_allowed(name, list(fromlist or ())):
            raise ImportError(f"import of '{name}' is not allowed in a synthesized environment")
        return real_import(name, globals, locals, fromlist, level)

    def safe_getattr(obj, name, *default):
        check_name(obj, name)
        return real_getattr(obj, name, *default)

    def safe_setattr(obj, name, value):
        check_name(obj, name)
        return real_setattr(obj, name, value)

    def safe_delattr(obj, name):
        check_name(obj, name)
        return real_delattr(obj, name)

    def safe_hasattr(obj, name):
        check_name(obj, name)
        return real_hasattr(obj, name)

    table = dict(vars(builtins))
    for name in FORBIDDEN_BUILTINS:
        table[name] = _denied(name)
    table.update(__import__=safe_import, getattr=safe_getattr, setattr=safe_setattr, delattr=safe_delattr,
                 hasattr=safe_hasattr)
    return table


# --- serving -------------------------------------------------------------------------------------
def preload() -> None:
    """Trusted imports and the target's data, before the fences go up and before any module code."""
    import importlib

    from trace_lib.envs.retail import env as retail

    importlib.import_module("trace_lib.synth_sdk")
    importlib.import_module("tau2.environment.environment")  # imported lazily by retail.execute_call

    retail.load_base_db()
    retail.retail_tool_specs("all")
    retail.pristine_hash()


def _memory_hint() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return "" if soft == resource.RLIM_INFINITY else f" (the sandbox's memory limit is {soft // 2**20} MB)"


class Worker:
    """The module and its episode states; one method per request."""

    def __init__(self) -> None:
        self.module: types.ModuleType | None = None
        self.path = ""
        self.states: dict[str, Any] = {}
        """Episode handle -> the module's state object for that episode."""

    def describe(self, err: BaseException) -> str:
        """`Type: message (module line N, in func)`: where in the module the error arose."""
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == self.path]
        where = f" (module line {frames[-1].lineno}, in {frames[-1].name})" if frames else ""
        hint = _memory_hint() if isinstance(err, MemoryError) else ""
        return f"{type(err).__name__}: {err}{where}{hint}"

    def _mod(self) -> types.ModuleType:
        if self.module is None:
            raise WorkerError("no module loaded")
        return self.module

    def _state(self, handle: str) -> Any:
        if handle not in self.states:
            raise WorkerError(f"unknown episode handle {handle!r} (call init first)")
        return self.states[handle]

    # --- methods -------------------------------------------------------------------------------
    def load(self, path: str, trusted: bool = False) -> dict[str, Any]:
        from trace_lib.sandbox import check_source

        if self.module is not None:
            raise WorkerError("a module is already loaded")
        source = Path(path).read_text(encoding="utf-8")
        if not trusted:
            problems = check_source(source)
            if problems:
                raise WorkerError("static check failed: " + "; ".join(problems))
        self.path = path
        module = types.ModuleType(MODULE_NAME)
        module.__file__ = path
        if not trusted:
            module.__dict__["__builtins__"] = module_builtins()
        sys.modules[MODULE_NAME] = module  # dataclasses and pickling look the module up by name
        exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)
        self.module = module
        return self.meta()

    def meta(self) -> dict[str, Any]:
        mod = self._mod()
        missing = [n for n in ("CAPABILITY", "TARGET", "DIFFICULTY") if not hasattr(mod, n)]
        from trace_lib.sandbox import CONTRACT_FUNCTIONS

        not_callable = [n for n in CONTRACT_FUNCTIONS if not callable(getattr(mod, n, None))]
        return {"CAPABILITY": getattr(mod, "CAPABILITY", None), "TARGET": getattr(mod, "TARGET", None),
                "DIFFICULTY": getattr(mod, "DIFFICULTY", None), "missing": missing + not_callable}

    def tool_schemas(self) -> Any:
        return self._mod().tool_schemas()

    def generate_task(self, seed: int, difficulty: int) -> dict[str, Any]:
        task = self._mod().generate_task(seed, difficulty)
        if not isinstance(task, dict):
            raise WorkerError(f"generate_task returned {type(task).__name__}, expected a dict")
        return task

    def init(self, handle: str, task: dict[str, Any], release: list[str] = ()) -> None:
        for old in release:  # worlds of finished episodes
            self.states.pop(old, None)
        self.states[handle] = self._mod().init_state(task)

    def call_tool(self, handle: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        from trace_lib.synth.world import ToolError

        state = self._state(handle)
        try:
            text = self._mod().call_tool(state, name, arguments)
        except ToolError as err:
            return {"text": f"Error: {err}", "error": True}
        except BaseException as err:  # a module bug is the agent's observation, never a dead worker
            return {"text": f"Error: {self.describe(err)}", "error": True}
        if not isinstance(text, str):
            return {"text": f"Error: call_tool returned {type(text).__name__}, expected str", "error": True}
        return {"text": text, "error": False}

    def evaluate(self, handle: str, trajectory: dict[str, Any], task: dict[str, Any]) -> dict[str, Any]:
        """The module's verdict as `{"score", "steps", "gates"}` (`trace_lib.synth.rubric.verdict`)."""
        from trace_lib.synth.rubric import RubricError, verdict

        value = self._mod().evaluate(trajectory, task, self._state(handle))
        try:
            return verdict(value)
        except RubricError as err:
            raise WorkerError(str(err)) from None

    def solve(self, task: dict[str, Any]) -> Any:
        return self._mod().solve(task)

    def drop(self, handle: str) -> None:
        self.states.pop(handle, None)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request -> one reply dict (never raises)."""
        rid, method = request.get("id"), request.get("method")
        func = getattr(self, method, None) if method in METHODS else None
        if func is None:
            return {"id": rid, "ok": False, "error": f"unknown method {method!r}"}
        try:
            result = func(**request.get("params", {}))
        except WorkerError as err:
            return {"id": rid, "ok": False, "error": str(err)}
        except BaseException as err:  # SystemExit from module code included
            return {"id": rid, "ok": False, "error": f"raised {self.describe(err)}"}
        return {"id": rid, "ok": True, "result": result}


METHODS = ("load", "meta", "tool_schemas", "generate_task", "init", "call_tool", "evaluate", "solve", "drop")


def encode(reply: dict[str, Any]) -> bytes:
    """The reply as one JSON line; a result that is not plain JSON becomes an error (the parent
    prefixes every error with the method's name)."""
    try:
        return json.dumps(reply, allow_nan=False).encode("utf-8") + b"\n"
    except (TypeError, ValueError) as err:
        return json.dumps({"id": reply.get("id"), "ok": False,
                           "error": f"returned a value that is not JSON-serialisable ({err})"}).encode("utf-8") + b"\n"


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main() -> None:
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # prints, from Python or C, land on stderr
    sys.stdout = sys.stderr
    sys.dont_write_bytecode = True
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]  # as -P: scratch files never import
    startup: dict[str, Any] = {"ready": True}
    try:
        preload()
    except BaseException as err:
        startup = {"ready": False, "error": f"worker preload failed: {type(err).__name__}: {err}"}
    fence_host(os.getcwd())
    write_all(reply_fd, encode(startup))
    worker = Worker()
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            break
        try:
            request = json.loads(line)
        except ValueError:
            write_all(reply_fd, encode({"id": None, "ok": False, "error": "request is not JSON"}))
            continue
        write_all(reply_fd, encode(worker.handle(request)))


if __name__ == "__main__":
    main()
