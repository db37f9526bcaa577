"""`dflash-stream bench store --rate GBPS`: E writer processes replay recorded hidden states into a bounded
store at a set rate of raw states while T reader processes claim, decode and release them (decoded data is
discarded). Reports the rate sustained, the CPU cores it took, how far encoding made writers fall behind
their schedule (a GPU would have waited that long), and the store's peak size sampled from outside."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from dflash_stream.store import budget as bud
from dflash_stream.store import sizes

LAYERS = 5
SAMPLE_SECONDS = 0.02


def _segment(data, first_id: int):
    from dflash_stream.store import Sample

    return [Sample(first_id + i, ids, np.ones(len(ids), dtype=bool), hs) for i, (ids, hs) in enumerate(data)]


def _writer(index: int, path: str, data_file: str, rate: float, seconds: float, results) -> None:
    """Writes the recorded segment every `interval` seconds; time spent coding beyond the interval is lateness."""
    from dflash_stream.store import Store

    data = torch.load(data_file, weights_only=False)
    writer = Store.attach(path).writer(f"w{index}")
    raw = sum(hs.numel() * 2 for _, hs in data)
    interval = raw / rate
    start = next_at = time.monotonic()
    cpu, written, segments, late = time.process_time(), 0, 0, 0.0
    while time.monotonic() - start < seconds:
        pause = next_at - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        began, waited = time.monotonic(), writer.waited_seconds
        writer.write(_segment(data, (index << 40) + segments * len(data)))
        # Coding and writing, without the time blocked on the budget (that is the trainer's pace, not ours).
        busy = time.monotonic() - began - (writer.waited_seconds - waited)
        late += max(0.0, busy - interval)
        written, segments = written + raw, segments + 1
        next_at = max(next_at + interval, time.monotonic() - interval)  # fall behind, but never burst to catch up
    writer.finish()
    results.put({"role": "writer", "bytes": written, "segments": segments, "cpu": time.process_time() - cpu,
                 "seconds": time.monotonic() - start, "late": late, "budget_wait": writer.waited_seconds})


def _reader(index: int, path: str, results) -> None:
    from dflash_stream.store import Store

    consumer = Store.attach(path).consumer(f"r{index}")
    cpu, start, read, segments = time.process_time(), time.monotonic(), 0, 0
    while (claim := consumer.claim()) is not None:
        read += sum(s.hidden_states.numel() * 2 for s in consumer.read(claim))
        consumer.release([claim])
        segments += 1
    results.put({"role": "reader", "bytes": read, "segments": segments, "cpu": time.process_time() - cpu,
                 "seconds": time.monotonic() - start})


def run_rate(args: argparse.Namespace, data, source: str) -> int:
    from dflash_stream.store import Store

    rate = args.rate * 1e9
    width = data[0][1].shape[1]
    raw = sizes.raw_bytes(sum(len(ids) for ids, _ in data), len(data), width)
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-rate-"))
    try:
        torch.save(data, work / "states.pt")
        smallest = sizes.smallest_budget(work, raw, width, "lossless")
        budget = args.budget_segments * smallest
        store = Store.open(work / "store", budget=budget, codec="lossless", reuse=1,
                           fingerprint={"target": "bench", "layer_ids": list(range(LAYERS)),
                                        "hidden_size": width // LAYERS}, max_segment_raw_bytes=raw)
        store.set_expected_writers(args.writers)
        peak, stop = [0], threading.Event()

        def sample() -> None:  # from outside the writers and readers, as `du` would
            while not stop.is_set():
                peak[0] = max(peak[0], bud.du(store.path))
                time.sleep(SAMPLE_SECONDS)

        sampler = threading.Thread(target=sample, daemon=True)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_writer, args=(i, str(store.path), str(work / "states.pt"), rate / args.writers,
                                                   args.seconds, results)) for i in range(args.writers)]
        procs += [ctx.Process(target=_reader, args=(i, str(store.path), results)) for i in range(args.readers)]
        sampler.start()
        for p in procs:
            p.start()
        done = [results.get() for _ in procs]
        for p in procs:
            p.join()
        stop.set()
        sampler.join()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    writers = [r for r in done if r["role"] == "writer"]
    readers = [r for r in done if r["role"] == "reader"]
    elapsed = max(r["seconds"] for r in done)
    sustained = sum(r["bytes"] for r in writers) / max(r["seconds"] for r in writers)
    encode_cores = sum(r["cpu"] for r in writers) / elapsed
    decode_cores = sum(r["cpu"] for r in readers) / elapsed
    cores = encode_cores + decode_cores
    report = {
        "sustained_gb_s": round(sustained / 1e9, 4), "cores": round(cores, 3),
        "per_core_gb_s": round(sustained / 1e9 / cores, 4),
        "writer_encode_wait_fraction": round(sum(r["late"] for r in writers) / sum(r["seconds"] for r in writers), 4),
        "peak_store_bytes": peak[0], "budget_bytes": budget, "segments": sum(r["segments"] for r in writers),
        "requested_gb_s": args.rate, "writers": args.writers, "readers": args.readers,
        "encode_cores": round(encode_cores, 3), "decode_cores": round(decode_cores, 3),
        "writer_budget_wait_fraction": round(sum(r["budget_wait"] for r in writers)
                                             / sum(r["seconds"] for r in writers), 4),
        "segments_read": sum(r["segments"] for r in readers), "source": source,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(f"{k:>28}: {v}" for k, v in report.items()))
    if report["peak_store_bytes"] > budget:
        print(f"peak store size {report['peak_store_bytes']:,} bytes exceeded the budget {budget:,}")
        return 1
    return 0
