"""The completions client's refusals, against a small HTTP endpoint that answers as a misconfigured server would
(the tests against real servers are in test_regenerate_server.py): each ends the phase with one clear error
instead of waiting forever."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from dflash_stream.config import ConfigError, GenerationConfig
from dflash_stream.regenerate.client import CompletionClient, Prompt, RegenerationError


class _Endpoint(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.seen.append(self.headers.get("Authorization"))
        self._send(200, {"object": "list", "data": [{"id": "served-model", "object": "model"}]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(404, {"detail": "Not Found"})  # a server without the completions API

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


class _Tokenizer:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=False) -> str:
        return " ".join(map(str, ids))


def _client(server, **gen) -> CompletionClient:
    config = GenerationConfig(engine="openai", endpoints=[f"http://127.0.0.1:{server.server_address[1]}"],
                              concurrency=2, give_up_s=5, **gen)
    return CompletionClient(config, _Tokenizer(), {2})


def test_a_server_without_completions_stops_the_phase(endpoint):
    with pytest.raises(RegenerationError, match="completions not found"):
        _client(endpoint).run([Prompt(i, [1, 5, 6], 4) for i in range(5)], lambda answer: None)


def test_a_model_the_server_does_not_serve_is_named(endpoint):
    with pytest.raises(ConfigError, match="data.generation.model: 'other' is not served .* served-model"):
        _client(endpoint, model="other").run([Prompt(0, [1], 4)], lambda answer: None)


def test_the_api_key_comes_from_the_named_variable(endpoint, monkeypatch):
    with pytest.raises(ConfigError, match="DFLASH_TEST_KEY is not set"):
        _client(endpoint, api_key_env="DFLASH_TEST_KEY")
    monkeypatch.setenv("DFLASH_TEST_KEY", "s3cret")
    with pytest.raises(RegenerationError):
        _client(endpoint, api_key_env="DFLASH_TEST_KEY").run([Prompt(0, [1], 4)], lambda answer: None)
    assert endpoint.seen == ["Bearer s3cret"]
