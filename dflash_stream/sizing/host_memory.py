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

Per machine: the processes a launch puts on one machine hold these side by side. `plan` counts the busiest machine
against the RAM of the one it runs on (as it counts the disk), and `run`, `extract` and `train` check each
machine's own share of their launch against its available RAM at start-up (`check_machine`).
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
from dflash_stream.sizing import disk
from dflash_stream.sizing.memory import drafter_dims, target_dims
from dflash_stream.store import codecs, sizes
from dflash_stream.target_model import TargetShape, resolve_layer_ids, stored_layer_ids
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


def run_host_memory(cfg: Config, shape: TargetShape) -> dict[str, Any]:
    """`host_memory` from what `run` knows at start: the config and the target's shape (the codec's design ratio,
    one checkpoint of this drafter; the answers' index, well under 1 % of it, is left out)."""
    capture = resolve_layer_ids(shape.num_layers, cfg.target)
    width = len(stored_layer_ids(shape.num_layers, cfg.target, cfg.verifier_states)) * shape.hidden_size
    params = drafter_dims(cfg, target_dims(shape), len(capture)).num_parameters
    return host_memory(cfg, width, codecs.get(cfg.store.codec).design_ratio,
                       disk.checkpoint_bytes(cfg, params))


def machine_share(host: dict[str, Any], extractors: int, world: int, per_machine: int, machine: int,
                  single: bool = False) -> dict[str, Any]:
    """What the processes of one machine hold together. Ranks 0..E-1 extract and E..W-1 train (pipeline/roles.py),
    machine m runs ranks m*P..(m+1)*P-1, and trainer 0 (rank E) keeps the snapshot; one process that plays both
    roles (`single`) holds both."""
    extractor, trainer = host["extractor"]["total_bytes"], host["trainer"]["total_bytes"]
    snapshot = host["trainer"]["parts"].get("checkpoint_snapshot", 0)
    if single:
        return {"extractors": 1, "trainers": 1, "trainer_0": True, "bytes": extractor + trainer}
    ranks = range(machine * per_machine, min((machine + 1) * per_machine, world))
    n_e = sum(r < extractors for r in ranks)
    n_t = len(ranks) - n_e
    return {"extractors": n_e, "trainers": n_t, "trainer_0": extractors in ranks,
            "bytes": n_e * extractor + n_t * (trainer - snapshot) + (snapshot if extractors in ranks else 0)}


def busiest_machine(host: dict[str, Any], roles: dict[str, Any], launch: dict[str, Any]) -> dict[str, Any]:
    """`machine_share` of the machine of a launch that holds the most, beside this machine's RAM."""
    single = roles["mode"] == "single"
    world, per = launch["num_processes"], launch["processes_per_machine"]
    shares = [machine_share(host, roles["extractors"], world, per, m, single) for m in range(-(-world // per))]
    return {**max(shares, key=lambda share: share["bytes"]), "launch_trainers": roles["trainers"],
            "this_machine_bytes": psutil.virtual_memory().total}


def check_machine(host: dict[str, Any], extractors: int, world: int, per_machine: int, machine: int,
                  single: bool = False) -> str | None:
    """The start check of `run`, `extract` and `train` on each machine: a warning when the launch's processes there
    may hold more than the RAM available now (an upper bound, beside runtimes it does not count, so a warning
    rather than a refusal); None otherwise."""
    share = machine_share(host, extractors, world, per_machine, machine, single)
    available = psutil.virtual_memory().available
    if share["bytes"] <= available:
        return None
    snapshot = " and a checkpoint snapshot" if share["trainer_0"] and "checkpoint_snapshot" in host["trainer"]["parts"] \
        else ""
    return (f"the {share['extractors']} extractor(s) and {share['trainers']} trainer(s) of this launch on this machine "
            f"may hold {fmt_bytes(share['bytes'])} of hidden states{snapshot} in RAM beside their runtimes, and "
            f"{fmt_bytes(available)} is available; lower it with {host['knobs']}")
