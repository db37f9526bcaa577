"""The run's whole disk footprint, per filesystem: ring buffer + checkpoints + export + data + metrics.

The ring buffer is bounded by `store.budget`; everything else a run writes is sized here from the config:

    store        store.budget (the store never exceeds it)
    checkpoints  (train.keep_checkpoints + 1) x one checkpoint: the kept ones plus the one being written
                 (the oldest is pruned only after the new one is durable); one checkpoint is the drafter's
                 float32 weights, AdamW's two moments in train.optimizer_state_dtype, and each trainer's part
    export       OUTPUT/drafter/: the drafter's weights once more
    data         OUTPUT/data/: the data reports, and with data.regenerate the response cache (JSON token ids)
    metrics      OUTPUT/metrics/, ledger/, tensorboard/ and the small files (summary, config, eval, report)

The drafter's parameters, which checkpoints and the export hold, are `memory.DrafterDims.num_parameters`: the
one count the memory model uses too. `plan` shows the footprint (observe/plan.py renders it); `run` refuses at
start (`check_run_disk`), in one line, when it exceeds the free space of the filesystems the store and the output
folder live on (they may differ). Files the run already has there (a resumed run's store and checkpoints) count
as free: they are reused, not added.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

from dflash_stream.config import Config
from dflash_stream.errors import DFlashError
from dflash_stream.sizing.inputs import plan_mean_tokens, plan_samples
from dflash_stream.sizing.memory import drafter_dims, target_dims
from dflash_stream.target_model.layers import stored_layer_ids
from dflash_stream.target_model.shape import MLP_PER_HIDDEN, TargetShape
from dflash_stream.units import fmt_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
WEIGHT_BYTES = 4
"""The trainer keeps the drafter in float32 (bf16 is autocast only), so checkpoints and the export hold fp32."""
FILE_BLOCK = 4096
"""Allocation rounding of each small file (du counts blocks, not bytes)."""
RNG_STATE_BYTES = 3 * 5056 + 4096
"""One trainer part: the sampling generator's, torch's and CUDA's RNG states (5,056 B each) and pickle framing."""
SAMPLE_ID_BYTES = 21
"""A sample id (up to 19 digits) with its JSON separator, as the data reports, ledger and claims write it."""
RESPONSE_TOKEN_BYTES = 8
"""A generated token id in the response cache's JSON (`151643, `)."""
TRAIN_EVENT_BYTES = 320
"""One `train` metrics line without its per-slot accuracies (~20 B each)."""
SEGMENT_EVENT_BYTES = 700
"""Metrics lines per segment use: its `extract` and `store` events, its share of `checkpoint` events."""
SMALL_FILES_BYTES = 2 * 2**20
"""summary.json, config.yaml, eval.json, the report PNGs, summary parts."""


def trainer_count(cfg: Config) -> int:
    """roles.trainers, where `auto` is not resolved yet: one (more trainers only shorten the metrics)."""
    return cfg.roles.trainers if isinstance(cfg.roles.trainers, int) else 1


def drafter_params_source(cfg: Config, target: TargetShape) -> str:
    """Where the drafter's widths (its MLP's above all) come from, as `plan` labels its parameter count."""
    if cfg.drafter.intermediate_size:
        return "config (drafter.*)"
    if target.config is not None:
        return "the target's config"
    if target.intermediate_size:
        return "config (target.intermediate_size)"
    return f"assumed: MLP width {MLP_PER_HIDDEN} x hidden (set target.intermediate_size)"


def checkpoint_bytes(cfg: Config, params: int, claim_samples: float = 0.0) -> int:
    """One checkpoint on disk: weights, optimizer moments, each trainer's part (RNG states and the claims it
    holds, `claim_samples` sample ids at most), a few small files."""
    moments = 2 * params * DTYPE_BYTES[cfg.train.optimizer_state_dtype]
    parts = trainer_count(cfg) * (RNG_STATE_BYTES + 2 * SAMPLE_ID_BYTES * claim_samples + FILE_BLOCK)
    # safetensors/pickle headers (~100 B per tensor), drafter_spec.json, COMPLETE, the folder itself
    return int(params * WEIGHT_BYTES + moments + parts + 400 * (12 * cfg.drafter.num_layers + 4) + 4 * FILE_BLOCK)


