"""extract.engine vllm without a server: the `serve-command` lines, the connector module's imports, the config's
one-line refusals, `plan`'s split of the GPUs, the state health figures, and the client's bounded retries against
a fake endpoint (the tests against a real vLLM server are tests/test_vllm_extract.py)."""

from __future__ import annotations

import ast
import http.server
import json
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from dflash_stream.cli import main
from dflash_stream.config import ConfigError, config_from_dict, load_config
from dflash_stream.target_model.vllm_serve import SPOOL_FILE_KEY, plugin_dir, serve_commands

REPO = Path(__file__).resolve().parents[1]
CONNECTOR = REPO / "dflash_stream" / "vllm_plugin" / "dflash_vllm_connector.py"


def tree(tmp: Path, target: Path, **extract) -> dict:
    return {
        "output_dir": str(tmp / "out"),
        "target": {"model": str(target), "dtype": "float32", "device": "cpu", "num_capture_layers": 3},
        "data": {"sources": [{"path": str(REPO / "dflash_stream" / "demo_data" / "sharegpt_chats.jsonl")}],
                 "max_length": 200},
        "extract": {"engine": "vllm", "endpoints": ["http://node-0:8000/v1", "http://localhost:8001"], **extract},
        "store": {"path": str(tmp / "out" / "store"), "budget": "20MB"},
    }


def test_serve_command_prints_the_flags_with_our_layer_ids_plus_one(tiny_target_dir, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tree(tmp_path, tiny_target_dir, tensor_parallel_size=4)))
    assert main(["serve-command", "--config", str(config), "--json"]) == 0
    commands = json.loads(capsys.readouterr().out)
    assert [c["endpoint"] for c in commands] == ["http://node-0:8000/v1", "http://localhost:8001/v1"]
    first = commands[0]
    argv = first["argv"]
    assert argv[:3] == ["vllm", "serve", str(tiny_target_dir)] and first["env"] == {"PYTHONPATH": str(plugin_dir())}
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "8000"
    assert flags["--tensor-parallel-size"] == "4" and flags["--max-model-len"] == "201"
    speculative = json.loads(flags["--speculative-config"])
    # 6 layers, 3 captured: the DFlash rule gives [1, 2, 3]; vLLM counts them one higher.
    assert speculative["method"] == "extract_hidden_states" and speculative["num_speculative_tokens"] == 1
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    transfer = json.loads(flags["--kv-transfer-config"])
    assert transfer["kv_connector"] == "DFlashHiddenStatesConnector"
    assert (plugin_dir() / f"{transfer['kv_connector_module_path']}.py") == CONNECTOR
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str((tmp_path / "out" / "spool").absolute())
    assert commands[1]["argv"][commands[1]["argv"].index("--host") + 1] == "127.0.0.1"
    # The shell form: an env prefix and quoted JSON, one line per server after a comment naming it.
    assert main(["serve-command", "--config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# hidden states of layers [1, 2, 3] (vLLM aux ids [2, 3, 4])")
    assert lines[2].startswith(f"PYTHONPATH={plugin_dir()} vllm serve ") and "'{\"method\":" in lines[2]


def test_serve_command_asks_for_the_verifier_layer_when_the_run_stores_it(tiny_target_dir, tmp_path):
    """train.loss kl stores the last layer beside the drafter's: vLLM's aux id of it is the number of layers (its
    output before the final norm), after the drafter's ids, in the order the store holds them."""
    t = tree(tmp_path, tiny_target_dir)
    t["train"] = {"loss": "kl"}
    flags = serve_commands(config_from_dict(t))[0]["argv"]
    speculative = json.loads(flags[flags.index("--speculative-config") + 1])
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4, 6]


def test_serve_command_adds_plain_regeneration_servers_and_refuses_what_it_cannot_serve(tiny_target_dir, tmp_path,
                                                                                      capsys):
    t = tree(tmp_path, tiny_target_dir)
    t["data"].update(regenerate=True, generation={"engine": "openai",
                                                  "endpoints": ["http://node-0:8000/v1", "http://gen:9000/v1"]})
    commands = serve_commands(config_from_dict(t))
    assert [c["role"] for c in commands] == ["extraction", "extraction", "regeneration"]
    assert "--speculative-config" not in commands[2]["argv"] and commands[2]["env"] == {}
    # target.dtype auto means bf16 on the servers' GPUs, as for the extractors' own forward there.
    t["target"]["dtype"] = "auto"
    argv = serve_commands(config_from_dict(t))[0]["argv"]
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    t = tree(tmp_path, tiny_target_dir, engine="hf")
    with pytest.raises(ConfigError, match="asks no vLLM server"):
        serve_commands(config_from_dict(t))
    t = tree(tmp_path, tiny_target_dir)
    t["target"]["gguf_file"] = "x.gguf"
    with pytest.raises(ConfigError, match="target.gguf_file: vLLM serves a folder of safetensors"):
        serve_commands(config_from_dict(t))


