"""How one trainer rank writes a checkpoint: synchronously, training standing still until it is durable, or in
the background (train.async_checkpoint), training going on while a thread writes a host-memory snapshot.

The exactly-once rule does not change: the segment uses a checkpoint records as finished are released only once
it is durable (COMPLETE written and fsynced). A background write only makes them wait longer on disk, and the
store's budget counts them until they are deleted, so extractors stay blocked meanwhile rather than overrun it.

The background protocol keeps every collective on the training thread:

1. `start` (every rank at the same step): rank 0 makes the staging folder, a barrier, then each rank copies its
   state to host memory and a thread writes its part (`checkpoint.write_part`, each file fsynced).
2. At later step boundaries the ranks learn from the step's all-reduce whether every part is written (`written`
   is this rank's vote). Then `complete(agreed=True)`: rank 0 publishes (rename, COMPLETE, fsync), a barrier,
   and the caller releases. `complete()` without agreement waits for this rank's part and barriers first: what
   the next checkpoint, and the end of training, do (at most one background write at a time).

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
from dflash_stream.drafter.export import save_checkpoint_weights
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
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> float:
        """Block until the part is written; its write seconds. Re-raises what the thread raised."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.seconds


class CheckpointWriter:
    """One rank's checkpoint writes, the old way (`save`) or the background way (`start` ... `complete`).
    `barrier` syncs the trainer ranks (a no-op for one trainer)."""

    def __init__(self, output_dir: str | Path, rank: int, spec: DrafterSpec, *, barrier: Callable[[], None],
                 keep: int = 2) -> None:
        self.run = RunDir(output_dir)
        self.rank, self.spec, self.barrier, self.keep = rank, spec, barrier, keep
        self.host = HostSnapshot()
        self.pending: BackgroundWrite | None = None
        self.pending_step: int | None = None
        self._pruning: threading.Thread | None = None

    def _write_shared(self, shared: SharedState) -> Callable[[Path], None]:
        def write(staging: Path) -> None:
            retry_when_full(f"checkpoint model in {staging}", staging,
                            lambda: save_checkpoint_weights(shared["weights"], self.spec, staging))
            ckpt.save_torch(shared["trainer_state"], staging / ckpt.SHARED_STATE)
        return write

    def save(self, step: int, *, rank_state: dict[str, Any], ledger: list[dict[str, Any]],
             shared: Callable[[], SharedState] | None) -> ckpt.Saved:
        """Write checkpoint `step` and return once it is durable (collective). `shared`: rank 0's state."""
        return ckpt.save(self.run.root, step, self.rank, rank_state=rank_state, ledger=ledger,
                         write_shared=self._write_shared(shared()) if shared is not None else None,
                         barrier=self.barrier, keep=self.keep)

    def start(self, step: int, *, rank_state: dict[str, Any], ledger: list[dict[str, Any]],
              shared: Callable[[], SharedState] | None) -> None:
        """Snapshot this rank's state to host memory and start writing it in the background (collective).
        `rank_state` and `ledger` must be copies the caller no longer changes."""
        if self.pending is not None:
            raise RuntimeError(f"checkpoint step-{self.pending_step} is still being written; complete it first")
        self.settle()  # `begin` below must not race the deletion of older checkpoints
        if self.rank == 0:
            ckpt.begin(self.run.root, step)
        self.barrier()  # the staging folder exists before any rank writes into it
        write_shared = self._write_shared(self.host.copy(shared())) if shared is not None else None

        def write() -> float:
            return ckpt.write_part(self.run.root, step, self.rank, rank_state=rank_state, ledger=ledger,
                                   write_shared=write_shared)

        self.pending, self.pending_step = BackgroundWrite(self.run.staging(step), write), step

    @property
    def written(self) -> bool:
        """This rank's vote: its part of the pending checkpoint is written (or nothing is pending)."""
        return self.pending is None or self.pending.done

    def complete(self, agreed: bool = False) -> ckpt.Saved:
        """Make the pending checkpoint durable (collective; every rank calls it at the same step). `agreed`: the
        ranks already know every part is written; otherwise wait for this rank's part, then for the others."""
        if self.pending is None or self.pending_step is None:
            raise RuntimeError("no checkpoint is being written")
        pending, step = self.pending, self.pending_step
        seconds = pending.wait()
        if not agreed:
            self.barrier()
        self.pending = self.pending_step = None
        started = time.perf_counter()
        if self.rank == 0:
            ckpt.publish(self.run.root, step, self.keep, prune=False)
            # Older checkpoints are deleted off the training thread; the next `start` waits for it, so disk
            # holds at most keep complete checkpoints + the one being written, as with synchronous writes.
            self._pruning = threading.Thread(target=ckpt.prune, args=(self.run.root, self.keep),
                                             name="checkpoint-prune", daemon=True)
            self._pruning.start()
        seconds += time.perf_counter() - started
        self.barrier()  # COMPLETE is durable before any rank releases what the checkpoint records
        final = self.run.checkpoint(step)
        return ckpt.Saved(final, seconds, sum(f.stat().st_size for f in final.iterdir() if f.is_file()))

    def settle(self) -> None:
        """Wait for the deletion of older checkpoints (if any) to end: before the next checkpoint, and before
        training returns."""
        if self._pruning is not None:
            self._pruning.join()
            self._pruning = None