def run_parts(cfg: Config, params: int, samples: int | None, mean_tokens: float, total_steps: int | None,
              segment_uses: int | None, samples_in_budget: float) -> dict[str, int]:
    """Bytes of each part of the footprint (name -> bytes); parts that need the data's size count 0 without it."""
    epochs = cfg.train.epochs
    data = metrics = 0
    if samples:
        data = samples * SAMPLE_ID_BYTES + FILE_BLOCK * trainer_count(cfg)
        if cfg.data.regenerate:
            response = min(mean_tokens, cfg.data.generation.max_new_tokens)
            data += int(samples * response * RESPONSE_TOKEN_BYTES)
        metrics += samples * epochs * SAMPLE_ID_BYTES  # the ledger: every trained id of every epoch
    if total_steps:
        slots = cfg.drafter.block_size - 1
        events = total_steps // cfg.train.log_every + 1
        metrics += events * (TRAIN_EVENT_BYTES + 20 * slots) * trainer_count(cfg)
        if cfg.metrics.tensorboard:
            metrics += events * (7 + slots) * 64
    if segment_uses:
        metrics += segment_uses * SEGMENT_EVENT_BYTES
    parts = {
        "store": int(cfg.store.budget),
        "checkpoints": (cfg.train.keep_checkpoints + 1) * checkpoint_bytes(cfg, params, samples_in_budget),
        "export": params * WEIGHT_BYTES + 8 * FILE_BLOCK,  # + config.json and the modeling file it carries
        "data": data,
        "metrics": metrics + SMALL_FILES_BYTES,
    }
    if cfg.extract.engine == "vllm":  # the servers' state files until the extractors pack them
        parts["spool"] = int(cfg.extract.spool_bytes)
    return parts


def part_paths(cfg: Config) -> dict[str, list[Path]]:
    """Where each part lives (the first path decides the filesystem)."""
    from dflash_stream.target_model.vllm_serve import spool_dir

    out = Path(cfg.output_dir).absolute()
    return {
        "spool": [spool_dir(cfg)],
        "store": [Path(cfg.store.path).absolute()],
        "checkpoints": [out / "checkpoints"],
        "export": [out / "drafter"],
        "data": [out / "data"],
        "metrics": [out / "metrics", out / "ledger", out / "tensorboard"],
    }


def existing_ancestor(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where free space can be asked before a folder is made)."""
    while not path.exists():
        path = path.parent
    return path


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem `path` (or its nearest existing ancestor) is on."""
    path = existing_ancestor(path.absolute()).resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def _du(path: Path) -> int:
    from dflash_stream.store.budget import du

    return du(path) if path.exists() else 0


def footprint(cfg: Config, parts: dict[str, int]) -> dict[str, Any]:
    """The parts grouped by filesystem against its free space; `fits` when every filesystem has room."""
    paths = part_paths(cfg)
    by_fs: dict[str, dict[str, Any]] = {}
    for name, size in parts.items():
        mount = str(mount_point(paths[name][0]))
        fs = by_fs.setdefault(mount, {"parts": [], "need_bytes": 0, "existing_bytes": 0,
                                      "free_bytes": shutil.disk_usage(mount).free})
        fs["parts"].append(name)
        fs["need_bytes"] += size
        fs["existing_bytes"] += sum(_du(p) for p in paths[name])
    for fs in by_fs.values():
        # This run's own files are already there: they are reused (the store) or replaced (checkpoints).
        fs["available_bytes"] = fs["free_bytes"] + fs["existing_bytes"]
        fs["fits"] = fs["need_bytes"] <= fs["available_bytes"]
    return {
        "parts": parts, "total_bytes": sum(parts.values()),
        "filesystems": {mount: fs["free_bytes"] for mount, fs in by_fs.items()},
        "by_filesystem": by_fs, "fits": all(fs["fits"] for fs in by_fs.values()),
    }