def test_the_connector_imports_only_vllm_torch_safetensors_and_the_standard_library():
    """It runs inside vLLM's environment (an older transformers, no dflash_stream dependencies)."""
    import sys

    allowed = {"vllm", "torch", "safetensors", "__future__"} | set(sys.stdlib_module_names)
    imported = set()
    module = ast.parse(CONNECTOR.read_text())
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= allowed, imported - allowed
    assert {"vllm", "torch", "safetensors"} <= imported
    # Its request key is the one the client sends.
    keys = [n.value.value for n in module.body if isinstance(n, ast.Assign)
            and any(getattr(t, "id", None) == "SPOOL_FILE_KEY" for t in n.targets)]
    assert keys == [SPOOL_FILE_KEY]
    assert [p.name for p in plugin_dir().glob("*.py")] and not (plugin_dir() / "dflash_stream").exists()


@pytest.mark.parametrize(("change", "words"), [
    ({"extract": {"engine": "vllm"}}, "config key 'extract': engine vllm needs extract.endpoints"),
    ({"extract": {"engine": "vllm", "endpoints": ["node:8000"]}}, "config key 'extract.endpoints'"),
    ({"extract": {"engine": "gpu"}}, "config key 'extract.engine'"),
    ({"extract": {"engine": "vllm", "endpoints": ["http://a:1"], "from_store": "/x"}}, "from_store replays"),
    ({"extract": {"engine": "vllm", "endpoints": ["http://a:1"]}, "data": {"regenerate": True}},
     "data.generation.engine: hf generates with the target inside the extractors"),
])
def test_vllm_keys_are_validated_at_load_in_one_line(tmp_path, change, words):
    t = {"output_dir": str(tmp_path), "data": {"sources": [{"path": "x.jsonl"}]},
         "store": {"path": str(tmp_path / "s"), "budget": "1GB"}}
    for section, keys in change.items():
        t.setdefault(section, {}).update(keys)
    with pytest.raises(ConfigError) as err:
        config_from_dict(t)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_plan_sizes_the_multi_gpu_target_on_servers_beside_the_trainers():
    from dflash_stream.observe.plan import build_plan

    cfg = load_config(REPO / "configs" / "qwen3.5-122b-a10b-vllm.yaml")
    plan = build_plan(cfg, samples=100_000, mean_tokens=1_500, processes=5)
    assert {k: plan["extract"][k] for k in ("engine", "servers", "tensor_parallel_size", "spool_bytes")} == {
        "engine": "vllm", "servers": 2, "tensor_parallel_size": 4, "spool_bytes": 16 * 2**30}
    assert plan["time"]["gpus"] == {"launch": 4, "extraction_servers": 8, "regeneration_servers": 0, "serving": 8,
                                    "total": 12}
    assert plan["roles"]["extractors"] == 1 and plan["roles"]["trainers"] == 4
    assert plan["memory"]["extractor"]["total_bytes"] == 0  # no weights on an extractor
    assert plan["target"]["layer_ids"] == [1, 7, 14, 20, 26, 32, 39, 45]  # z-lab's drafter's
    assert plan["disk"]["parts"]["spool"] == 16 * 2**30
    # A measured rate per server replaces the estimate, and extraction scales with the servers, not extractors.
    measured = build_plan(load_config(REPO / "configs" / "qwen3.5-122b-a10b-vllm.yaml", ["--extract.tokens_per_s=1000"]),
                          samples=100_000, mean_tokens=1_500, processes=5)
    phase = measured["time"]["phases"]["extract"]
    assert phase["tok_s_per_process"] == 1000 and phase["processes"] == 2
    assert phase["seconds"] == pytest.approx(100_000 * 1_500 / 2_000)
    assert measured["extract"]["tokens_per_s_source"].startswith("extract.tokens_per_s (measured")
    hf = build_plan(load_config(REPO / "configs" / "qwen3.6-27b-4gpu.yaml"), samples=1000, mean_tokens=1500, processes=4)
    assert hf["extract"] == {"engine": "hf", "servers": 0, "tensor_parallel_size": 1, "spool_bytes": 0, "spool": None}


