"""Hidden states from a real vLLM server (extract.engine vllm), started once per pytest run on the served tiny
Llama (the Qwen3.5 hybrids and Gemma 4 each on a server of their own): states equal to the extractor's own
capture, the target's weights never loaded by the extractors, the spool within its bound, wrong servers refused in
one line, state health for every engine, and a whole `accelerate launch run` with vLLM extraction and
regeneration, killed and resumed, its audit exact and its tau reported."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_pipeline import LAUNCH_2CPU, REPO, assert_exactly_once, events, rank_pids, write_run_config

from dflash_stream.config import ConfigError, TargetConfig, config_from_dict
from dflash_stream.observe.metrics import MetricsWriter, read_metrics
from dflash_stream.pipeline.common import open_store
from dflash_stream.pipeline.extract_command import make_extractor
from dflash_stream.pipeline.roles import RoleInfo
from dflash_stream.pipeline.served_extractor import spool_writer
from dflash_stream.store import FingerprintMismatch, Store
from dflash_stream.target_model import load_target
from dflash_stream.target_model.capture import LayerCapture
from dflash_stream.target_model.served_states import ServedStatesError

pytestmark = pytest.mark.slow

MAX_REL = 5e-3
"""The issue's bound for vLLM's states against ours (bf16 as stored)."""
ROLE = RoleInfo("extractor", 0, 1, 0, 1)
DEMO = REPO / "dflash_stream" / "demo_data"


class SpoolSampler:
    """The bytes in a folder, sampled from outside every few milliseconds while a run goes on."""

    def __init__(self, path: Path) -> None:
        self.path, self.peak, self._stop = path, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            total = 0
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(self.path):
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat().st_size
            self.peak = max(self.peak, total)
            time.sleep(0.002)

    def __enter__(self) -> SpoolSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def weightless_copy(target: Path, out: Path) -> Path:
    """The target's folder without its weights: config, generation config and tokenizer only."""
    out.mkdir(parents=True)
    for item in target.iterdir():
        if item.suffix not in (".safetensors", ".bin", ".gguf", ".pt"):
            shutil.copy(item, out / item.name)
    return out


def worst_relative_difference(store_path: Path, target: Path, layer_ids: list[int]) -> tuple[list[float], int]:
    """Per layer over every stored sample: max |stored - ours| / max |ours|, ours being the extractor's own capture
    (hooks, bf16) of the same token ids with the target's weights; and the number of samples compared."""
    model, _ = load_target(TargetConfig(model=str(target), dtype="float32", device="cpu"), torch.device("cpu"))
    capture = LayerCapture(model, layer_ids)
    store = Store.attach(store_path)
    consumer = store.consumer("compare")
    worst, samples = [0.0] * len(layer_ids), 0
    while (claim := consumer.claim(timeout=0)) is not None:
        for sample in consumer.read(claim):
            ids = sample.input_ids[None]
            ours = capture(ids, torch.ones_like(ids))[0].float().view(len(ids[0]), len(layer_ids), -1)
            theirs = sample.hidden_states.float().view(ours.shape)
            for k in range(len(layer_ids)):
                rel = ((theirs[:, k] - ours[:, k]).abs().max() / ours[:, k].abs().max()).item()
                worst[k] = max(worst[k], rel)
            samples += 1
    return worst, samples


def served_run_config(tmp: Path, server, target: Path | None = None, rows: int = 40, **overrides) -> Path:
    keys = {f"extract.{k}": v for k, v in server.extract_keys().items()}
    tmp.mkdir(parents=True, exist_ok=True)
    return write_run_config(tmp, target or server.target, rows=rows, **{**keys, **overrides})


