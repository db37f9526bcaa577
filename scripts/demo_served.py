"""The CPU demo with a serving engine doing the target's work: the answers (data.generation.engine: openai)
instead of `model.generate` in the extractor and, with vLLM, the hidden states too (extract.engine: vllm)
instead of the extractor's own forward:

    make demo-served                       # vLLM's CPU build (`make vllm-env` first), else transformers serve
    .venv/bin/python scripts/demo_served.py --server transformers      # answers only: it computes no states

It converts the demo's GGUF target to safetensors once (servers load folders), starts the server on a free
local port (vLLM with `serve-command`'s extraction flags, its spool in runs/demo-served/spool), runs the demo's
main job (`accelerate launch ... run --config configs/demo.yaml`) into runs/demo-served with the server as its
only endpoint, and stops the server. With vLLM no process of the job loads the target's weights to extract (the
trainer still reads the embedding and LM head, and the closing eval runs the GGUF target); with transformers
serve the extractor runs the GGUF target to capture the states: the same weights, dequantized the same way.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from dflash_stream.config import load_config
from dflash_stream.log import setup_logging
from dflash_stream.regenerate.servers import LocalServer, safetensors_copy, vllm_python
from dflash_stream.target_model.loading import load_tokenizer
from dflash_stream.target_model.vllm_serve import extraction_args, run_layer_ids, server_env

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "runs" / "demo-served"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=("auto", "vllm", "transformers"), default="auto",
                        help="auto: vLLM when .venv-vllm exists, else transformers serve")
    args = parser.parse_args()
    kind = args.server
    if kind == "auto":
        kind = "vllm" if vllm_python().exists() else "transformers"
    cfg = load_config(REPO / "configs" / "demo.yaml")
    setup_logging("demo-served")
    model_dir = safetensors_copy(cfg.target, load_tokenizer(cfg.target))
    subprocess.run(["rm", "-rf", str(OUTPUT)], check=True)  # a fresh run, as `make demo`
    with LocalServer(kind, model_dir, OUTPUT.with_name("demo-served-server.log"), extra_args=("--dtype", "float32")
                     ) as server:
        overrides = [f"--output_dir={OUTPUT}", f"--store.path={OUTPUT / 'store'}", "--data.generation.engine=openai",
                     f"--data.generation.endpoints=[{server.url}]"]
        env = {}
        if kind == "vllm":  # the states from the same server: the flags `dflash-stream serve-command` prints
            overrides += ["--extract.engine=vllm", f"--extract.endpoints=[{server.url}]",
                          f"--extract.spool={OUTPUT / 'spool'}"]
            served = load_config(REPO / "configs" / "demo.yaml", overrides)
            server.extra_args = (*extraction_args(served, run_layer_ids(served)), "--enforce-eager")
            env = server_env()
        print(f"demo-served: starting {kind} on {model_dir} (log {server.log_path})", flush=True)
        server.start(env)
        print(f"demo-served: {kind} ready after {server.wait_ready(900):.0f} s at {server.url}", flush=True)
        command = [
            str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file", "launch/cpu-2proc.yaml",
            "-m", "dflash_stream", "run", "--config", "configs/demo.yaml", *overrides,
        ]
        print("demo-served: " + " ".join(command), flush=True)
        return subprocess.run(command, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