def test_state_health_figures_per_layer():
    from dflash_stream.data import PreparedSample
    from dflash_stream.pipeline.state_health import NonFiniteStates, StateHealth, ZeroStates

    health = StateHealth([3, 7], 4, "vllm")
    sample = PreparedSample(11, torch.zeros(2, dtype=torch.int32).numpy(), torch.ones(2, dtype=torch.bool).numpy(),
                            "rows.jsonl#0")
    states = torch.tensor([[1, 1, 1, 1, 2, 0, 2, 0], [1, 1, 1, 1, 2, 0, 2, 0]], dtype=torch.bfloat16)
    health.check(sample, states)
    figures = health.segment([11])
    assert figures["layers"] == [3, 7] and figures["rms"] == [1.0, pytest.approx(2 ** 0.5)]
    assert figures["zero_share"] == [0.0, 0.5] and figures["non_finite"] == [0, 0]
    assert health.segment([11])["rms"] == [0.0, 0.0]  # forgotten once summed
    zero_row = states.clone()
    zero_row[1, 4:] = 0
    with pytest.raises(ZeroStates, match=r"sample 11 \(rows.jsonl#0\), engine vllm: layer 7's states are all zero "
                                         r"for 1 of 2 tokens"):
        health.check(sample, zero_row)
    # One zero row among three tokens is a real forward's (a token whose embedding row is zero): figures, no stop.
    three = PreparedSample(12, torch.zeros(3, dtype=torch.int32).numpy(), torch.ones(3, dtype=torch.bool).numpy(),
                           "rows.jsonl#1")
    health.check(three, torch.cat([states, zero_row[1:]]))
    assert health.segment([12])["zero_share"] == [0.0, pytest.approx(4 / 6)]
    nan = states.clone()
    nan[0, 1] = float("nan")
    with pytest.raises(NonFiniteStates, match=r"engine vllm: layer 3's states hold 1 NaN/Inf values"):
        health.check(sample, nan)


class _FakeExtractionServer(http.server.BaseHTTPRequestHandler):
    """Answers as a vLLM extraction server would, writing into the spool what `server.plan` says for each try of
    a sample: "missing" (no file), "damaged" (not a safetensors file), "other_ids" or "good"."""

    def do_GET(self) -> None:  # noqa: N802
        self._send({"data": [{"id": "fake"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        name = body["kv_transfer_params"][SPOOL_FILE_KEY]
        path = self.server.spool / name
        tries = self.server.tries
        kind = self.server.plan[min(len(tries), len(self.server.plan) - 1)]
        tries.append(kind)
        ids = torch.tensor(body["prompt"])
        if kind == "damaged":
            path.write_bytes(b"not a safetensors file")
        elif kind in ("good", "other_ids"):
            save_file({"hidden_states": torch.randn(len(ids), 3, 64),
                       "token_ids": ids + (1 if kind == "other_ids" else 0)}, str(path))
        self._send({"choices": [{"text": "x"}], "kv_transfer_params": {"hidden_states_path": str(path)}})

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize(("plan", "outcome"), [
    (["damaged", "other_ids", "good"], "served after 3 tries"),
    (["missing"], "failed after 1 + 2 retries"),
])
def test_a_missing_late_or_damaged_file_is_retried_then_reported_with_its_sample_id(tmp_path, plan, outcome):
    from dflash_stream.config import ExtractConfig
    from dflash_stream.target_model.served_states import Failed, Served, StateClient

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeExtractionServer)
    server.spool, server.plan, server.tries = tmp_path / "spool", plan, []
    server.spool.mkdir()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ext = ExtractConfig(engine="vllm", endpoints=[f"http://127.0.0.1:{server.server_address[1]}/v1"],
                            spool=str(server.spool), retries=2, timeout_s=0.5)
        client = StateClient(ext, server.spool, [1, 2, 3], 64, "run-extractor-0", 10**6, 100)
        client.start()
        try:
            client.submit(42, [5, 6, 7], "payload")
            result = client.next(timeout=30)
            if isinstance(result, Served):
                result.release()
            # The room of files given up on comes back when they appear or after timeout_s.
            deadline = time.monotonic() + 10
            while client.reserved and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            client.close()
    finally:
        server.shutdown()
    if outcome.startswith("served"):
        assert isinstance(result, Served) and server.tries == plan
        assert result.key == 42 and result.states.shape == (3, 3 * 64)
    else:
        assert isinstance(result, Failed) and result.key == 42 and result.tries == 3 and len(server.tries) == 3
        assert "did not appear within 0 s" in result.error or "did not appear within 1 s" in result.error
    assert not list(server.spool.iterdir()), "spool files left behind"
    assert client.reserved == 0
