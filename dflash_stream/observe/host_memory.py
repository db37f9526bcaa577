"""Host memory per role: the hidden states each process holds in RAM beside its own runtime (Python, torch,
the CUDA context), counted from the buffers the code keeps at the configured sizes.

- extractor: forward batches' captured states waiting to be packed (`extract.queue_size` queued, one being
  copied off the device and one being packed; on CUDA in pinned memory, which torch's host allocator keeps
  once allocated), the segment being filled (copies of its samples' states), and that segment's coded files,
  encoded in memory before they are written; a replay of a kept store adds its reshuffle window; with
  data.regenerate, the response cache's index of every answer (never the answers themselves).
- trainer: decoded segments: `READER_PREFETCH` ready, one being decoded, and those whose samples wait in the
  token batcher. A queued sample's states are a view of its segment's decoded buffer, so one sample keeps its
  whole segment: HOLD_BATCHES + 1 batches' worth of queued tokens, plus one segment per length bucket for a
  sample left behind in a bucket that fills slowly.

Per machine: the processes a launch puts on one machine hold these side by side (the busiest machine is counted,
against this machine's RAM, as `plan` counts the disk against this machine's).
"""

from __future__ import annotations

import math
from typing import Any

import psutil

from dflash_stream.config import (
    HOLD_BATCHES,
    MAX_LENGTH_BUCKETS,
    READER_PREFETCH,
    REPLAY_WINDOW_BYTES,
    Config,
)
from dflash_stream.regenerate.cache import INDEX_BYTES_PER_ANSWER
from dflash_stream.store import sizes
from dflash_stream.units import fmt_bytes


def host_memory(cfg: Config, width: int, ratio: float, checkpoint_bytes: float = 0,
                answers: int | None = None) -> dict[str, Any]:
    """Bytes of host RAM each role holds at most for hidden states, part by part; `width` = K*D, `ratio` the
    codec's compression (raw over stored); with train.async_checkpoint, trainer 0 also keeps a host snapshot of
    one checkpoint (`checkpoint_bytes`) for the whole run, written in the background; with data.regenerate each
    extractor holds the response cache's index of every one of the `answers` (the data's samples)."""
    per_token = sizes.raw_bytes_per_token(width)
    segment = sizes.max_segment_raw_bytes(int(cfg.store.segment_bytes), cfg.data.max_length, width)
    states_per_batch = cfg.extract.batch_tokens * (per_token - sizes.IDS_MASK_BYTES_PER_TOKEN)
    extractor = {"captured_batches": (cfg.extract.queue_size + 2) * states_per_batch,
                 "segment_being_filled": segment, "coded_segment": int(segment / ratio)}
    if cfg.extract.from_store and cfg.extraction_passes > 1:
        extractor["replay_window"] = REPLAY_WINDOW_BYTES
    if cfg.data.regenerate and answers:
        extractor["answers_index"] = answers * INDEX_BYTES_PER_ANSWER
    buckets = len(cfg.train.length_buckets) if cfg.train.length_buckets else MAX_LENGTH_BUCKETS
    queued = math.ceil((HOLD_BATCHES + 1) * cfg.train.batch_tokens * per_token / segment) + buckets
    trainer = {"decoded_ahead": (READER_PREFETCH + 1) * segment, "held_by_batcher": queued * segment}
    if cfg.train.async_checkpoint and checkpoint_bytes:
        trainer["checkpoint_snapshot"] = int(checkpoint_bytes)
    return {
        "extractor": {"total_bytes": sum(extractor.values()), "parts": extractor},
        "trainer": {"total_bytes": sum(trainer.values()), "parts": trainer, "segments_held_by_batcher": queued},
        "knobs": "store.segment_bytes, extract.queue_size, extract.batch_tokens"
                 + (", train.async_checkpoint: false" if cfg.train.async_checkpoint and checkpoint_bytes else ""),
    }


def busiest_machine(host: dict[str, Any], roles: dict[str, Any], launch: dict[str, Any]) -> dict[str, Any]:
    """The machine whose processes hold the most of these bytes together. Ranks 0..E-1 extract and E..W-1 train
    (pipeline/roles.py), machine m runs ranks m*P..(m+1)*P-1, and trainer 0 (rank E) keeps the snapshot; one process
    that plays both roles holds both."""
    extractor, trainer = host["extractor"]["total_bytes"], host["trainer"]["total_bytes"]
    snapshot = host["trainer"]["parts"].get("checkpoint_snapshot", 0)
    if roles["mode"] == "single":
        best = {"extractors": 1, "trainers": 1, "trainer_0": True, "bytes": extractor + trainer}
    else:
        e, w, p = roles["extractors"], launch["num_processes"], launch["processes_per_machine"]
        best = {"bytes": -1}
        for first in range(0, w, p):
            ranks = range(first, min(first + p, w))
            n_e = sum(r < e for r in ranks)
            n_t = len(ranks) - n_e
            held = n_e * extractor + n_t * (trainer - snapshot) + (snapshot if e in ranks else 0)
            if held > best["bytes"]:
                best = {"extractors": n_e, "trainers": n_t, "trainer_0": e in ranks, "bytes": held}
    return {**best, "launch_trainers": roles["trainers"], "this_machine_bytes": psutil.virtual_memory().total}


def render_host_memory(host: dict[str, Any]) -> list[str]:
    out = [f"host memory per process  (hidden states held in RAM, beside the process's own runtime; lower it "
           f"with {host['knobs']})"]
    for role in ("extractor", "trainer"):
        r = host[role]
        parts = ", ".join(f"{name.replace('_', ' ')} {fmt_bytes(n)}" for name, n in r["parts"].items())
        # Only trainer 0 writes the model and optimizer files, so only it keeps their snapshot.
        label = "trainer 0" if "checkpoint_snapshot" in r["parts"] else role
        out.append(f"  {label:<10} up to {fmt_bytes(r['total_bytes']):>10}  ({parts})")
    m = host.get("machine")
    if "checkpoint_snapshot" in host["trainer"]["parts"] and (m is None or m["launch_trainers"] > 1):
        others = host["trainer"]["total_bytes"] - host["trainer"]["parts"]["checkpoint_snapshot"]
        out.append(f"  {'trainer 1+':<10} up to {fmt_bytes(others):>10}  (the same without the snapshot)")
    if m:
        who = f"{m['extractors']} extractor(s) + {m['trainers']} trainer(s)" + (", trainer 0 among them"
                                                                               if m["trainer_0"] else "")
        out.append(f"  {'machine':<10} up to {fmt_bytes(m['bytes']):>10}  (the busiest: {who}; this machine has "
                   f"{fmt_bytes(m['this_machine_bytes'])} of RAM)")
    return out
