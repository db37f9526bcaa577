"""How a vLLM server must be started to compute a run's hidden states (extract.engine vllm), and
`dflash-stream serve-command`, which prints the exact `vllm serve` lines for a config.

The server runs vLLM's `extract_hidden_states` speculative method: every request's states of the captured layers
go into its KV cache, and the project's connector (`dflash_stream/vllm_plugin/dflash_vllm_connector.py`, loaded
through PYTHONPATH) writes them into the spool for the requests that ask. vLLM numbers its "aux" layers one
higher than this project's layer ids (its aux id i is the input of decoder layer i, the output of layer i - 1),
so the flags carry our ids + 1: nobody translates them by hand.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dflash_stream.config import Config, ConfigError, load_config
from dflash_stream.rundir import RunDir

CONNECTOR_CLASS = "DFlashHiddenStatesConnector"
CONNECTOR_MODULE = "dflash_vllm_connector"
"""The connector's class and module as vLLM imports them (`kv_connector`, `kv_connector_module_path`)."""
SPOOL_FILE_KEY = "dflash_spool_file"
"""The `kv_transfer_params` key naming a request's spool file (the connector's SPOOL_FILE_KEY; a test keeps the
two equal, as this environment cannot import the connector: it imports vLLM)."""
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def plugin_dir() -> Path:
    """The folder of the modules that run in vLLM's environment (the connector, `stacked_norm_probe.py`): what the
    server's PYTHONPATH gets (never the whole package, whose dependencies would shadow vLLM's)."""
    import dflash_stream

    return Path(dflash_stream.__file__).resolve().parent / "vllm_plugin"


def spool_dir(cfg: Config) -> Path:
    """extract.spool, by default OUTPUT/spool; absolute, as the servers write into it from elsewhere."""
    return Path(cfg.extract.spool or RunDir(cfg.output_dir).spool).expanduser().absolute()


def aux_layer_ids(layer_ids: list[int]) -> list[int]:
    """vLLM's `eagle_aux_hidden_state_layer_ids` for our layer ids (the output of layer i is its aux id i + 1)."""
    return [i + 1 for i in layer_ids]


def server_dtype(cfg: Config) -> str:
    """target.dtype for a server on GPUs: `auto` is bf16 there, as for the extractors' own forward (vLLM's own auto
    would take the checkpoint's dtype, float16 for a float32 one)."""
    return "bfloat16" if cfg.target.dtype == "auto" else cfg.target.dtype


def max_model_len(cfg: Config) -> int:
    """A sample of data.max_length tokens plus the one token every extraction request generates."""
    return cfg.data.max_length + 1


def extraction_args(cfg: Config, layer_ids: list[int]) -> list[str]:
    """The vLLM server flags that make it compute this run's states (model, host and port not included)."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids(layer_ids)}}}
    transfer = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(spool_dir(cfg)),
                                              "use_synchronization_lock": False}}
    return ["--tensor-parallel-size", str(cfg.extract.tensor_parallel_size), "--max-model-len",
            str(max_model_len(cfg)), "--dtype", server_dtype(cfg),
            "--speculative-config", json.dumps(speculative, separators=(",", ":")),
            "--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]


def server_env() -> dict[str, str]:
    """What the server's environment needs beside the flags: the connector on its PYTHONPATH."""
    return {"PYTHONPATH": str(plugin_dir())}


def _model_args(cfg: Config, model: str | None) -> list[str]:
    if model is None:
        if cfg.target.gguf_file:
            raise ConfigError("target.gguf_file: vLLM serves a folder of safetensors, not a GGUF file; save the model "
                              "with save_pretrained (`make demo-served` converts the demo's) and pass it as --model")
        if cfg.target.model.startswith("package:"):
            from dflash_stream.target_model.loading import model_location

            model = model_location(cfg.target)[0]
        else:
            model = cfg.target.model
    args = [model]
    if cfg.target.revision:
        args += ["--revision", cfg.target.revision]
    if cfg.target.trust_remote_code:
        args.append("--trust-remote-code")
    return args


