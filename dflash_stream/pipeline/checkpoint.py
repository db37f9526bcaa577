"""Trainer checkpoints and the consumed-sample ledger on disk, written so that a crash at any instant leaves
either the previous complete checkpoint or the new one, never a mix.

Layout (OUTPUT = cfg.output_dir):
    checkpoints/step-N/   model.safetensors, drafter_spec.json, trainer_state.pt, trainer-R.pt per rank, COMPLETE
    checkpoints/.step-N.tmp/   the same while being written; renamed into place, then COMPLETE is written last
    ledger/trainer-R/N.jsonl   segment uses rank R trained between the previous checkpoint and step N
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

COMPLETE = "COMPLETE"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def ledger_dir(output_dir: str | Path, index: int) -> Path:
    return Path(output_dir) / "ledger" / f"trainer-{index}"


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    found = [p for p in root.glob("step-*") if p.name[5:].isdigit() and (p / COMPLETE).is_file()]
    return sorted(found, key=_step)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def checkpoint_step(path: Path | None) -> int:
    return 0 if path is None else _step(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_torch(obj: Any, path: Path) -> None:
    """torch.save then fsync: only plain containers and tensors, so `torch.load(weights_only=True)` reads it."""
    torch.save(obj, path)
    _fsync(path)


def load_torch(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def staging_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / f".step-{step}.tmp"


def begin(output_dir: str | Path, step: int) -> Path:
    """A fresh staging folder for checkpoint `step`. Leftovers of interrupted attempts (staging folders and
    folders without COMPLETE, at any step) are discarded first: one checkpoint is written at a time, so at most
    `train.keep_checkpoints` + 1 exist on disk, as `plan` counts them."""
    root = checkpoints_dir(output_dir)
    for path in root.glob("*step-*"):
        if path.is_dir() and not (path / COMPLETE).is_file():
            shutil.rmtree(path, ignore_errors=True)
    staging = staging_dir(output_dir, step)
    staging.mkdir(parents=True)
    return staging


def optimizer_state(optimizer: torch.optim.Optimizer, dtype: str) -> dict[str, Any]:
    """The optimizer's state_dict with its floating-point moments in `dtype` (train.optimizer_state_dtype).
    `load_state_dict` casts them back to the parameters' dtype on resume."""
    state = optimizer.state_dict()
    if dtype == "float32":
        return state
    target = getattr(torch, dtype)
    state["state"] = {
        index: {k: v.to(target) if k != "step" and torch.is_floating_point(v) else v for k, v in per_param.items()}
        for index, per_param in state["state"].items()
    }
    return state


def publish(output_dir: str | Path, step: int, keep: int = 2) -> Path:
    """Make the staged checkpoint durable: fsync its files, rename it into place, write COMPLETE last; then
    keep the newest `keep` complete checkpoints."""
    staging, final = staging_dir(output_dir, step), checkpoints_dir(output_dir) / f"step-{step}"
    for item in staging.iterdir():
        _fsync(item)
    _fsync(staging)
    # A folder of the same name without COMPLETE is a crashed earlier attempt at this step.
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    marker = final / COMPLETE
    marker.write_text(f"{step}\n")
    _fsync(marker)
    _fsync(final)
    _fsync(final.parent)
    _prune(output_dir, keep)
    return final


def _prune(output_dir: str | Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and abandoned partial folders below them."""
    complete = complete_checkpoints(output_dir)
    for old in complete[:-keep]:
        shutil.rmtree(old)
    oldest_kept = _step(complete[-keep]) if len(complete) >= keep else 0
    for path in checkpoints_dir(output_dir).glob("*step-*"):
        step = path.name.removeprefix(".").removeprefix("step-").removesuffix(".tmp")
        if step.isdigit() and int(step) < oldest_kept and not (path / COMPLETE).is_file():
            shutil.rmtree(path)


def write_ledger(output_dir: str | Path, index: int, step: int, entries: list[dict[str, Any]]) -> Path:
    """One JSON line per segment use trained since the previous checkpoint; atomic and durable."""
    folder = ledger_dir(output_dir, index)
    folder.mkdir(parents=True, exist_ok=True)
    path, tmp = folder / f"{step}.jsonl", folder / f".{step}.jsonl.tmp"
    tmp.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(folder)
    return path


def drop_ledger_after(output_dir: str | Path, index: int, step: int) -> list[Path]:
    """Delete this rank's ledger files newer than checkpoint `step`: they belong to a checkpoint that never
    completed, and the samples they list are trained again."""
    dropped = []
    for path in ledger_dir(output_dir, index).glob("*.jsonl"):
        if path.stem.isdigit() and int(path.stem) > step:
            path.unlink()
            dropped.append(path)
    return dropped
