"""`dflash-stream bench checkpoint`: how long training stands still for a checkpoint of a large drafter, written
the old way (synchronously: the trainer waits until it is durable) and the new way (train.async_checkpoint: a
host-memory snapshot, written by a thread while training goes on), in one process and through the trainer's own
writer (`pipeline/checkpoint_writer.py`), so both write the same files with the same fsyncs.

The drafter is built from a spec (random weights, AdamW moments materialised by one step), on the CPU, sized by
--hidden/--layers. While the background write runs, the bench keeps "training": AdamW steps over every
parameter, which read and write as much memory as a real step's update and compete with the writer for the
cores. The background figure is the second background checkpoint: the first also allocates the host buffers
that every later one reuses (reported as `first_stall_seconds`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

POLL_SECONDS = 0.01


def register_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("checkpoint", help="a large drafter's checkpoint: training's stall, synchronous vs background")
    bench.add_argument("--hidden", type=int, default=2048, help="drafter hidden size (default 2048)")
    bench.add_argument("--layers", type=int, default=4, help="drafter layers (default 4)")
    bench.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3 x hidden)")
    bench.add_argument("--workdir", default=None, help="where the checkpoints are written (default: a temporary "
                       "folder on the current one's filesystem, deleted after)")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=bench_checkpoint)


def _drafter(hidden: int, layers: int, intermediate: int):
    from dflash_stream.drafter.model import DFlashDrafter
    from dflash_stream.drafter.spec import DrafterSpec

    spec = DrafterSpec(hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                       num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512), head_dim=128,
                       rope_theta=1e6, rms_norm_eps=1e-6, vocab_size=32_000, block_size=16, mask_token_id=0,
                       target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36)
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    for p in drafter.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # AdamW's two moments per parameter now exist, as in any trained checkpoint
    return spec, drafter, optimizer


def bench_checkpoint(args: argparse.Namespace) -> int:
    from dflash_stream.drafter.export import WEIGHTS, drafter_state
    from dflash_stream.pipeline.checkpoint_writer import CheckpointWriter

    spec, drafter, optimizer = _drafter(args.hidden, args.layers, args.intermediate or 3 * args.hidden)
    params = sum(p.numel() for p in drafter.parameters())
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dflash-bench-ckpt-", dir="."))
    step = 0

    def shared() -> dict[str, Any]:
        return {"weights": drafter_state(drafter), "trainer_state": {
            "optimizer": optimizer.state_dict(), "scheduler": {}, "step": step, "tokens": 0, "samples": 0}}

    def part() -> dict[str, Any]:
        return {"rank_state": {"finished": [], "partial": [], "samples_trained": 0}, "ledger": []}

    writer = CheckpointWriter(work, 0, spec, barrier=lambda: None, keep=1)
    try:
        # The old way: training stands still for the whole write.
        step += 1
        started = time.perf_counter()
        saved = writer.save(step, shared=shared, **part())
        sync = {"stall_seconds": time.perf_counter() - started, "write_seconds": saved.write_seconds}
        state_bytes = saved.bytes

        # The new way, twice: the snapshot (the stall), then training while the thread writes, then the publish
        # at the step boundary that finds the write done (a stall too).
        runs = []
        for _ in range(2):
            step += 1
            started = time.perf_counter()
            writer.start(step, shared=shared, **part())
            snapshot = time.perf_counter() - started
            probe = drafter.fc.weight[0, :8].clone()  # as of the snapshot: what the checkpoint must hold
            steps = 0
            while not writer.written:
                optimizer.step()  # training goes on: every parameter and both moments read and written
                steps += 1
                time.sleep(POLL_SECONDS)
            started = time.perf_counter()
            saved = writer.complete()
            runs.append({"stall_seconds": snapshot + time.perf_counter() - started,
                         "write_seconds": saved.write_seconds, "steps_during_write": steps})
            from safetensors import safe_open

            with safe_open(str(saved.path / WEIGHTS), "pt") as f:
                consistent = torch.equal(f.get_slice("fc.weight")[0:1, 0:8][0], probe)
            if not consistent:
                raise RuntimeError("the background checkpoint does not hold the state of its snapshot")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "state_bytes": state_bytes,
        "parameters": params,
        "drafter": {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate or 3 * args.hidden},
        "sync": _rounded(sync),
        "async": _rounded({**runs[1], "first_stall_seconds": runs[0]["stall_seconds"],
                           "host_snapshot_bytes": writer.host.bytes}),
        "async_stall_fraction": round(runs[1]["stall_seconds"] / max(sync["stall_seconds"], 1e-9), 4),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"checkpoint of a {params / 1e6:,.0f} M-parameter drafter ({state_bytes / 2**30:.2f} GiB on disk)")
        for name in ("sync", "async"):
            r = result[name]
            print(f"  {name:5s}  training stood still {r['stall_seconds']:7.3f} s; written in {r['write_seconds']:7.3f} s")
        print(f"  background stall = {result['async_stall_fraction']:.1%} of the synchronous one "
              f"({runs[1]['steps_during_write']} optimizer steps ran during the write)")
    return 0


def _rounded(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}
