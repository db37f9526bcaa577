"""The completions client's refusals, against a small HTTP endpoint that answers as a misconfigured server would
(the tests against real servers are in test_regenerate_server.py): each ends the phase with one clear error
instead of waiting forever."""

from __future__ import annotations

import pytest
from json_endpoint import json_endpoint, url

from dflash_stream.config import ConfigError, GenerationConfig
from dflash_stream.regenerate.client import CompletionClient, Prompt, RegenerationError


@pytest.fixture
def endpoint():
    """A server without the completions API."""
    with json_endpoint("served-model", 404, {"detail": "Not Found"}) as server:
        yield server


class _Tokenizer:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=False) -> str:
        return " ".join(map(str, ids))


def _client(server, **gen) -> CompletionClient:
    config = GenerationConfig(engine="openai", endpoints=[url(server)],
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
    assert endpoint.auth == ["Bearer s3cret"]
