"""NOT a valid module: probes the sandbox's process-level defenses (loaded with trusted=True).

`generate_task(seed, ...)` runs probe number `seed` and reports what it saw in `meta`.
"""

import os
import socket
import subprocess
import sys

CAPABILITY = "probe"
TARGET = {"name": "retail", "tools": "core"}
DIFFICULTY = {"default": 1, "min": 0, "max": 3}


def _attempt(func):
    try:
        return f"ok: {func()!r}"[:200]
    except BaseException as err:
        return f"{type(err).__name__}: {err}"


def _raw_connect():
    import _socket

    sock = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    sock.settimeout(3)
    return sock.connect(("1.1.1.1", 80))


def _write(path):
    with open(path, "w") as fh:
        return fh.write("x")


def generate_task(seed, difficulty=1):
    if seed == 0:
        return {"meta": {"env": dict(os.environ), "cwd": os.getcwd()}}
    if seed == 1:
        return {"meta": {"patched": _attempt(lambda: socket.create_connection(("1.1.1.1", 80), timeout=3)),
                         "raw": _attempt(_raw_connect)}}
    if seed == 2:
        return {"meta": {"subprocess": _attempt(lambda: subprocess.run(["true"])),
                         "system": _attempt(lambda: os.system("true")),
                         "fork": _attempt(os.fork)}}
    if seed == 3:
        return {"meta": {"outside": _attempt(lambda: _write("/tmp/trace-sandbox-escape.txt")),
                         "inside": _attempt(lambda: _write("inside.txt")),
                         "remove_outside": _attempt(lambda: os.remove("/tmp/trace-sandbox-escape.txt"))}}
    if seed == 4:
        print("about to die", file=sys.stderr)
        os._exit(7)
    if seed == 5:
        print("looping forever", file=sys.stderr)
        while True:
            pass
    if seed == 6:
        return {"meta": {"not_json": {1, 2}}}
    if seed == 7:
        return {"meta": {"huge": "x" * 10_000_000}}
    if seed == 8:
        raise ValueError("boom")
    if seed == 9:
        import resource

        return {"meta": {"as": resource.getrlimit(resource.RLIMIT_AS)[0],
                         "cpu": resource.getrlimit(resource.RLIMIT_CPU)[0],
                         "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
                         "session_leader": os.getsid(0) == os.getpid()}}
    return {}


def tool_schemas():
    return []


def init_state(task):
    return {}


def call_tool(state, name, arguments):
    return ""


def evaluate(trajectory, task, state):
    return 0


def solve(task):
    return []
