"""`dflash-stream bench store --metadata N`: N small segments published, claimed and released one after the
other, with each step's latency early and late in the run: the store's metadata work per step must not grow
with the number of segments that passed, and the store's directories must stay as small (released segments'
records are folded into ledgers: their size is reported, and how long a resume takes to read them back)."""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

WINDOW = 1000
LAYERS, HIDDEN, TOKENS = [0], 16, 4


def _ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(1e3 * statistics.median(values), 3),
            "p90_ms": round(1e3 * statistics.quantiles(values, n=10)[-1], 3)}


def run_metadata(segments: int, as_json: bool) -> int:
    from dflash_stream.store import Sample, Store

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-metadata-"))
    try:
        store = Store.open(work / "store", budget=2**30, codec="lossless", reuse=1, max_segment_raw_bytes=2**16,
                           fingerprint={"target": "bench", "layer_ids": LAYERS, "hidden_size": HIDDEN})
        writer = store.writer("w")
        consumer = Store.attach(store.path).consumer("c")  # its own record cache, as in a trainer process
        states = torch.randn(TOKENS, len(LAYERS) * HIDDEN).to(torch.bfloat16)
        ids, mask = np.arange(TOKENS, dtype=np.int32), np.ones(TOKENS, dtype=bool)
        steps: dict[str, list[float]] = {"publish": [], "claim": [], "release": []}
        largest = {"ready": 0, "segments": 0, "info": 0, "done": 0}
        for i in range(segments):
            t0 = time.perf_counter()
            writer.write([Sample(i, ids, mask, states)])
            t1 = time.perf_counter()
            claim = consumer.claim(timeout=1)
            t2 = time.perf_counter()
            consumer.release([claim])
            t3 = time.perf_counter()
            for name, seconds in zip(steps, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                steps[name].append(seconds)
            if i % WINDOW == 0:
                for d in largest:
                    largest[d] = max(largest[d], len(list((store.path / d).iterdir())))
        # What a resuming extractor reads: every record, folded or not, by a process that read none yet.
        t0 = time.perf_counter()
        stored = Store.attach(store.path).stored_sample_ids()
        resume_s = time.perf_counter() - t0
        ledgers = list((store.path / "released").iterdir())
        ledger_bytes = sum(p.stat().st_size for p in ledgers)
        window = min(WINDOW, max(2, segments // 10))
        report = {
            "segments": segments, "window": window,
            **{name: {"first": _ms(v[:window]), "last": _ms(v[-window:]),
                      "last_over_first": round(statistics.median(v[-window:]) / statistics.median(v[:window]), 3)}
               for name, v in steps.items()},
            "largest_dir_entries": largest,
            "kept_records": {d: len(list((store.path / d).iterdir())) for d in ("info", "done")},
            "ledger": {"files": len(ledgers), "bytes": ledger_bytes,
                       "bytes_per_segment": round(ledger_bytes / max(segments, 1), 1)},
            "stored_sample_ids": {"samples": len(stored.get(0, ())), "read_ms": round(1e3 * resume_s, 3)},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if as_json:
        print(json.dumps(report))
    else:
        print(f"{segments:,} segments of {TOKENS} tokens; median (p90) latency in the first and last {window}")
        for name in steps:
            r = report[name]
            print(f"  {name:<8} first {r['first']['median_ms']:.3f} ({r['first']['p90_ms']:.3f}) ms   last "
                  f"{r['last']['median_ms']:.3f} ({r['last']['p90_ms']:.3f}) ms   ratio {r['last_over_first']:.2f}")
        print(f"  largest listings: {report['largest_dir_entries']}; left in info/ and done/: "
              f"{report['kept_records']}")
        led, ids = report["ledger"], report["stored_sample_ids"]
        print(f"  released records folded into {led['files']} ledger file(s): {led['bytes']:,} bytes "
              f"({led['bytes_per_segment']} per segment); a resume reads the ids of {ids['samples']:,} samples in "
              f"{ids['read_ms']:.1f} ms")
    return 0
