"""Trainer checkpoints and the consumed-sample ledger on disk, written so that a crash at any instant leaves
either the previous complete checkpoint or the new one, never a mix. Where they live is `RunDir`'s.

A checkpoint folder holds model.safetensors, drafter_spec.json, trainer_state.pt (rank 0) and trainer-R.pt per
rank; it is staged in `.step-N.tmp/`, renamed into place, and its COMPLETE marker is written last. A staging
folder that a background thread of this process is still writing (train.async_checkpoint, checkpoint_writer.py)
is never taken for a crashed attempt: `begin` and the pruning after `publish` leave it alone.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dflash_stream.diskfull import retry_when_full
from dflash_stream.errors import DFlashError
from dflash_stream.rundir import COMPLETE, RunDir, checkpoint_step, fsync, write_atomic
from dflash_stream.store.budget import du

__all__ = ["COMPLETE", "SHARED_STATE", "CheckpointFailed", "FileNotWritten", "begin", "checkpoint_step",
           "complete_checkpoints", "drop_ledger_after", "latest_checkpoint", "ledger_dir", "load", "load_torch",
           "naming_file", "optimizer_state", "prune", "publish", "rank_state_file", "Saved", "save_torch",
           "write_ledger", "write_part", "writing", "WRITE_DELAY_ENV"]

SHARED_STATE = "trainer_state.pt"
"""Optimizer, scheduler and the step's counters, written by rank 0."""
WRITE_DELAY_ENV = "DFLASH_STREAM_TEST_CHECKPOINT_WRITE_DELAY"
"""Test hook: seconds each rank's checkpoint write pauses half-way (its own file written, the shared ones not), so
a test can kill a process while a checkpoint is being written."""



class FileNotWritten(DFlashError):
    """A file of a checkpoint that could not be written or deleted: its path and the error, in one line."""


class CheckpointFailed(DFlashError):
    """A trainer rank could not write its part of a checkpoint (or publish it, or delete an old one): the
    checkpoint is not published and every trainer stops with this one line."""


@contextmanager
def naming_file(path: Path, doing: str = "write") -> Iterator[None]:
    """Re-raise any error of the block as FileNotWritten naming `path` (a write's EIO carries no file name); a
    DFlashError (a disk that stayed full) already says what it was writing, in words."""
    try:
        yield
    except FileNotWritten:
        raise
    except DFlashError as err:
        raise FileNotWritten(str(err)) from err
    except Exception as err:
        raise FileNotWritten(f"could not {doing} {path}: {type(err).__name__}: {err}") from err


_in_flight: set[Path] = set()
_in_flight_lock = threading.Lock()


@contextmanager
def writing(staging: Path) -> Iterator[None]:
    """Mark `staging` as being written by a thread of this process while the block runs."""
    with _in_flight_lock:
        _in_flight.add(staging)
    try:
        yield
    finally:
        with _in_flight_lock:
            _in_flight.discard(staging)


def _abandoned(paths: list[tuple[int, Path]]) -> list[tuple[int, Path]]:
    """Incomplete checkpoint folders no thread of this process is writing: interrupted attempts."""
    with _in_flight_lock:
        return [(step, path) for step, path in paths if path not in _in_flight]


def rank_state_file(rank: int | str) -> str:
    """Each trainer rank's own state: its data position, random streams and sample count ("*": a glob)."""
    return f"trainer-{rank}.pt"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return RunDir(output_dir).complete_checkpoints()


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    return RunDir(output_dir).latest_checkpoint()


def ledger_dir(output_dir: str | Path, index: int) -> Path:
    return RunDir(output_dir).ledger(index)


def save_torch(obj: Any, path: Path) -> None:
    """torch.save then fsync: only plain containers and tensors, so `torch.load(weights_only=True)` reads it.
    A full disk is waited out (see diskfull.py): the file is rewritten whole."""

    def write() -> None:
        with open(path, "wb") as f:
            out = _Recorder(f)
            try:
                torch.save(obj, out)
            except RuntimeError:
                if out.error is not None:  # torch reports a full disk as a RuntimeError; say what it was
                    raise out.error from None
                raise
            f.flush()
            os.fsync(f.fileno())

    retry_when_full(f"checkpoint file {path}", path.parent, write)


