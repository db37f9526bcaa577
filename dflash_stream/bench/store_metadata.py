"""`dflash-stream bench store --metadata N`: N small segments published, claimed and released one after the
other, with each step's latency early and late in the run: the store's metadata work per step must not grow
with the number of segments that passed, and the store's directories must stay as small (released segments'
records are folded into ledgers: their size is reported, and how long a resume takes to read them back).
On a shared machine the load drifts over a long run, so the aged store is also timed against a fresh one in
alternating blocks of cycles (`aged_vs_fresh`): that ratio is the one to trust."""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

WINDOW = 1000
LAYERS, HIDDEN, TOKENS = [0], 16, 4
STEPS = ("publish", "claim", "release")
ALTERNATIONS = 20
"""Blocks of cycles per store in the aged-vs-fresh comparison (each store runs up to WINDOW cycles in all)."""


def _ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(1e3 * statistics.median(values), 3),
            "p90_ms": round(1e3 * statistics.quantiles(values, n=10)[-1], 3)}


class _Cycle:
    """One store with its writer and consumer; `run` publishes, claims and releases one segment, timing each."""

    def __init__(self, path: Path) -> None:
        from dflash_stream.store import Store

        self.store = Store.open(path, budget=2**30, codec="lossless", reuse=1, max_segment_raw_bytes=2**16,
                                fingerprint={"target": "bench", "layer_ids": LAYERS, "hidden_size": HIDDEN})
        self.writer = self.store.writer("w")
        self.consumer = Store.attach(path).consumer("c")  # its own record cache, as in a trainer process
        self.sample_id = 0

    def run(self, states: torch.Tensor, steps: dict[str, list[float]]) -> None:
        from dflash_stream.store import Sample

        ids, mask = np.arange(TOKENS, dtype=np.int32), np.ones(TOKENS, dtype=bool)
        t0 = time.perf_counter()
        self.writer.write([Sample(self.sample_id, ids, mask, states)])
        t1 = time.perf_counter()
        claim = self.consumer.claim(timeout=1)
        t2 = time.perf_counter()
        self.consumer.release([claim])
        t3 = time.perf_counter()
        self.sample_id += 1
        for name, seconds in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            steps[name].append(seconds)


def _aged_vs_fresh(aged: _Cycle, fresh: _Cycle, states: torch.Tensor, cycles: int) -> dict[str, Any]:
    """Median latencies of the aged store and of a fresh one, in alternating blocks of cycles: both see the
    same machine load, which the first and last windows of a long run on a shared machine do not."""
    steps: dict[str, dict[str, list[float]]] = {k: {s: [] for s in STEPS} for k in ("fresh", "aged")}
    block = max(1, cycles // ALTERNATIONS)
    for _ in range(ALTERNATIONS):
        for name, cycle in (("fresh", fresh), ("aged", aged)):
            for _ in range(block):
                cycle.run(states, steps[name])
    medians = {k: {s: round(1e3 * statistics.median(v), 3) for s, v in per.items()} for k, per in steps.items()}
    return {"cycles_each": ALTERNATIONS * block, "median_ms": medians,
            "aged_over_fresh": {s: round(medians["aged"][s] / medians["fresh"][s], 3) for s in STEPS}}


def run_metadata(segments: int, as_json: bool) -> int:
    from dflash_stream.store import Store, lease

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-metadata-"))
    try:
        aged = _Cycle(work / "store")
        store = aged.store
        states = torch.randn(TOKENS, len(LAYERS) * HIDDEN).to(torch.bfloat16)
        steps: dict[str, list[float]] = {name: [] for name in STEPS}
        largest = {"ready": 0, "segments": 0, "info": 0, "done": 0}
        for i in range(segments):
            aged.run(states, steps)
            if i % WINDOW == 0:
                for d in largest:
                    largest[d] = max(largest[d], len(list((store.path / d).iterdir())))
        # What a resuming extractor reads: every record, folded or not, by a process that read none yet.
        t0 = time.perf_counter()
        stored = Store.attach(store.path).stored_sample_ids()
        resume_s = time.perf_counter() - t0
        ledgers = list((store.path / "released").iterdir())
        ledger_bytes = sum(p.stat().st_size for p in ledgers)
        kept = {d: len(list((store.path / d).iterdir())) for d in ("info", "done")}
        window = min(WINDOW, max(2, segments // 10))
        alternating = _aged_vs_fresh(aged, _Cycle(work / "fresh"), states, window)
        report = {
            "segments": segments, "window": window,
            **{name: {"first": _ms(v[:window]), "last": _ms(v[-window:]),
                      "last_over_first": round(statistics.median(v[-window:]) / statistics.median(v[:window]), 3)}
               for name, v in steps.items()},
            "aged_vs_fresh": alternating,
            "largest_dir_entries": largest,
            "kept_records": kept,
            "ledger": {"files": len(ledgers), "bytes": ledger_bytes,
                       "bytes_per_segment": round(ledger_bytes / max(segments, 1), 1)},
            "stored_sample_ids": {"samples": len(stored.get(0, ())), "read_ms": round(1e3 * resume_s, 3)},
        }
    finally:
        lease.release_all()  # before the folder goes: its heartbeat would report the leases vanished
        shutil.rmtree(work, ignore_errors=True)
    if as_json:
        print(json.dumps(report))
    else:
        print(f"{segments:,} segments of {TOKENS} tokens; median (p90) latency in the first and last {window}")
        for name in STEPS:
            r = report[name]
            print(f"  {name:<8} first {r['first']['median_ms']:.3f} ({r['first']['p90_ms']:.3f}) ms   last "
                  f"{r['last']['median_ms']:.3f} ({r['last']['p90_ms']:.3f}) ms   ratio {r['last_over_first']:.2f}")
        fresh, old = report["aged_vs_fresh"]["median_ms"]["fresh"], report["aged_vs_fresh"]["median_ms"]["aged"]
        print(f"  alternating blocks, same load: a fresh store vs this one after {segments:,} segments: " + ", ".join(
            f"{name} {fresh[name]:.3f} vs {old[name]:.3f} ms" for name in STEPS))
        print(f"  largest listings: {report['largest_dir_entries']}; left in info/ and done/: "
              f"{report['kept_records']}")
        led, ids = report["ledger"], report["stored_sample_ids"]
        print(f"  released records folded into {led['files']} ledger file(s): {led['bytes']:,} bytes "
              f"({led['bytes_per_segment']} per segment); a resume reads the ids of {ids['samples']:,} samples in "
              f"{ids['read_ms']:.1f} ms")
    return 0