def _listen(url: str) -> tuple[str, list[str]]:
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return host, ["--host", "127.0.0.1" if host in LOCAL_HOSTS else "0.0.0.0", "--port", str(port)]


def run_layer_ids(cfg: Config) -> list[int]:
    """The layers the run stores (the drafter's, then the verifier's last one when it is stored), from the
    target's config alone (or plan's target.* hints): no weights. vLLM's aux id of the last layer is the number
    of layers: its output before the final norm, as the hf engine captures it."""
    from dflash_stream.target_model.layers import stored_layer_ids
    from dflash_stream.target_model.shape import target_shape

    num_layers = target_shape(cfg.target, download=True, count=False).num_layers
    return stored_layer_ids(num_layers, cfg.target, cfg.verifier_states)


def serve_commands(cfg: Config, model: str | None = None) -> list[dict[str, Any]]:
    """One `vllm serve` command per server: the extraction servers (extract.endpoints, when extract.engine is
    vllm), then the regeneration servers that are not also extraction servers (data.generation.endpoints with
    engine openai). Each: {endpoint, role, host, env, argv}."""
    serving = _model_args(cfg, model)
    commands: list[dict[str, Any]] = []
    extracting = cfg.extract.endpoints if cfg.extract.engine == "vllm" else []
    if extracting:
        flags = extraction_args(cfg, run_layer_ids(cfg))
        for url in extracting:
            host, listen = _listen(url)
            commands.append({"endpoint": url, "role": "extraction", "host": host, "env": server_env(),
                             "argv": ["vllm", "serve", *serving, *listen, *flags]})
    gen = cfg.data.generation
    if cfg.data.regenerate and gen.engine == "openai":
        for url in (u for u in gen.endpoints if u not in extracting):
            host, listen = _listen(url)
            commands.append({"endpoint": url, "role": "regeneration", "host": host, "env": {},
                             "argv": ["vllm", "serve", *serving, *listen, "--max-model-len", str(max_model_len(cfg)),
                                      "--dtype", server_dtype(cfg)]})
    if not commands:
        raise ConfigError("extract.engine: hf and no regeneration servers: this config asks no vLLM server; set "
                          "extract.engine: vllm and extract.endpoints (or data.generation.engine: openai)")
    return commands


def render(commands: list[dict[str, Any]], cfg: Config) -> str:
    """The commands as shell lines, each after a comment saying where it runs and what it serves."""
    lines = []
    if any(c["role"] == "extraction" for c in commands):
        ids = run_layer_ids(cfg)
        lines.append(f"# hidden states of layers {ids} (vLLM aux ids {aux_layer_ids(ids)}) into the spool "
                     f"{spool_dir(cfg)} (extract.spool: the extractors read it there), at most "
                     f"{cfg.extract.spool_bytes.human_readable()} in flight over all extractors")
    for c in commands:
        what = ("extraction (and regeneration, when data.generation.endpoints lists it)" if c["role"] == "extraction"
                else "regeneration only")
        lines.append(f"# {c['endpoint']} on {c['host']}: {what}")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in c["env"].items())
        lines.append((env + " " if env else "") + shlex.join(c["argv"]))
    return "\n".join(lines)


def serve_command(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    commands = serve_commands(cfg, args.model)
    print(json.dumps(commands, indent=2) if args.json else render(commands, cfg))
    return 0


def register(sub) -> None:
    parser = sub.add_parser("serve-command", help="print the `vllm serve` command of every server a config asks "
                                                  "(extract.engine vllm: layer ids, connector, spool, lengths)")
    parser.add_argument("--config", required=True, help="run config (YAML); --section.key=value overrides follow")
    parser.add_argument("--model", default=None,
                        help="what the servers load, when not target.model: a local copy on the server nodes, or "
                             "the safetensors folder of a GGUF target")
    parser.add_argument("--json", action="store_true", help="the commands as JSON (endpoint, role, host, env, argv)")
    parser.set_defaults(func=serve_command, overrides=[])