class _Recorder:
    """The file torch.save writes through, keeping the OSError that torch's writer turns into a RuntimeError."""

    def __init__(self, file) -> None:
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def load_torch(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def begin(output_dir: str | Path, step: int) -> Path:
    """A fresh staging folder for checkpoint `step`. Leftovers of interrupted attempts (staging folders and
    folders without COMPLETE, at any step) are discarded first: one checkpoint is written at a time, so at most
    `train.keep_checkpoints` + 1 exist on disk, as `plan` counts them."""
    run = RunDir(output_dir)
    for _, path in _abandoned(run.incomplete_checkpoints()):
        shutil.rmtree(path, ignore_errors=True)
    staging = run.staging(step)
    retry_when_full(f"checkpoint folder {staging}", staging.parent, lambda: staging.mkdir(parents=True, exist_ok=True))
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


def publish(output_dir: str | Path, step: int, keep: int = 2, prune: bool = True) -> Path:
    """Make the staged checkpoint durable: fsync its files, rename it into place, write COMPLETE last; then
    keep the newest `keep` complete checkpoints (train.keep_checkpoints). `prune` off: the caller prunes later
    (deleting gigabytes of an old checkpoint took 0.4 s, which a background checkpoint does off the training
    thread)."""
    run = RunDir(output_dir)
    staging, final = run.staging(step), run.checkpoint(step)
    for item in staging.iterdir():
        fsync(item)
    fsync(staging)
    # A folder of the same name without COMPLETE is a crashed earlier attempt at this step.
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    marker = final / COMPLETE
    retry_when_full(f"checkpoint marker {marker}", final, lambda: marker.write_text(f"{step}\n"))
    fsync(marker)
    fsync(final)
    fsync(final.parent)
    if prune:
        _prune(run, keep)
    return final


def prune(output_dir: str | Path, keep: int) -> None:
    _prune(RunDir(output_dir), keep)


def _prune(run: RunDir, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and abandoned partial folders below them.
    A folder that cannot be deleted (an NFS server refusing an rmtree) raises FileNotWritten naming it and what it
    still holds on disk: not a line printed by a thread and forgotten while the disk fills."""
    complete = run.complete_checkpoints()
    oldest_kept = checkpoint_step(complete[-keep]) if len(complete) >= keep else 0
    doomed = complete[:-keep] + [path for step, path in _abandoned(run.incomplete_checkpoints()) if step < oldest_kept]
    for path in doomed:
        try:
            shutil.rmtree(path)
        except OSError as err:
            left = du(path) if path.exists() else 0
            raise FileNotWritten(f"could not delete the old checkpoint {path} ({left:,} bytes still on disk): "
                                 f"{type(err).__name__}: {err}") from err


class Saved(NamedTuple):
    """A checkpoint `save` made durable, and what it cost this rank."""

    path: Path
    write_seconds: float
    """Seconds this rank spent writing and syncing its files (rank 0: the shared state and the publish too); the
    rest of the stall is waiting for the other ranks at the barriers."""
    bytes: int
    """Size of the checkpoint folder (what every checkpoint writes; `plan` sizes it ahead)."""


def write_part(output_dir: str | Path, step: int, rank: int, *, rank_state: dict[str, Any],
               ledger: list[dict[str, Any]], write_shared: Callable[[Path], None] | None) -> float:
    """This rank's share of checkpoint `step`, durable on return, into the staging folder rank 0's `begin` made:
    its ledger, its `trainer-<rank>.pt`, and (rank 0) the shared files. Seconds it took. Everything it writes is
    fsynced here, so that `publish` (on the training thread, when the write ran in the background) only renames
    and marks."""
    started = time.perf_counter()
    run = RunDir(output_dir)
    staging = run.staging(step)
    with naming_file(run.ledger_file(rank, step)):
        write_ledger(output_dir, rank, step, ledger)
    with naming_file(staging / rank_state_file(rank)):
        save_torch(rank_state, staging / rank_state_file(rank))
    delay = float(os.environ.get(WRITE_DELAY_ENV, 0))
    if delay:
        time.sleep(delay)
    if write_shared is not None:
        before = {item.name for item in staging.iterdir()}
        write_shared(staging)  # names its own files
        for item in staging.iterdir():
            if item.name not in before:
                with naming_file(item):
                    fsync(item)
    return time.perf_counter() - started


def load(path: Path, rank: int, trainers: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared state, this rank's state) of checkpoint `path`, refused in one line when it was written by
    another number of trainers (each rank's data position is in its own file)."""
    parts = sorted(p.name for p in path.glob(rank_state_file("*")))
    if len(parts) != trainers:
        raise DFlashError(
            f"checkpoint {path} was written by {len(parts)} trainer(s) but this launch has {trainers}; "
            "resume with the same number of trainers (roles.trainers)"
        )
    return load_torch(path / SHARED_STATE), load_torch(path / rank_state_file(rank))


def write_ledger(output_dir: str | Path, index: int, step: int, entries: list[dict[str, Any]]) -> Path:
    """One JSON line per segment use trained since the previous checkpoint; atomic and durable."""
    path = RunDir(output_dir).ledger_file(index, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, "".join(json.dumps(entry) + "\n" for entry in entries), durable=True)


def drop_ledger_after(output_dir: str | Path, index: int, step: int) -> list[Path]:
    """Delete this rank's ledger files newer than checkpoint `step`: they belong to a checkpoint that never
    completed, and the samples they list are trained again."""
    dropped = []
    for ledger_step, path in RunDir(output_dir).ledger_files(index):
        if ledger_step > step:
            path.unlink()
            dropped.append(path)
    return dropped
