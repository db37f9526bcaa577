"""A small HTTP endpoint that answers as a misconfigured or failing OpenAI-compatible server would, for the
client's error paths (the tests against real servers start `transformers serve`)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Reply = tuple[int, dict]
"""(HTTP status, JSON body)."""


class ServerLike(http.server.BaseHTTPRequestHandler):
    """GET /v1/models: `server.models` (or `server.models_reply`); GET of a path in `server.pages`: its reply;
    POST /tokenize: `server.tokenize(body)` (404 without it); POST /v1/completions: `server.respond(body)`, by
    default `server.post_status` with `server.post_body`. Every completion request's body is kept in
    `server.bodies`."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.auth.append(self.headers.get("Authorization"))
        if self.path in self.server.pages:
            self._send(*self.server.pages[self.path])
            return
        reply = self.server.models_reply() if self.server.models_reply else None
        self._send(*(reply or (200, {"object": "list", "data": self.server.models})))

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path.endswith("/tokenize"):
            self._send(*(self.server.tokenize(body) if self.server.tokenize else (404, {"detail": "Not Found"})))
            return
        with self.server.lock:
            self.server.posts += 1
            self.server.bodies.append(body)
        self._send(*self.server.respond(body))

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """Quiet about a client that went away mid-answer (a cancelled request); loud about anything else."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextmanager
def json_endpoint(model_name: str, post_status: int = 200, post_body: dict | None = None, *,
                  respond: Callable[[dict], Reply] | None = None, tokenize: Callable[[dict], Reply] | None = None,
                  models: list[dict[str, Any]] | None = None, models_reply: Callable[[], Reply | None] | None = None,
                  pages: dict[str, Reply] | None = None) -> Iterator[http.server.HTTPServer]:
    """The endpoint, serving in a thread; its base URL is `url(server)`. `models_reply` may return a reply that
    replaces the model list (an outage), or None."""
    server = _Server(("127.0.0.1", 0), ServerLike)
    server.models = models if models is not None else [{"id": model_name, "object": "model"}]
    server.respond = respond or (lambda body: (post_status, post_body or {}))
    server.tokenize, server.models_reply, server.pages = tokenize, models_reply, pages or {}
    server.posts, server.bodies, server.auth, server.lock = 0, [], [], threading.Lock()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()


def url(server: http.server.HTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def answering(tokenizer, answer: Callable[[dict], list[int]] | None = None, finish: str = "stop"
              ) -> dict[str, Callable[[dict], Reply]]:
    """`respond` and `tokenize` of a vLLM-like server of the target: prompts as ids, answers as ids (by default
    the prompt's last three ids and the end of sequence), /tokenize with the target's tokenizer."""
    def respond(body: dict) -> Reply:
        if not isinstance(body.get("prompt"), list):  # the tokenizer check's completion of a probe text
            ids = tokenizer.encode(body["prompt"], add_special_tokens=False)
            return 200, {"choices": [{"text": "x", "finish_reason": "length"}], "usage": {"prompt_tokens": len(ids)}}
        ids = answer(body) if answer else [*body["prompt"][-3:], tokenizer.eos_token_id]
        return 200, {"choices": [{"text": "", "token_ids": ids, "finish_reason": finish}]}

    def tokenize(body: dict) -> Reply:
        return 200, {"tokens": tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens",
                                                                                             True))}
    return {"respond": respond, "tokenize": tokenize}
