"""A local server speaking the OpenAI chat-completions API (as vLLM serves it) for tests of the remote policy."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

from local_http import LocalHTTP


def completion(content=None, calls=(), finish="stop", prompt_tokens=40, completion_tokens=9) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                                 for i, (name, args) in enumerate(calls)]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


class FakeOpenAI(LocalHTTP):
    """A /v1/chat/completions endpoint: `respond(body)` -> (status, payload); records every request and
    the most requests in flight at once (each waits `delay` seconds)."""

    def __init__(self, respond, delay: float = 0.0) -> None:
        self.respond, self.delay = respond, delay
        self.requests: list[tuple[str, dict]] = []
        self.in_flight = self.max_in_flight = 0
        lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server naming)
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with lock:
                    api.requests.append((self.path, body))
                    api.in_flight += 1
                    api.max_in_flight = max(api.max_in_flight, api.in_flight)
                time.sleep(api.delay)
                try:
                    status, payload = api.respond(body)
                finally:
                    with lock:
                        api.in_flight -= 1
                data = json.dumps(payload).encode()
                self.send_response(status)
                for name, value in {"content-type": "application/json", "content-length": str(len(data)),
                                    "retry-after-ms": "5"}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        super().__init__(Handler, "/v1")

    def bodies(self, path: str = "/v1/chat/completions") -> list[dict]:
        return [b for p, b in self.requests if p == path]


def top_logprobs(top: dict[str, float]) -> dict:
    """A one-token reply carrying the server's top alternatives, as the chat-completions API sends them."""
    alts = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top.items()]
    first = max(alts, key=lambda a: a["logprob"])
    reply = completion(content=first["token"], finish="length", prompt_tokens=30, completion_tokens=1)
    reply["choices"][0]["logprobs"] = {"content": [{**first, "top_logprobs": alts}]}
    return reply


def serving(body: dict) -> tuple[int, dict]:
    """A server that loads any adapter, scores routes (' B' first, ' A' second, no ' C') and answers politely."""
    if "lora_name" in body:
        return 200, {"status": "loaded"}
    if body.get("top_logprobs"):
        return 200, top_logprobs({" B": -0.4, " A": -1.2, "Hello": -2.0})
    return 200, completion(content="Sorry, I cannot help with that.")
