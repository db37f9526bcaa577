"""`dflash-stream bench pipeline`: the streaming run against the same work done extract-then-train.

Both sides run the same config as real processes: streaming is `accelerate launch` with one extractor and one
trainer sharing a small ring buffer; sequential is `dflash-stream extract` into an unbounded store, then
`dflash-stream train` on it. Every figure comes from the runs' own summaries and clocks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dflash_stream.config import load_config
from dflash_stream.observe.metrics import peak_store_bytes
from dflash_stream.pipeline.common import store_layout
from dflash_stream.rundir import RunDir

UNBOUNDED = "1TB"


def register_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("pipeline", help="streaming extract+train vs sequential extract-then-train")
    bench.add_argument("--config", default="configs/demo.yaml")
    bench.add_argument("--launch", default="launch/cpu-2proc.yaml", help="accelerate config of the streaming run")
    bench.add_argument("--workdir", default=None, help="where both runs write (default: a temporary folder)")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=bench_pipeline, overrides=[])


def _timed(cmd: list[str], log_path: Path) -> float:
    started = time.perf_counter()
    with log_path.open("w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({done.returncode}); log {log_path}:\n{tail}")
    return time.perf_counter() - started


def bench_pipeline(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "dflash_stream"]
    common = [*args.overrides, "--eval.prompts=null"]

    def where(name: str) -> list[str]:
        return [f"--output_dir={work / name}", f"--store.path={work / name / 'store'}"]

    stream_cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.launch, "-m", "dflash_stream",
        "run", "--config", args.config, *common, *where("streaming"),
    ]
    streaming_seconds = _timed(stream_cmd, work / "streaming.log")
    stream = json.loads(RunDir(work / "streaming").summary.read_text())

    seq = [*common, *where("sequential"), f"--store.budget={UNBOUNDED}"]
    extract_seconds = _timed([*cli, "extract", "--config", args.config, *seq], work / "sequential-extract.log")
    train_seconds = _timed([*cli, "train", "--config", args.config, *seq], work / "sequential-train.log")
    sequential_seconds = extract_seconds + train_seconds

    full_dump = peak_store_bytes(work / "sequential")
    layer_ids, hidden_size = store_layout(cfg)
    tokens = stream["tokens_extracted"]
    result: dict[str, Any] = {
        "config": args.config,
        "streaming_seconds": round(streaming_seconds, 1),
        "sequential_seconds": round(sequential_seconds, 1),
        "sequential_extract_seconds": round(extract_seconds, 1),
        "sequential_train_seconds": round(train_seconds, 1),
        "ratio": round(streaming_seconds / sequential_seconds, 3),
        "ideal_ratio": round(max(extract_seconds, train_seconds) / sequential_seconds, 3),
        "peak_store_bytes": stream["peak_store_bytes"],
        "budget_bytes": int(cfg.store.budget),
        "full_dump_raw_bytes": tokens * len(layer_ids) * hidden_size * 2,
        "full_dump_store_bytes": full_dump,
        "budget_fraction_of_dump": round(int(cfg.store.budget) / full_dump, 3) if full_dump else None,
        "peak_within_budget": stream["peak_store_bytes"] <= int(cfg.store.budget),
        "trainer_data_wait_fraction": round(
            stream["trainer_data_wait_seconds"] / max(stream["train_seconds"], 1e-9), 3
        ),
        "samples_trained": stream["samples_trained"],
        "tokens": tokens,
        "workdir": str(work),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        width = max(map(len, result))
        print("\n".join(f"{k.ljust(width)}  {v}" for k, v in result.items()))
    return 0
