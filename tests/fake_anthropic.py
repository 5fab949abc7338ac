"""A local server speaking Anthropic's Messages API for tests of every LLM caller, and its replies."""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from local_http import LocalHTTP

from trace_lib.llm import LLMClient


KEY = "sk-test-secret-key-0123456789"


def text_reply(text: str) -> dict:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 11, "output_tokens": 7, "cache_creation_input_tokens": 100,
                      "cache_read_input_tokens": 0}}


class FakeMessagesAPI(LocalHTTP):
    """A scripted /v1/messages endpoint: each request pops the next (status, body[, headers]) from
    `script` (the last entry repeats). A bytes body is sent as is; `headers` override the defaults
    (None drops one), so a `content-length` above the body's size sends a body cut short."""

    def __init__(self, script: list[tuple], max_requests: int = 20, delays: list[float] = ()) -> None:
        self.script = list(script)
        self.delays = list(delays)
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.times: list[float] = []
        self.max_requests = max_requests
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server naming)
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                api.times.append(time.monotonic())
                api.requests.append(body)
                api.headers.append({k.lower(): v for k, v in self.headers.items()})
                if api.delays:
                    time.sleep(api.delays.pop(0))
                if len(api.requests) > api.max_requests or not api.script:
                    entry = (500, {"type": "error", "error": {"type": "api_error", "message": "script empty"}})
                else:
                    entry = api.script[0] if len(api.script) == 1 else api.script.pop(0)
                status, payload, extra = (*entry, {})[:3]
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                # retry-after-ms keeps the SDK's backoff short in tests
                headers = {"content-type": "application/json", "content-length": str(len(data)),
                           "retry-after-ms": "5", **extra}
                self.send_response(status)
                for name, value in headers.items():
                    if value is not None:
                        self.send_header(name, value)
                try:
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on this request (timeout test)

            def log_message(self, *args):
                pass

        super().__init__(Handler)


def error_reply(status: int, kind: str) -> tuple[int, dict]:
    return status, {"type": "error", "error": {"type": kind, "message": f"fake {kind}"}}


def anthropic_client(tmp_path: Path, url: str, max_retries: int = 2) -> LLMClient:
    return LLMClient("anthropic", "claude-sonnet-4-5", tmp_path / "cache", tmp_path / "ledger.jsonl",
                     base_url=url, api_key=KEY, max_retries=max_retries, timeout=10)


MSGS = [{"role": "user", "content": "What is 6 x 7?"}]