def test_states_equal_the_extractors_own_capture_without_loading_the_weights(vllm_extraction_server, tmp_path):
    """`extract` with engine vllm on a copy of the target folder that holds no weights (the server has them):
    it extracts every sample, keeps the spool within extract.spool_bytes (measured from outside), leaves no file
    there, logs the states' health, and the states equal the hf capture of the real target within 5e-3."""
    server = vllm_extraction_server
    bare = weightless_copy(server.target, tmp_path / "bare-target")
    with pytest.raises(ConfigError, match="cannot load"):
        load_target(TargetConfig(model=str(bare), device="cpu"), torch.device("cpu"))  # truly no weights there
    # Room for about three of the longest samples' float32 files at once.
    spool_bytes = 3 * (96 * (3 * 128 * 4 + 8) + 4096)
    # `extract` alone, no trainer: a budget for all of it.
    config = served_run_config(tmp_path, server, target=bare, **{"extract.spool_bytes": spool_bytes,
                                                                  "store.budget": "20MB"})
    with SpoolSampler(server.spool) as spool:
        done = subprocess.run([sys.executable, "-m", "dflash_stream", "extract", "--config", str(config)], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert 0 < spool.peak <= spool_bytes
    output = tmp_path / "out"
    assert not list(server.spool.glob(spool_writer(output, 0) + "*")), "spool files left behind"
    health = [e for e in read_metrics(output) if e["event"] == "health"]
    assert health and all(e["engine"] == "vllm" and e["layers"] == server.layer_ids for e in health)
    assert all(min(e["rms"]) > 0 and max(e["zero_share"]) < 0.01 and sum(e["non_finite"]) == 0 for e in health)
    worst, samples = worst_relative_difference(output / "store", server.target, server.layer_ids)
    report = json.loads(next((output / "data").glob("report-*.json")).read_text())
    assert samples == len(report["sample_ids"]) == 40
    assert max(worst) <= MAX_REL, worst
    # The store records the engine: resuming it with the extractor's own forward is refused, naming the field.
    hf = config_from_dict({**yaml.safe_load(config.read_text()), "extract": {}})
    with pytest.raises(FingerprintMismatch, match=r"engines that computed the states \(extract.engine.*stored 'vllm'"):
        open_store(hf, server.layer_ids, 128)


@functools.cache
def _vllm_loads(module: str) -> str | None:
    """None when vLLM's environment imports `module`, else the last line of its error."""
    from conftest import VLLM_PYTHON

    done = subprocess.run([str(VLLM_PYTHON), "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    return None if done.returncode == 0 else done.stderr.strip().splitlines()[-1]


def bf16_error(store_path: Path, target: Path, layer_ids: list[int]) -> tuple[dict[str, list[float]], int]:
    """Per layer, the mean |a - ref| / mean |ref| over every stored sample, ref being the extractor's float32
    capture of the same token ids: `stored` (the engine's states) and `ours_bf16` (the extractor's own capture with
    the target in bf16, which sets the bar); and the number of samples compared."""
    captures = {dtype: LayerCapture(load_target(TargetConfig(model=str(target), dtype=dtype, device="cpu"),
                                                torch.device("cpu"))[0], layer_ids)
                for dtype in ("float32", "bfloat16")}
    consumer = Store.attach(store_path).consumer("compare")
    error = {"stored": [0.0] * len(layer_ids), "ours_bf16": [0.0] * len(layer_ids)}
    samples = 0
    while (claim := consumer.claim(timeout=0)) is not None:
        for sample in consumer.read(claim):
            ids = sample.input_ids[None]
            ref, ours = (captures[d](ids, torch.ones_like(ids))[0].float().view(len(ids[0]), len(layer_ids), -1)
                         for d in ("float32", "bfloat16"))
            for name, states in (("stored", sample.hidden_states.float().view(ref.shape)), ("ours_bf16", ours)):
                for k in range(len(layer_ids)):
                    error[name][k] += ((states[:, k] - ref[:, k]).abs().mean() / ref[:, k].abs().mean()).item()
            samples += 1
    return {name: [e / max(samples, 1) for e in errors] for name, errors in error.items()}, samples


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5", "qwen3_5_moe"])
def test_hybrid_targets_states_equal_the_extractors_own_capture(family, vllm_extraction_server, demo_tokenizer_dir,
                                                                tmp_path):
    """The headlines' Gated-DeltaNet hybrids (the 27B bare and in its VLM wrapper; the 122B-A10B's MoE in its
    wrapper), served by vLLM's CPU build when it can (its qwen3_5 module imports the Qwen-VL image processor,
    which needs torchvision: `make vllm-env` gives it one, docs/vllm-extraction.md). That build runs
    Gated-DeltaNet in bf16 only ("CPU GDN attention requires BF16"), so server and extractor run the target in
    bf16, and the bar is bf16's own: per layer, vLLM's states are as close to the float32 capture as the
    extractor's own bf16 capture is (mean relative difference within 1.25x of ours; measured on qwen3_5_text:
    0.37-0.61 % against ours 0.38-0.63 %; qwen3_5_moe: 0.31-0.67 % against 0.32-0.61 %). Prefix caching is off
    (`local_serving_args`): with it, vLLM keeps a hybrid's recurrent state per cache block by a Triton kernel,
    which the CPU build lacks."""
    missing = _vllm_loads("vllm.model_executor.models.qwen3_5")
    if missing:
        pytest.skip(f"vLLM's CPU build cannot load {family}: {missing}")
    target, server = _extract_on_a_server_of_its_own(family, "bfloat16", demo_tokenizer_dir, tmp_path)
    error, samples = bf16_error(tmp_path / "out" / "store", target, server.layer_ids)
    assert samples == 12
    assert all(0 < ours < 0.02 for ours in error["ours_bf16"]), error  # bf16 rounding, nothing worse
    assert all(vllm <= 1.25 * ours for vllm, ours in zip(error["stored"], error["ours_bf16"], strict=True)), error


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4"])
def test_gemma4_states_equal_the_extractors_own_capture(family, vllm_extraction_server, demo_tokenizer_dir,
                                                        tmp_path):
    """Gemma 4 as its 31B is built (sliding layers; full layers with wider heads of their own, fewer of them,
    whose keys are their values; embeddings scaled by sqrt(hidden) inside the model), bare and in the VLM wrapper
    its hub checkpoints are saved as, served by vLLM in float32: its states equal the extractor's own capture
    within 5e-3, as the Llama's do (measured on gemma4_text: 2.2e-3, 1.8e-3, 3.0e-3, the bf16 rounding of the
    stored states)."""
    target, server = _extract_on_a_server_of_its_own(family, "float32", demo_tokenizer_dir, tmp_path)
    worst, samples = worst_relative_difference(tmp_path / "out" / "store", target, server.layer_ids)
    assert samples == 12
    assert max(worst) <= MAX_REL, worst


def _extract_on_a_server_of_its_own(family: str, dtype: str, tokenizer_dir: Path, tmp_path: Path):
    """(target, server): `extract` of 12 rows through a vLLM server of the family's served tiny target."""
    from conftest import ExtractionServer

    from dflash_stream.bench.tiny_targets import save_target

    target = save_target(family, tmp_path / "target", tokenizer_dir, served=True)
    server = ExtractionServer(target, tmp_path / "server", dtype=dtype)
    try:
        server.start()
        # `extract` alone, no trainer: a budget for all of it.
        config = served_run_config(tmp_path, server, rows=12, **{"target.dtype": dtype, "store.budget": "20MB"})
        done = subprocess.run([sys.executable, "-m", "dflash_stream", "extract", "--config", str(config)],
                              cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        server.server.stop()
    return target, server


def _served_extractor(config: Path):
    cfg = config_from_dict(yaml.safe_load(config.read_text()))
    from dflash_stream.target_model.vllm_serve import run_layer_ids

    store = open_store(cfg, run_layer_ids(cfg), 128)
    return make_extractor(cfg, ROLE, store, MetricsWriter(cfg.output_dir, "extractor", 0), torch.device("cpu"))


def test_a_server_for_other_layers_or_another_spool_is_refused_in_one_line(vllm_extraction_server, tmp_path):
    server = vllm_extraction_server
    other_layers = served_run_config(tmp_path / "layers", server, rows=4, **{"target.num_capture_layers": 2})
    with pytest.raises(ServedStatesError) as err:
        _served_extractor(other_layers).run()
    assert "[tokens, 2, 128]" in str(err.value) and "serve-command" in str(err.value) and "\n" not in str(err.value)
    other_spool = served_run_config(tmp_path / "spool", server, rows=4, **{"extract.spool": str(tmp_path / "mine")})
    with pytest.raises(ServedStatesError) as err:
        _served_extractor(other_spool).run()
    assert f"writes the states to {server.spool}" in str(err.value) and "\n" not in str(err.value)
    too_small = served_run_config(tmp_path / "small", server, rows=4, **{"extract.spool_bytes": 10_000})
    with pytest.raises(ConfigError, match="extract.spool_bytes: this extractor's share"):
        _served_extractor(too_small)


def test_zero_states_stop_the_extractor_naming_layer_sample_and_engine(tiny_target_dir, tmp_path):
    """What vLLM #46301 returned: all-zero states. A target whose embeddings and residual writes are zero makes
    them for real (every layer outputs zeros); the extractor stops before writing anything."""
    from dflash_stream.pipeline.state_health import ZeroStates

    model, tokenizer = load_target(TargetConfig(model=str(tiny_target_dir), device="cpu"), torch.device("cpu"))
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
    config = write_run_config(tmp_path, tiny_target_dir, rows=8)
    cfg = config_from_dict(yaml.safe_load(config.read_text()))
    store = open_store(cfg, [1, 2, 3], 64)
    from dflash_stream.pipeline.extractor import Extractor

    extractor = Extractor(cfg, ROLE, store, MetricsWriter(cfg.output_dir, "extractor", 0), torch.device("cpu"),
                          target=(model, tokenizer))
    with pytest.raises(ZeroStates, match=r"sample \d+ \(rows\.jsonl#\d+\), engine hf: layer 1's states are all zero "
                                         r"for \d+ of \d+ tokens"):
        extractor.run()
    assert store.status()["segments"]["ready"] == 0


def test_run_with_vllm_extraction_and_regeneration_killed_and_resumed(vllm_extraction_server, tmp_path):
    """The main job with both sides on the server: answers (plain requests, which write no spool file) and states
    through it, killed with SIGKILL once states are stored, run again: the audit is exact, tau reported, the
    spool empty, status shows the states' health."""
    from dflash_stream.observe.status import collect_status, render_status

    server = vllm_extraction_server
    config = served_run_config(tmp_path, server, rows=40, **{
        "data.regenerate": True, "data.min_supervised_tokens": 4,
        "data.generation": {"engine": "openai", "endpoints": [server.url], "max_new_tokens": 16, "concurrency": 4},
        "eval": {"prompts": str(DEMO / "heldout_prompts.jsonl"), "num_prompts": 2, "max_new_tokens": 8}})
    output = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(LAUNCH_2CPU), "-m",
           "dflash_stream", "run", "--config", str(config)]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while not any(e["event"] == "extract" and e["samples"] >= 10 for e in events(output)):
        assert first.poll() is None and time.time() < deadline, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    for pid in rank_pids(output).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    first.wait()
    assert not (output / "summary.json").exists(), "the kill came too late to test anything"
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert_exactly_once(output, epochs=2)
    summary = json.loads((output / "summary.json").read_text())
    assert summary["samples_extracted"] > 0 and summary["eval"]["acceptance_length"] >= 1.0
    extractor = json.loads((output / "summary-parts" / "extractor-0.json").read_text())
    assert extractor["regenerate"]["errors"] == 0
    assert not list(server.spool.glob(spool_writer(output, 0) + "*")), "spool files left behind"
    shown = collect_status(output)
    assert shown["health"]["engine"] == "vllm" and shown["health"]["non_finite"] == 0
    assert "health    layers [1, 2, 3] (engine vllm" in render_status(shown)


def test_bench_extract_compares_the_engines_on_a_running_server(vllm_extraction_server, tmp_path, capsys):
    """`bench extract --engines hf,vllm --json` keeps today's keys and adds `engines`; with --endpoint it measures
    a server it did not start (start-up not timed). The figure the issue asks for: max_rel_vs_hf <= 5e-3."""
    from dflash_stream.cli import main

    server = vllm_extraction_server
    code = main(["bench", "extract", "--model", str(server.target), "--gguf-file", "", "--device", "cpu",
                 "--rows", "3", "--repeats", "1", "--capture-layers", "3", "--engines", "hf,vllm",
                 "--endpoint", server.url, "--spool", str(server.spool), "--workdir", str(tmp_path / "work"),
                 "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert {"hooks_tok_s", "full_forward_tok_s", "speedup", "extract_tok_s", "store_wait_fraction"} <= set(result)
    hf, vllm = result["engines"]["hf"], result["engines"]["vllm"]
    assert hf["tokens_per_s"] == result["extract_tok_s"] > 0
    assert vllm["tokens_per_s"] > 0 and vllm["startup_seconds"] is None and vllm["samples"] == result["samples"]
    assert 0 < vllm["max_rel_vs_hf"] <= MAX_REL and vllm["max_rel_vs_hf"] == max(vllm["max_rel_per_layer"])
