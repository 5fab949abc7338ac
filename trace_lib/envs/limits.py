"""Every built-in tool call under a wall-time limit and an output cap.

Reads and writes nothing. `call_limited(run, limits)` runs one tool call and
returns a `ToolOutcome`: the observation text (capped, with a marker), whether it is an error, and
the fault kind when the limit, a crash or the cap stepped in ("timeout", "crash", "capped").

Why a forked process and not a thread or an alarm signal: a tool can stall inside one C call that
nothing in the same process can interrupt (τ²'s `calculate` runs `eval` on the agent's expression,
and `9**9**9**9` is a single big-integer power); only a process can be stopped from outside. So the
call first runs in a forked copy of this process (the same state, copy-on-write, nothing to
serialize; a fork with the model loaded is cheap next to a turn). If the copy answers within the limit, the call
is run again here, so whatever it changes lands in this process (tools are deterministic functions of the state,
so the second run is the first one again and cannot stall; a tool's own work is microseconds next
to the fork). Every call is run again, not only those of tools marked `write`: the replay does not
depend on the read/write marks being right (τ²'s shared database does: `envs.tau2`). A copy that
outlives the limit is killed and the call becomes a tool error; one that crashed is not repeated here.

The forked copy also gets an address-space limit (its current size plus `memory_mb`), so a call
that allocates without bound fails there with MemoryError instead of waking the OOM killer.
Synthesized environments do not use this: their tools run in the sandbox worker, under its limits.
"""

from __future__ import annotations

import os
import pickle
import resource
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from trace_lib.config import EnvConfig
from trace_lib.text import clean_text

FaultKind = Literal["timeout", "crash", "capped"]


_IN_FORKED_COPY = False
"""True only in the forked copy that runs one tool call and exits (`_in_fork`)."""


def in_forked_copy() -> bool:
    """Whether this process is a forked copy running one tool call: what it writes is thrown away
    with it, so state shared copy-on-write (e.g. `envs.tau2`'s database) need not be copied first."""
    return _IN_FORKED_COPY


@dataclass(frozen=True)
class ToolLimits:
    seconds: float = 5.0
    """Wall time one tool call may take."""
    max_chars: int = 20_000
    """Longest observation passed on; a longer one is cut, with a marker saying how much."""
    memory_mb: int = 1024
    """Memory the forked copy may allocate beyond what it inherits."""

    @classmethod
    def of(cls, cfg: EnvConfig) -> ToolLimits:
        """The limits the `env` params section asks for."""
        return cls(seconds=cfg.tool_timeout_s, max_chars=cfg.tool_output_chars)


@dataclass(frozen=True)
class ToolOutcome:
    text: str
    is_error: bool
    fault: FaultKind | None = None


def call_limited(run: Callable[[], tuple[str, bool]], limits: ToolLimits) -> ToolOutcome:
    """Run `run()` (one tool call, returning (text, is_error)) under `limits`; never raises for what
    the tool does. An exception from the tool becomes an error observation, as it would unguarded."""
    if not hasattr(os, "fork"):  # no fork (not POSIX): no hard limit, still the cap and the guard
        return call_guarded(run, limits)
    probe = _in_fork(run, limits)
    if probe.fault in ("timeout", "crash"):  # a crash is not repeated here, where no memory limit
        return probe  # holds and a dying interpreter takes the run with it
    return call_guarded(run, limits)


def call_guarded(run: Callable[[], tuple[str, bool]], limits: ToolLimits) -> ToolOutcome:
    """`run()` in this process, without the time limit (for tools that already run out of process
    under limits of their own): an exception becomes an error observation, the text is cleaned and
    capped."""
    return _finish(*_guarded(run), limits)


def _guarded(run: Callable[[], tuple[str, bool]]) -> tuple[str, bool, FaultKind | None]:
    try:
        text, is_error = run()
    except MemoryError:
        return "Error: the tool ran out of memory", True, "crash"
    except RecursionError:
        return "Error: the tool exceeded the recursion limit", True, "crash"
    except Exception as err:  # a tool rejecting bad input is an observation, not a crash of the run
        return f"Error: {type(err).__name__}: {err}", True, None
    if not isinstance(text, str):
        return f"Error: the tool returned {type(text).__name__}, not text", True, "crash"
    return text, bool(is_error), None


def _finish(text: str, is_error: bool, fault: FaultKind | None, limits: ToolLimits) -> ToolOutcome:
    clean = clean_text(text, limits.max_chars)
    if fault is None and len(text) > limits.max_chars:
        fault = "capped"
    return ToolOutcome(clean, is_error, fault)


def _in_fork(run: Callable[[], tuple[str, bool]], limits: ToolLimits) -> ToolOutcome:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copy: run, send the capped outcome, exit without running any cleanup
        global _IN_FORKED_COPY
        _IN_FORKED_COPY = True
        try:
            os.close(read_fd)
            _limit_memory(limits.memory_mb)
            outcome = _finish(*_guarded(run), limits)
            data = pickle.dumps((outcome.text, outcome.is_error, outcome.fault))
            view = memoryview(data)
            while view:
                view = view[os.write(write_fd, view):]
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        data, finished = _read_until(read_fd, time.monotonic() + limits.seconds)
    finally:
        os.close(read_fd)
        if not finished:
            _kill(pid)
        os.waitpid(pid, 0)
    if not finished:
        return ToolOutcome(f"Error: the tool call did not finish within {limits.seconds:g} s and was stopped",
                           True, "timeout")
    try:
        text, is_error, fault = pickle.loads(data)
    except Exception:  # the copy died before answering (killed, out of memory in pickling, ...)
        return ToolOutcome("Error: the tool crashed without an answer", True, "crash")
    return ToolOutcome(text, is_error, fault)


def _read_until(fd: int, deadline: float) -> tuple[bytes, bool]:
    """Everything written to `fd` until EOF, or what came before `deadline` and False."""
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), False
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _limit_memory(extra_mb: int) -> None:
    try:
        with open("/proc/self/statm") as fh:
            size = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = size + extra_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    except (OSError, ValueError):
        pass  # no /proc or no permission: the time limit still holds
