"""How one trainer rank writes a checkpoint: synchronously, training standing still until it is durable, or in
the background (train.async_checkpoint), training going on while a thread writes a host-memory snapshot.

The exactly-once rule does not change: the segment uses a checkpoint records as finished are released only once
it is durable (COMPLETE written and fsynced). A background write only makes them wait longer on disk, and the
store's budget counts them until they are deleted, so extractors stay blocked meanwhile rather than overrun it.

The background protocol keeps every collective on the training thread:

1. `start` (every rank at the same step): rank 0 makes the staging folder, a barrier, then each rank copies its
   state to host memory and a thread writes its part (`checkpoint.write_part`, each file fsynced).
2. At later step boundaries the ranks learn from the step's all-reduce whether every part's write has ended
   (`written` is this rank's vote: done, well or not). Then `complete()`: the ranks agree on how their writes
   ended (`agree`, an all-gather of each rank's failure line), rank 0 publishes (rename, COMPLETE, fsync) only
   when none failed, a barrier, and the caller releases. The next checkpoint, and the end of training, call
   `complete()` without waiting for the vote: each rank first waits for its own write (at most one background
   write at a time).

A write that fails on any rank (EIO, ESTALE, a disk still full after its wait) is never published: every rank
raises CheckpointFailed with the same one line naming the rank, the file and the error, and the next launch
resumes from the previous checkpoint. Creating the staging folder, publishing and deleting old checkpoints
(`prune`, in a thread after a background publish) report their failures the same way at the next agreement.

A crash while a part is being written leaves a staging folder without COMPLETE: the previous complete checkpoint
is what a resume loads, and the ledger files of the unfinished one are dropped then (`drop_ledger_after`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_stream.diskfull import retry_when_full
from dflash_stream.drafter.export import WEIGHTS, save_checkpoint_weights
from dflash_stream.drafter.spec import DrafterSpec
from dflash_stream.pipeline import checkpoint as ckpt
from dflash_stream.rundir import RunDir

SharedState = dict[str, Any]
"""What rank 0 writes for all: {"weights": the drafter's tensors, "trainer_state": optimizer, scheduler, counters}."""


class HostSnapshot:
    """A copy of nested state (dicts, lists, tuples, tensors, plain values) in host memory. Its buffers are kept
    and reused by the next snapshot of the same layout: a fresh allocation of gigabytes costs page faults on every
    checkpoint, and on CUDA pinned buffers make the device-to-host copy a DMA. Reuse is safe because a snapshot is
    taken only once the previous one was written (one background write at a time)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def copy(self, state: Any) -> Any:
        copied = self._copy(state, "")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return copied

    def _copy(self, value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, key)
        if isinstance(value, dict):
            return {k: self._copy(v, f"{key}/{k}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [self._copy(v, f"{key}/{i}") for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value  # numbers, strings, None: immutable

    def _tensor(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[key] = buffer
        if tensor.is_cuda:
            buffer.copy_(tensor, non_blocking=True)
        elif tensor.device.type == "cpu" and tensor.is_contiguous():
            # A plain memcpy: torch's copy_ wakes its thread pool for each tensor, which on a busy machine cost
            # ~7 ms per tensor (measured on 2 shared cores), 100x the memcpy of a 1 MB one; large ones run alike.
            np.copyto(_bytes(buffer), _bytes(tensor))
        else:
            buffer.copy_(tensor)
        return buffer


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a flat numpy byte array (any dtype, bfloat16 included)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


class BackgroundWrite:
    """One rank's part of one checkpoint, written by a thread. The thread is a daemon: a process that dies
    leaves a staging folder without COMPLETE, which is what a crash during a write must leave."""

    def __init__(self, staging: Path, write: Callable[[], float]) -> None:
        self.staging = staging
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._write = write
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-{staging.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with ckpt.writing(self.staging):
                self.seconds = self._write()
        except BaseException as err:  # handed to the training thread by `wait`
            self.error = err
        finally:
            self._done.set()  # ended, well or not: `wait` tells which

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> str | None:
        """Block until the write ended; None when the part is written, else what failed, in words."""
        self._thread.join()
        return None if self.error is None else _failure(self.error, f"write its part in {self.staging}")


def _failure(err: BaseException, doing: str) -> str:
    """What went wrong on this rank, as the clause of CheckpointFailed's line (FileNotWritten names its file)."""
    return str(err) if isinstance(err, ckpt.FileNotWritten) else f"could not {doing}: {type(err).__name__}: {err}"


class CheckpointWriter:
    """One rank's checkpoint writes, the old way (`save`) or the background way (`start` ... `complete`).
    `barrier` syncs the trainer ranks; `agree` all-gathers each rank's failure line (None: all went well), so
    that a failure on any rank stops every rank at the same point with the same line (both no-ops for one
    trainer)."""

    def __init__(self, output_dir: str | Path, rank: int, spec: DrafterSpec, *, barrier: Callable[[], None],
                 agree: Callable[[str | None], list[str | None]] | None = None, keep: int = 2) -> None:
        self.run = RunDir(output_dir)
        self.rank, self.spec, self.barrier, self.keep = rank, spec, barrier, keep
        self.agree = agree or (lambda failure: [failure])
        self.host = HostSnapshot()
        self.pending: BackgroundWrite | None = None
        self.pending_step: int | None = None
        self._pruning: threading.Thread | None = None
        self._prune_failure: str | None = None

    def _write_shared(self, shared: SharedState) -> Callable[[Path], None]:
        def write(staging: Path) -> None:
            with ckpt.naming_file(staging / WEIGHTS):
                retry_when_full(f"checkpoint model in {staging}", staging,
                                lambda: save_checkpoint_weights(shared["weights"], self.spec, staging))
            with ckpt.naming_file(staging / ckpt.SHARED_STATE):
                ckpt.save_torch(shared["trainer_state"], staging / ckpt.SHARED_STATE)
        return write

    def _agreed(self, step: int, failure: str | None, what: str) -> None:
        """Collective: raise CheckpointFailed, with the same line on every rank, when any rank's `failure` (what
        went wrong on it) is set; `what` says what that means for checkpoint `step`."""
        mine = f"{what}: trainer rank {self.rank}: {failure}" if failure else None
        failures = [f for f in self.agree(mine) if f]
        if failures:
            latest = self.run.latest_checkpoint()
            others = f" (and on {len(failures) - 1} other rank(s))" if len(failures) > 1 else ""
            again = "" if "run the same command again" in failures[0] else " (run the same command again)"
            raise ckpt.CheckpointFailed(
                f"checkpoint step-{step} {failures[0]}{others}; the next launch resumes from "
                f"{latest.name if latest is not None else 'the start'}{again}")

    def _begin(self, step: int) -> None:
        """Rank 0 stages the folder once older checkpoints are deleted; every rank learns of a failure of either."""
        failure = self.settle(collective=False)
        if self.rank == 0 and failure is None:
            try:
                ckpt.begin(self.run.root, step)
            except Exception as err:
                failure = _failure(err, f"create {self.run.staging(step)}")
        self._agreed(step, failure, "was not started")

    def _publish(self, step: int, background: bool) -> float:
        """Rank 0 publishes (and, written synchronously, prunes); every rank learns of a failure. Seconds spent."""
        started = time.perf_counter()
        failure, what = None, "was not published"
        if self.rank == 0:
            try:
                ckpt.publish(self.run.root, step, self.keep, prune=False)
            except Exception as err:
                failure = _failure(err, f"publish {self.run.staging(step)}")
            if failure is None and background:
                # Older checkpoints are deleted off the training thread; the next `start` waits for it, so disk
                # holds at most keep complete checkpoints + the one being written, as with synchronous writes.
                self._pruning = threading.Thread(target=self._prune, name="checkpoint-prune", daemon=True)
                self._pruning.start()
            elif failure is None:
                self._prune()
                failure, self._prune_failure = self._prune_failure, None
                what = "is published but older ones could not be deleted"
        seconds = time.perf_counter() - started
        self._agreed(step, failure, what)
        return seconds

    def _prune(self) -> None:
        try:
            ckpt.prune(self.run.root, self.keep)
        except Exception as err:  # reported at the next agreement, by `settle`
            self._prune_failure = _failure(err, f"delete old checkpoints in {self.run.checkpoints}")

    def _saved(self, step: int, seconds: float) -> ckpt.Saved:
        final = self.run.checkpoint(step)
        return ckpt.Saved(final, seconds, sum(f.stat().st_size for f in final.iterdir() if f.is_file()))

    def save(self, step: int, *, rank_state: dict[str, Any], ledger: list[dict[str, Any]],
             shared: Callable[[], SharedState] | None) -> ckpt.Saved:
        """Write checkpoint `step` and return once it is durable (collective). `shared`: rank 0's state. Rank 0
        stages the folder, every rank writes its ledger and its `trainer-<rank>.pt`, rank 0 also the shared
        files, and once every rank's part is written rank 0 publishes it."""
        started = time.perf_counter()
        self._begin(step)
        seconds = time.perf_counter() - started
        failure = None
        try:
            seconds += ckpt.write_part(self.run.root, step, self.rank, rank_state=rank_state, ledger=ledger,
                                       write_shared=self._write_shared(shared()) if shared is not None else None)
        except Exception as err:
            failure = _failure(err, f"write its part in {self.run.staging(step)}")
        self._agreed(step, failure, "was not published")
        seconds += self._publish(step, background=False)
        self.barrier()  # COMPLETE is durable before any rank releases what the checkpoint records
        return self._saved(step, seconds)

    def start(self, step: int, *, rank_state: dict[str, Any], ledger: list[dict[str, Any]],
              shared: Callable[[], SharedState] | None) -> None:
        """Snapshot this rank's state to host memory and start writing it in the background (collective).
        `rank_state` and `ledger` must be copies the caller no longer changes."""
        if self.pending is not None:
            raise RuntimeError(f"checkpoint step-{self.pending_step} is still being written; complete it first")
        self._begin(step)  # the staging folder exists before any rank writes into it
        write_shared = self._write_shared(self.host.copy(shared())) if shared is not None else None

        def write() -> float:
            return ckpt.write_part(self.run.root, step, self.rank, rank_state=rank_state, ledger=ledger,
                                   write_shared=write_shared)

        self.pending, self.pending_step = BackgroundWrite(self.run.staging(step), write), step

    @property
    def written(self) -> bool:
        """This rank's vote: the write of its part of the pending checkpoint ended, well or not (or nothing is
        pending); `complete` tells the ranks which."""
        return self.pending is None or self.pending.done

    def complete(self) -> ckpt.Saved:
        """Make the pending checkpoint durable (collective; every rank calls it at the same step, after the
        step's all-reduce said every write ended, or waiting here for its own). Raises CheckpointFailed on every
        rank, publishing nothing, when any rank's part failed."""
        if self.pending is None or self.pending_step is None:
            raise RuntimeError("no checkpoint is being written")
        pending, step = self.pending, self.pending_step
        failure = pending.wait()
        self.pending = self.pending_step = None
        self._agreed(step, failure, "was not published")
        seconds = pending.seconds + self._publish(step, background=True)
        self.barrier()  # COMPLETE is durable before any rank releases what the checkpoint records
        return self._saved(step, seconds)

    def settle(self, collective: bool = True) -> str | None:
        """Wait for the deletion of older checkpoints (if any) to end: before the next checkpoint, and before
        training returns. `collective`: every rank learns of its failure and raises CheckpointFailed; otherwise
        the failure line is returned for the caller's own agreement."""
        if self._pruning is not None:
            self._pruning.join()
            self._pruning = None
        failure, self._prune_failure = self._prune_failure, None
        if collective:
            latest = self.run.latest_checkpoint()
            self._agreed(ckpt.checkpoint_step(latest), failure, "is published but older ones could not be deleted")
        return failure
