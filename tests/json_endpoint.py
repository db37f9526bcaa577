"""A small HTTP endpoint that answers as a misconfigured or failing OpenAI-compatible server would, for the
client's error paths (the tests against real servers start `transformers serve`)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ServerLike(http.server.BaseHTTPRequestHandler):
    """Lists `server.model_name` at /v1/models; every POST gets `server.post_status` with `server.post_body`."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.auth.append(self.headers.get("Authorization"))
        self._send(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model"}]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.posts += 1
        self._send(self.server.post_status, self.server.post_body)

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def json_endpoint(model_name: str, post_status: int, post_body: dict) -> Iterator[http.server.HTTPServer]:
    """The endpoint, serving in a thread; its base URL is `url(server)`."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ServerLike)
    server.model_name, server.post_status, server.post_body = model_name, post_status, post_body
    server.posts, server.auth = 0, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()


def url(server: http.server.HTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1"