def describe_parts(cfg: Config, parts: dict[str, int], names: list[str]) -> str:
    """`store budget 140 GB + checkpoints 2 x 31 GB + ...` for the named parts."""
    words = []
    for name in names:
        if name == "checkpoints":
            n = cfg.train.keep_checkpoints + 1
            words.append(f"checkpoints {n} x {fmt_bytes(parts[name] / n)}")
        else:
            words.append(f"{'store budget' if name == 'store' else name} {fmt_bytes(parts[name])}")
    return " + ".join(words)


def refusal(cfg: Config, disk: dict[str, Any]) -> str | None:
    """The one line `run` stops with when the footprint exceeds a filesystem's free space; None when it fits."""
    for mount, fs in disk["by_filesystem"].items():
        if fs["fits"]:
            continue
        own = f", {fmt_bytes(fs['existing_bytes'])} of it this run's own files" if fs["existing_bytes"] else ""
        return (f"not enough disk: this run needs {fmt_bytes(fs['need_bytes'])} on {mount} "
                f"({describe_parts(cfg, disk['parts'], fs['parts'])}) but {fmt_bytes(fs['available_bytes'])} is "
                f"free there{own}; lower store.budget or train.keep_checkpoints, or set "
                "train.optimizer_state_dtype=bfloat16 (see `dflash-stream plan`)")
    return None


def footprint_for(cfg: Config, target: TargetShape, num_capture_layers: int, samples: int | None,
                  mean_tokens: float | None, tune: dict | None, ratio: float | None = None) -> dict[str, Any]:
    """The whole disk footprint from the plan's figures; unknown ones are counted here."""
    if samples is None:
        samples = plan_samples(cfg, None)[0]
    if mean_tokens is None:
        mean_tokens = plan_mean_tokens(cfg, None, tune)[0]
    params = drafter_dims(cfg, target_dims(target), num_capture_layers).num_parameters
    from dflash_stream.store import codecs, sizes

    ratio = ratio or codecs.get(cfg.store.codec).design_ratio
    stored = len(stored_layer_ids(target.num_layers, cfg.target, cfg.verifier_states))  # the verifier's too
    per_sample = sizes.raw_bytes_per_token(stored * target.hidden_size) * mean_tokens
    tokens = samples * mean_tokens if samples else None
    steps = cfg.train.total_steps or (math.ceil(tokens * cfg.train.epochs / (
        cfg.train.batch_tokens * cfg.train.grad_accum * trainer_count(cfg))) if tokens else None)
    if steps and cfg.train.max_steps:
        steps = min(steps, cfg.train.max_steps)
    uses = (math.ceil(per_sample * samples / int(cfg.store.segment_bytes)) * cfg.extraction_passes
            * cfg.store.reuse if samples else None)
    parts = run_parts(cfg, params, samples, mean_tokens, steps, uses,
                      samples_in_budget=min(int(cfg.store.budget) / (per_sample / ratio), samples or math.inf))
    return {**footprint(cfg, parts), "drafter_params": params,
            "drafter_params_source": drafter_params_source(cfg, target)}


def check_run_disk(cfg: Config, shape: TargetShape, layer_ids: list[int]) -> dict[str, Any]:
    """`run`'s start check: the footprint from the config and the target's shape; DFlashError when it does
    not fit. The data's size comes from `plan`'s counting (local sources; hub sources count 0 here)."""
    disk = footprint_for(cfg, shape, len(layer_ids), samples=None, mean_tokens=None, tune=None)
    message = refusal(cfg, disk)
    if message:
        raise DFlashError(message)
    return disk
