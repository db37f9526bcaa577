"""`make demo`'s last step: vLLM's τ beside ours for the demo's drafter, when vLLM's CPU build is there
(.venv-vllm, from `make vllm-env`); without it, nothing (the demo ends as before).

It runs `eval --engine vllm` on runs/demo/drafter with the demo config's held-out prompts and budget: the GGUF
target converted to safetensors once (the conversion every load of it reads, docs/targets.md), vLLM started with the drafter as its DFlash speculator, the same prompts asked of both engines. The
result replaces runs/demo/eval.json (today's keys, and `engines` with both τ side by side).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_stream.config import load_config
from dflash_stream.drafter.commands import engine_table
from dflash_stream.drafter.evaluate import evaluate
from dflash_stream.log import setup_logging
from dflash_stream.regenerate.servers import vllm_python
from dflash_stream.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    if not vllm_python().exists():
        return 0
    cfg = load_config(REPO / "configs" / "demo.yaml")
    run = RunDir(REPO / cfg.output_dir)
    setup_logging("demo-engines")
    print(f"\ndemo: the drafter's tau in vLLM beside ours ({run.drafter}, {cfg.eval.num_prompts} held-out prompts)",
          flush=True)
    result = evaluate(cfg, run.drafter, REPO / cfg.eval.prompts, cfg.eval.max_new_tokens, engine="vllm",
                      workdir=REPO / "runs" / "bench-regenerate")
    run.eval.write_text(json.dumps(result, indent=2))
    print("\n".join(engine_table(result)), flush=True)
    return 0 if result["matches_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
