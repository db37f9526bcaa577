"""The CPU demo with its answers written by a serving engine (data.generation.engine: openai) instead of
`model.generate` in the extractor:

    make demo-served                       # vLLM's CPU build (`make vllm-env` first), else transformers serve
    .venv/bin/python scripts/demo_served.py --server transformers

It converts the demo's GGUF target to safetensors once (servers load folders), starts the server on a free
local port, runs the demo's main job (`accelerate launch ... run --config configs/demo.yaml`) into
runs/demo-served with the server as its only endpoint, and stops the server. The extractor still runs the GGUF
target to capture hidden states: the same weights, dequantized the same way.
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
    model_dir = safetensors_copy(cfg.target, load_tokenizer(cfg.target), REPO / "runs" / "bench-regenerate")
    subprocess.run(["rm", "-rf", str(OUTPUT)], check=True)  # a fresh run, as `make demo`
    extra = ("--dtype", "float32", "--max-model-len", "1024") if kind == "vllm" else ("--dtype", "float32")
    with LocalServer(kind, model_dir, OUTPUT.with_name("demo-served-server.log"), extra_args=extra) as server:
        print(f"demo-served: starting {kind} on {model_dir} (log {server.log_path})", flush=True)
        server.start()
        print(f"demo-served: {kind} ready after {server.wait_ready(900):.0f} s at {server.url}", flush=True)
        command = [
            str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file", "launch/cpu-2proc.yaml",
            "-m", "dflash_stream", "run", "--config", "configs/demo.yaml", f"--output_dir={OUTPUT}",
            f"--store.path={OUTPUT / 'store'}", "--data.generation.engine=openai",
            f"--data.generation.endpoints=[{server.url}]",
        ]
        print("demo-served: " + " ".join(command), flush=True)
        return subprocess.run(command, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
