"""A local HTTP server for the tests that talk to an API through its real SDK (Anthropic, OpenAI)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class LocalHTTP:
    """`handler` served on 127.0.0.1 (a free port) from a daemon thread while the context is open;
    `url` is the root, plus `path` (e.g. "/v1")."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], path: str = "") -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{path}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class JSONReplies(LocalHTTP):
    """A local JSON API that answers each POST from the request alone: `reply(body, path)` gives (status, payload).
    `requests` holds the bodies, `api_keys` the key each sent (`x-api-key`, or a bearer token)."""

    def __init__(self, reply: Callable[[dict, str], tuple[int, Any]], path: str = "") -> None:
        self.requests: list[dict] = []
        self.api_keys: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server naming)
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                server.requests.append(body)
                auth = self.headers.get("x-api-key") or self.headers.get("authorization", "")
                server.api_keys.append(auth.removeprefix("Bearer "))
                status, payload = reply(body, self.path)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        super().__init__(Handler, path)
