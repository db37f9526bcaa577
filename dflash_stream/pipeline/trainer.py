"""The trainer loop and `dflash-stream train`: consume READY segments, train the DFlash drafter, release what
was trained, checkpoint.

When a trained segment use leaves the store is train.release: on_use (the default), right after the step that
trained its last samples, journaled first, so that a crash has the uses released since the latest checkpoint
extracted again (`rollback.py`), and checkpoints come every train.checkpoint_every steps or
train.checkpoint_every_s seconds; after_checkpoint, only once a durable checkpoint records it, so a full buffer
forces checkpoints (the deadlock rule in `run`). Either way every sample is trained once per epoch in the final
weights (the store's exactly-once invariant).

Every trainer rank claims its own segments (consumer id `trainer-<index>`), so ranks run out of data at
different times. To keep collectives in lockstep, every step all ranks all-reduce one small vector (flags and
loss statistics) and the flattened gradients; a rank without a batch contributes zeros, and training stops only
when every rank is at end of data. Gradients are summed as `sum(w * CE)` and divided by the global `sum(w)`, so
the update is the exact decay-weighted mean over all the tokens every rank trained in the step.

Each piece of state saves and loads itself (torchtitan's lesson): the drafter, optimizer and scheduler (torch),
the data position (`position.py`: which segment uses are held and what of them was trained) and the random
streams (`rng.py`). `checkpoint.py` writes them collectively; `signals.py` turns SIGTERM/SIGINT into a stop.
With train.async_checkpoint a checkpoint is a host-memory snapshot written by a background thread
(`checkpoint_writer.py`): training goes on, and the ranks learn from a later step's all-reduce that every part is
written; then rank 0 publishes and they release what it records.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from dflash_stream.config import HOLDING_SHARE, MAX_LENGTH_BUCKETS, READER_PREFETCH, Config, load_config
from dflash_stream.drafter.batches import Member, TokenBatcher, collate
from dflash_stream.drafter.shapes import CompileWatch, ShapePlan, fixed_shapes_on
from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger, progress
from dflash_stream.observe.metrics import MetricsWriter, TrainingTracker
from dflash_stream.pipeline import checkpoint as ckpt
from dflash_stream.pipeline.checkpoint_writer import CheckpointWriter, SharedState
from dflash_stream.pipeline.common import log_store_event
from dflash_stream.pipeline.cores import HostCores
from dflash_stream.pipeline.position import DataPosition
from dflash_stream.pipeline.rng import RngState
from dflash_stream.pipeline.roles import RoleInfo, leave_process_group
from dflash_stream.pipeline.rollback import ReleaseJournal
from dflash_stream.pipeline.schedule import WarmupCosine
from dflash_stream.pipeline.signals import StopRequest
from dflash_stream.pipeline.stats import StepStats
from dflash_stream.pipeline.waiting import DataWait, DataWaitTimeout
from dflash_stream.rundir import RunDir
from dflash_stream.units import fmt_bytes

if TYPE_CHECKING:
    from dflash_stream.store import Claim, Store

log = get_logger(__name__)

WAIT_POLL_SECONDS = 2.0
"""How long a starved rank blocks on the store before the ranks compare notes again."""


@dataclass
class _Pending:
    """A checkpoint being written in the background; the uses it records as finished wait for it to be durable."""

    step: int
    reason: str
    finished: list[Claim]
    stall: float
    """Seconds training stood still for it so far (the snapshot; then any wait for the write)."""


class Trainer:
    """Trains the drafter on the store's segments; `run()` may be called repeatedly (single-process mode)."""

    def __init__(self, cfg: Config, role: RoleInfo, store: Store, metrics: MetricsWriter, device: torch.device) -> None:
        from dflash_stream.drafter import DrafterSpec, Objective, build_drafter, build_spec, load_target_head
        from dflash_stream.drafter.export import SPEC, load_init_weights
        from dflash_stream.store import SegmentReader
        from dflash_stream.target_model import resolve_layer_ids, target_shape

        self.cfg, self.store, self.metrics, self.device = cfg, store, metrics, device
        self.run_dir = RunDir(cfg.output_dir)
        self.index = role.index
        self.group = role.trainer_group
        self.trainers = role.count if self.group is not None else 1
        tc = cfg.train
        resume = self.run_dir.latest_checkpoint()

        # The model and what trains it
        init_from = cfg.drafter.init_from
        if resume is not None:
            self.spec = DrafterSpec(**json.loads((resume / SPEC).read_text()))
            if init_from:  # exactly-once resume wins: the checkpoint holds the weights trained since
                log.info("drafter.init_from ignored: resuming from %s", resume)
        else:
            shape = target_shape(cfg.target, download=True, hints=False, count=False)
            self.spec = build_spec(cfg, shape, resolve_layer_ids(shape.num_layers, cfg.target))
        self.drafter = build_drafter(self.spec, attention=cfg.drafter.attention).to(device)
        if resume is None and init_from:
            load_init_weights(self.drafter, init_from)
            log.info("drafter weights from %s (drafter.init_from)", init_from)
        self.bf16 = cfg.train.bf16_autocast(device.type)
        self.objective = Objective.from_config(tc)
        self.head = load_target_head(cfg.target, device, torch.bfloat16 if self.bf16 else torch.float32,
                                     verifier=self.objective.uses_verifier)
        decay = [p for p in self.drafter.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.drafter.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=tc.lr,
        )
        # Without train.total_steps the length is estimated once data exist (see `_revise_schedule`).
        self.schedule = WarmupCosine(tc.total_steps or 1, tc.warmup_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self.rng = RngState(tc.seed * 1_000_003 + self.index, device)

        # The data: this rank's segment uses, their samples queued in batches, the reader decoding ahead
        plan = ShapePlan.from_config(cfg)
        self.batcher = TokenBatcher(plan)
        self.position = DataPosition(store, f"trainer-{self.index}", self.batcher,
                                     ReleaseJournal(self.run_dir.root, self.index))
        self.release_on_use = tc.release == "on_use"
        # Fixed shapes where attention is compiled: one graph per length bucket instead of one per batch.
        self.fixed_shapes = fixed_shapes_on(cfg, self.drafter.uses_flex(device))
        self.compile_watch = CompileWatch(len(plan) if self.fixed_shapes else MAX_LENGTH_BUCKETS)
        log.info("attention shapes: %s", plan.describe() if self.fixed_shapes
                 else "per batch (train.fixed_shapes is off or attention is not compiled here)")

        # Progress
        self.steps = 0
        self.samples_trained = 0
        self.tokens_trained = 0
        self._all_samples_trained = 0  # over all trainer ranks, for the schedule estimate
        self.final_loss: float | None = None
        self.train_seconds = 0.0
        self.latest_checkpoint: Path | None = None
        # What checkpoints cost this launch: release after_checkpoint makes them frequent under a small budget.
        self.checkpoints = 0
        self.released_uses = 0  # segment uses released this launch
        self._last_checkpoint_time = time.monotonic()  # train.checkpoint_every_s counts from here
        self.checkpoint_stall_seconds = 0.0  # training stood still: the write, the barriers, the release
        self.checkpoint_write_seconds = 0.0  # this rank's writing and syncing (in the background: not a stall)
        self.async_checkpoint = tc.async_checkpoint
        self.writer = CheckpointWriter(self.run_dir.root, self.index, self.spec, barrier=self._barrier,
                                       agree=self._gather, keep=tc.keep_checkpoints)
        self._pending: _Pending | None = None
        self.data_wait_seconds = 0.0
        self._last_checkpoint_step = 0
        self._finished = False
        self.data_wait = DataWait(store, WAIT_POLL_SECONDS)  # its timeout is `train --wait-timeout`
        # A CPU run's trainers take the extractors' cores once all the data is extracted, and while every extractor
        # waits for room with nothing else to do.
        self.cores = HostCores(device, peers=self.trainers)
        self._extraction_over = False
        self.stats = StepStats(self.spec.block_size)
        self.stop = StopRequest()

        self._resume(resume)
        self.consumer = self.position.consumer
        self.reader = SegmentReader(self.consumer, prefetch=READER_PREFETCH)
        self.bar = progress(total=self.schedule.total_steps, initial=self.steps, desc="train", unit="step")

    # ---------------------------------------------------------------- checkpoint state

    def _resume(self, path: Path | None) -> None:
        """Load every component's state from checkpoint `path` (None: a fresh start) and drop the ledger
        files of a checkpoint that never completed."""
        from dflash_stream.drafter.export import WEIGHTS

        step = ckpt.checkpoint_step(path)
        dropped = ckpt.drop_ledger_after(self.run_dir.root, self.index, step)
        if dropped:
            log.info("dropped %d ledger file(s) of an unfinished checkpoint after step %d", len(dropped), step)
        if path is None:
            self.position.load_state_dict(DataPosition.EMPTY, step)
            return
        shared, part = ckpt.load(path, self.index, self.trainers)
        # safetensors takes `cpu`, not the `cpu:0` a multi-process CPU launch gives each rank.
        self.drafter.load_state_dict(load_file(path / WEIGHTS, device=str(self.device) if self.device.type != "cpu"
                                               else "cpu"))
        self.optimizer.load_state_dict(shared["optimizer"])
        self.scheduler.load_state_dict(shared["scheduler"])
        self.steps = self._last_checkpoint_step = shared["step"]
        self.tokens_trained, self._all_samples_trained = shared["tokens"], shared["samples"]
        self.rng.load_state_dict(part)
        self.samples_trained = part["samples_trained"]
        self.position.load_state_dict(part, step)
        self.latest_checkpoint = path
        log.info("resumed from %s: step %d, %d half-trained segment(s) re-claimed", path, self.steps,
                 len(part["partial"]))

    def _rank_state(self) -> dict[str, Any]:
        """trainer-<rank>.pt: this rank's data position, random streams and sample count."""
        return {**self.position.state_dict(), **self.rng.state_dict(), "samples_trained": self.samples_trained}

    def _shared_state(self) -> SharedState | None:
        """What rank 0 writes for all (the drafter and the shared trainer state), as live tensors; None on the
        other ranks. The background writer copies it to host memory before training changes it."""
        if self.index != 0:
            return None
        from dflash_stream.drafter.export import drafter_state

        return {"weights": drafter_state(self.drafter), "trainer_state": {
            "optimizer": ckpt.optimizer_state(self.optimizer, self.cfg.train.optimizer_state_dtype),
            "scheduler": self.scheduler.state_dict(),
            "step": self.steps, "tokens": self.tokens_trained, "samples": self._all_samples_trained,
        }}

    def _checkpoint(self, reason: str, wait: bool = False) -> None:
        """Checkpoint step-N (collective over the trainers); the segment uses it records as finished are released
        once it is durable. Synchronous: training stands still until then. Asynchronous (train.async_checkpoint):
        any earlier background write is completed first (one at a time), then the state is snapshot and written
        in the background, and a later step completes it. `wait`: return only once every checkpoint is durable
        and released (training stops, or a starved rank needs the release). Nothing new is written when nothing
        was trained since the last one."""
        if self.steps != self._last_checkpoint_step:
            if self.async_checkpoint:
                self._drain()
                self._start_background(reason)
            else:
                self._write_now(reason)
        if wait:
            self._drain()
            self.writer.settle()

    def _write_now(self, reason: str) -> None:
        """The synchronous checkpoint: write, publish, release, with training standing still throughout."""
        started = time.perf_counter()
        saved = self.writer.save(self.steps, rank_state=self._rank_state(), ledger=self.position.ledger_entries(),
                                 shared=self._shared_state if self.index == 0 else None)
        # Durable now: what it records as finished may leave the store.
        released = self.position.release_finished()
        self._last_checkpoint_step = self.steps
        self._last_checkpoint_time = time.monotonic()
        self._checkpoint_done(self.steps, reason, saved, released, time.perf_counter() - started, background=False)

    def _start_background(self, reason: str) -> None:
        """The asynchronous checkpoint's first half: snapshot and start the write; training stands still only
        for the copy to host memory."""
        started = time.perf_counter()
        rank_state, ledger = self._rank_state(), self.position.ledger_entries()
        finished = self.position.checkpoint_taken()
        self.writer.start(self.steps, rank_state=rank_state, ledger=ledger,
                          shared=self._shared_state if self.index == 0 else None)
        self._last_checkpoint_step = self.steps
        self._last_checkpoint_time = time.monotonic()
        self._pending = _Pending(self.steps, reason, finished, time.perf_counter() - started)

    def _drain(self) -> None:
        """Wait until the background checkpoint (if any) is written on every rank, then complete it; the wait is
        training standing still (collective)."""
        if self._pending is not None:
            self._complete()

    def _complete(self) -> None:
        """Publish the background checkpoint and release what it records as finished (collective; every rank at
        the same step). A write that failed on any rank stops every rank with CheckpointFailed instead."""
        pending, self._pending = self._pending, None
        assert pending is not None
        started = time.perf_counter()
        saved = self.writer.complete()
        released = self.position.release(pending.finished)
        stall = pending.stall + time.perf_counter() - started
        self._checkpoint_done(pending.step, pending.reason, saved, released, stall, background=True)

    def _checkpoint_done(self, step: int, reason: str, saved: ckpt.Saved, released: int, stall: float,
                         background: bool) -> None:
        """Count, log and report a checkpoint that became durable."""
        self.checkpoints += 1
        self.checkpoint_stall_seconds += stall
        self.checkpoint_write_seconds += saved.write_seconds
        self.latest_checkpoint = saved.path
        self.position.journal.forget_upto(step)  # the checkpoint holds every use released up to its step
        self._revise_schedule()
        how = "written in the background in" if background else "writing"
        log.info("checkpoint step-%d (%s); released %d segment use(s); training stood still %.2f s (%.2f s %s %s)",
                 step, reason, released, stall, saved.write_seconds, how, fmt_bytes(saved.bytes))
        self.metrics.log("checkpoint", step=step, path=str(saved.path), released=released, reason=reason,
                         stall_s=round(stall, 4), write_s=round(saved.write_seconds, 4), bytes=saved.bytes,
                         background=background)
        if self.index == 0:
            log_store_event(self.metrics, self.store)

    # ---------------------------------------------------------------- the loop

    def run(self, until_idle: bool = False) -> bool:
        """Train until end of data (True: everything consumed, final checkpoint durable, all released) or
        train.max_steps (True as well: training is over). False after a stop signal (checkpointed), or with
        `until_idle` once no decoded or READY segment is left (checkpointed and released, never blocking).
        Whatever it returns, no checkpoint is left being written in the background."""
        every = self.cfg.train.checkpoint_every
        every_s = self.cfg.train.checkpoint_every_s
        self._revise_schedule()
        with self.stop:
            while True:
                if self._max_steps_reached():
                    self._checkpoint("train.max_steps reached", wait=True)
                    self._finish_report()
                    return True

                # One step: forward/backward this rank's micro-batches, agree with the other ranks, update.
                if self.cores.enabled and not self._extraction_over:
                    self._extraction_over = self.store.end_of_data
                    self.cores.use(self._extraction_over or self.store.writers_idle())
                started = time.perf_counter()
                flags = self._sync(*self._accumulate())
                if flags["trained"]:
                    self._optimizer_step()
                    self.tokens_trained += flags["tokens"]
                    self._all_samples_trained += flags["samples"]
                    self.train_seconds += time.perf_counter() - started
                    self.stats.step_done(flags["tokens"])
                    self._report()
                durable = self.checkpoints
                # A background checkpoint every rank has written becomes durable here, at the same step everywhere.
                completed = self._pending is not None and flags["written"]
                if completed:
                    self._complete()
                # Release on use: the uses this step finished leave the store now, their last samples in the update.
                released = self.position.release_used(self.steps) if self.release_on_use else 0
                self.released_uses += released

                # Stop, at the end of the data or on a signal.
                if flags["all_exhausted"]:
                    if self.steps == 0:
                        raise DFlashError(self._nothing_to_train())
                    self._checkpoint("end of data", wait=True)
                    self._finish_report()
                    return True
                if flags["stop"]:
                    self._checkpoint(f"stop requested by {self.stopped_by or 'another trainer'}", wait=True)
                    return False

                # Checkpoint (and, after_checkpoint, release). Its deadlock rule: finished segments a checkpoint
                # would free must not sit unreleased while extractors wait for space, or while a trainer waits for
                # data (their next use may be it). The holding flags were counted before a release just now: look
                # again at the next step. A background write in flight frees space once durable: extractors wait
                # for it while training goes on; a starved rank has nothing to train, so it waits for the release.
                # Released on use, nothing waits for a checkpoint: they follow the user's clock alone.
                blocked = flags["holding_much"] and flags["writers_waiting"] and not completed
                starved = flags["holding"] and flags["starved"] and not completed
                if not self.release_on_use and blocked and self._pending is None:
                    self._checkpoint("extractors are blocked on the full buffer")
                elif not self.release_on_use and starved:
                    self._checkpoint("a trainer ran out of ready data", wait=True)
                elif flags["trained"] and self.steps % every == 0:
                    self._checkpoint(f"every {every} steps")
                elif flags["trained"] and flags["clock"]:
                    self._checkpoint(f"every {every_s:g} s")

                # No batch anywhere this step: wait for data (or return, in single-process mode); unless a release
                # just now lets a part-filled batch through or brings the next use: then look again at once.
                if not flags["trained"] and self.checkpoints == durable and not released:
                    if until_idle and self._store_idle():
                        if self.release_on_use:  # released already: only a background write to see through
                            self._drain()
                            self.writer.settle()
                        else:
                            self._checkpoint("no ready segment left", wait=True)
                        return False
                    self._wait_for_data()
                else:
                    self.data_wait.reset()

    @property
    def stopped_by(self) -> str | None:
        return self.stop.name

    def _max_steps_reached(self) -> bool:
        return self.cfg.train.max_steps is not None and self.steps >= self.cfg.train.max_steps

    # ---------------------------------------------------------------- one step

    def _accumulate(self) -> tuple[int, int, int]:
        """Forward/backward up to grad_accum micro-batches; (micro-batches, tokens, samples) this rank trained."""
        from dflash_stream.drafter import dflash_loss

        micro, tokens, samples = 0, 0, 0
        for _ in range(self.cfg.train.grad_accum):
            members = self._next_members()
            if not members:
                break
            shape = self.batcher.shape(members) if self.fixed_shapes else None
            batch = collate(members, self.device, shape)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                out = dflash_loss(
                    self.drafter, self.head, batch,
                    num_anchors=self.cfg.train.num_anchors, gamma=self.cfg.train.gamma,
                    generator=self.rng.generator, num_blocks=shape.blocks if shape else None,
                    chunk_rows=self.cfg.train.loss_chunk_rows, objective=self.objective,
                )
            self.compile_watch.observe(tuple(batch["input_ids"].shape))
            # Backpropagate the weighted sum; the step divides by the global weight (see module docstring).
            (out.loss * out.weight).backward()
            self.stats.add(out)
            self.stats.epoch = max(self.stats.epoch, self.position.mark_trained(members))
            micro += 1
            tokens += int(batch["lengths"].sum())
            samples += len(members)
        self.samples_trained += samples
        return micro, tokens, samples

    def _sync(self, micro: int, tokens: int, samples: int) -> dict[str, Any]:
        """One all-reduce of flags and statistics; every rank takes the same decisions from its result."""
        exhausted, holding = self._exhausted(), self.position.finished_bytes()
        flags = [
            micro > 0,
            self.stop.requested,
            self.consumer.writers_waiting(),
            exhausted,
            holding,
            micro == 0 and not exhausted,
            tokens,
            samples,
            self.writer.written,  # ended, well or not: `complete` learns which on every rank
            self._checkpoint_due(),
        ]
        vec = torch.tensor(flags + self.stats.pending(), dtype=torch.float64, device=self.device)
        vec = self._all_reduce(vec).tolist()
        self.stats.absorb(vec[len(flags):])
        trained, stop, waiting, exhausted_ranks, holding, starved, tokens, samples, written, clock = vec[: len(flags)]
        return {
            "trained": trained > 0, "stop": stop > 0, "writers_waiting": waiting > 0,
            "all_exhausted": exhausted_ranks == self.trainers, "holding": holding > 0,
            # Checkpointing for blocked extractors pays only once it frees a real share of the buffer.
            "holding_much": holding >= int(self.cfg.store.budget) * HOLDING_SHARE, "starved": starved > 0,
            "tokens": int(tokens), "samples": int(samples),
            "written": written == self.trainers,  # every rank's write of the background checkpoint ended
            "clock": clock > 0,  # train.checkpoint_every_s has passed on some rank's clock
        }

    def _checkpoint_due(self) -> bool:
        """train.checkpoint_every_s has passed since this launch's start or its latest checkpoint."""
        every_s = self.cfg.train.checkpoint_every_s
        return every_s is not None and time.monotonic() - self._last_checkpoint_time >= every_s

    def _optimizer_step(self) -> None:
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self._all_reduce(torch.cat([g.reshape(-1).float() for g in grads]))
        weight = max(self.stats.step_weight, 1e-12)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype) / weight
            offset += n
        torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _gather(self, item: Any) -> list[Any]:
        """Every trainer rank's `item`, in rank order (collective)."""
        if self.group is None:
            return [item]
        items: list[Any] = [None] * self.trainers
        dist.all_gather_object(items, item, group=self.group)
        return items

    # ---------------------------------------------------------------- data

    def _next_members(self) -> list[Member]:
        """A batch from what is queued or decoded. While a segment is on its way (being decoded, or READY),
        wait for it rather than cut a part-filled batch: with segments smaller than a batch, not waiting made
        most batches part-filled. Never waits when nothing is coming."""
        while not self.batcher.full_batch_ready():
            if self._take_segment(timeout=0):
                continue
            if not self.reader.data_coming():
                break
            started = time.perf_counter()
            taken = self._take_segment(timeout=WAIT_POLL_SECONDS)
            self.data_wait_seconds += time.perf_counter() - started
            if not taken:
                break
        if not self.batcher.full_batch_ready() and self.position.finished_bytes():
            # Rather than cut a part-filled batch, let the checkpoint that the loop makes for a starved rank
            # release the finished uses held here: their next use, or the room they free for the extractors,
            # brings the samples that fill it. With a small buffer every use round ended in part-filled batches.
            return []
        return self.batcher.next_batch()

    def _take_segment(self, timeout: float | None) -> bool:
        """Queue the next decoded segment; False when none came within `timeout` (or at end of data)."""
        item = self.reader.next(timeout)
        if item is None:
            return False
        self.position.add(*item)
        return True

    def _exhausted(self) -> bool:
        return len(self.batcher) == 0 and self.reader.exhausted

    def _store_idle(self) -> bool:
        """Nothing READY in the store, and no claim on its way to us through the reader (single process:
        every claim in the store is ours)."""
        segments = self.store.status()["segments"]
        return segments["ready"] == 0 and segments["claimed"] <= len(self.position)

    def _wait_for_data(self) -> None:
        """Block a little for the next segment (the ranks then compare notes again); say so, with reminders."""
        if self._exhausted():
            time.sleep(0.05)  # only the other ranks are still training; wait for their next step
            return
        # A segment READY in the store, or claimed and being decoded, is data on its way: no wait to report.
        try:
            self.data_wait.tick(data_on_its_way=not self._store_idle())
        except DataWaitTimeout:
            # A stop, not a crash: keep what was trained (with release on_use, the uses released since the last
            # checkpoint would otherwise wait for re-extraction). Every rank gives up at the same poll.
            self._checkpoint("no data within --wait-timeout", wait=True)
            raise
        started = time.perf_counter()
        self._take_segment(timeout=WAIT_POLL_SECONDS)
        self.data_wait_seconds += time.perf_counter() - started

    def _nothing_to_train(self) -> str:
        """The line a run whose data ended before its first step stops with (no untrained drafter exported)."""
        skipped: dict[str, int] = {}
        for path in self.run_dir.data_reports():
            for reason, n in json.loads(path.read_text()).get("skipped", {}).items():
                skipped[reason] = skipped.get(reason, 0) + n
        why = ", ".join(f"{reason} {n:,}" for reason, n in sorted(skipped.items(), key=lambda r: -r[1]))
        return ("nothing to train: the extractors stored no sample" + (f" (skipped: {why})" if why else "")
                + f"; no drafter is exported. See {self.run_dir.data}/report-*.json"
                + (" and the extractors' regeneration lines (no_answer: the servers gave none)"
                   if "no_answer" in skipped else ""))

    def _estimate_total_steps(self) -> tuple[int, bool]:
        """(schedule length, whether the data's size is known). Length: the tokens of all epochs over the
        tokens of one step (measured once steps were taken, else the full token budget of a step). The data's
        size comes from the extractors' data reports (samples kept) at the mean sample length seen so far;
        without them only the store's current content is known, a mere window of the data."""
        status = self.store.status()
        uses = self.cfg.store.reuse * self.cfg.extraction_passes
        expected = sum(json.loads(r.read_text())["kept"] for r in self.run_dir.data_reports())
        if self._all_samples_trained:
            per_sample = self.tokens_trained / self._all_samples_trained
        else:
            per_sample = status["tokens"] / status["samples"] if status["samples"] else 0.0
        total_tokens = (expected * per_sample if expected else status["tokens"]) * uses
        per_step = (self.tokens_trained / self.steps if self.steps
                    else self.cfg.train.batch_tokens * self.cfg.train.grad_accum * self.trainers)
        return math.ceil(total_tokens / per_step), bool(expected)

    def _revise_schedule(self) -> None:
        """Re-estimate the schedule length as the data become known (never when train.total_steps is set).
        It only grows, so an emptied store cannot cut the learning rate short. Collective: the ranks take the
        largest estimate, so that they all step with the same learning rate."""
        if self.cfg.train.total_steps is not None:
            return
        estimate, known = self._estimate_total_steps()
        vote = torch.tensor([max(estimate, self.schedule.total_steps), not known], device=self.device,
                            dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group)
        self.schedule.total_steps, self.schedule.open_ended = int(vote[0]), bool(vote[1])
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * self.schedule(self.scheduler.last_epoch)
        self.bar.total = self.schedule.total_steps

    # ---------------------------------------------------------------- logging

    def _report(self) -> None:
        self.bar.update(1)
        if self.steps % self.cfg.train.log_every == 0:
            self._flush_report()

    def _finish_report(self) -> None:
        """Training is over: the last log line, and the bar and the total (`train_done`) end at the steps taken."""
        self._finished = True
        self.bar.total = self.steps
        self.bar.refresh()
        self._flush_report()
        self.metrics.log("train_done", step=self.steps, total_steps=self.steps)

    def _flush_report(self) -> None:
        stats = self.stats.flush()
        if stats is None:
            return
        from dflash_stream.drafter import expected_acceptance

        self.final_loss = stats["loss"]
        tau = expected_acceptance(stats["acc"])
        lr = self.scheduler.get_last_lr()[0]
        tok_s = stats["tokens"] / max(stats["seconds"], 1e-9)
        self.bar.set_postfix(loss=f"{stats['loss']:.3f}", tau_est=f"{tau:.2f}", tok_s=f"{tok_s:.0f}",
                             wait=f"{self.data_wait_seconds:.0f}s")
        self.metrics.log(
            "train", step=self.steps, total_steps=self._total_steps(), loss=stats["loss"], acc=stats["acc"], tau=tau,
            lr=lr,
            tokens=self.tokens_trained, tok_s=tok_s, data_wait_s=self.data_wait_seconds, epoch=stats["epoch"],
            graphs_compiled=self.compile_watch.graphs_compiled, graphs_planned=self.compile_watch.bound,
        )

    def _total_steps(self) -> int:
        """The steps this training will take, as known now (the schedule's estimate, train.max_steps)."""
        if self._finished:
            return self.steps
        total = self.schedule.total_steps
        return min(total, self.cfg.train.max_steps) if self.cfg.train.max_steps else total

    # ---------------------------------------------------------------- export

    def export(self, out_dir: str | Path) -> Path:
        """The drafter as it is now, in z-lab format (config.json + model.safetensors)."""
        from dflash_stream.drafter import export_drafter

        return export_drafter(self.drafter, self.spec, Path(out_dir))

    def close(self) -> None:
        self.bar.close()
        self.reader.close()


# -------------------------------------------------------------------- command


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="train the drafter from an existing store (waits for segments)")
    parser.add_argument("--config", required=True, help="run config (YAML)")
    parser.add_argument("--wait-timeout", type=float, default=None, metavar="SECONDS",
                        help="give up after waiting this long for data (default: wait as long as it takes)")
    parser.set_defaults(func=train_command, overrides=[])


def train_command(args: argparse.Namespace) -> int:
    from dflash_stream.log import setup_logging
    from dflash_stream.pipeline.common import (
        check_host_memory,
        open_store,
        save_resolved_config,
        store_layout,
    )
    from dflash_stream.pipeline.guard import hold_output, stop_with_launcher
    from dflash_stream.pipeline.roles import assign_uniform, init_distributed
    from dflash_stream.preflight import check_run_paths
    from dflash_stream.store import lease

    stop_with_launcher()
    cfg = load_config(args.config, args.overrides)
    check_run_paths(cfg, data=False)  # before anything is written; training reads no data files
    role = assign_uniform("trainer")
    setup_logging("trainer", role.index, show_bar=role.speaks_for_role)
    device = init_distributed() if cfg.target.device == "auto" else torch.device(cfg.target.device)
    check_host_memory(cfg, 0, role.world_size, role.global_rank)  # every process trains
    layer_ids, hidden_size = store_layout(cfg)
    if not (Path(cfg.store.path) / "store.json").is_file():
        raise DFlashError(f"no store at {cfg.store.path} yet: start `dflash-stream extract` with this config first "
                          "(it creates the store); `train` then waits for its segments")
    if role.index == 0:
        hold_output(cfg, ("train",))
    store = open_store(cfg, layer_ids, hidden_size, create=False)
    if role.index == 0:
        save_resolved_config(cfg)
    metrics = TrainingTracker(cfg.output_dir, "trainer", role.index, tensorboard=cfg.metrics.tensorboard)
    metrics.log("start", config=cfg.model_dump(mode="json"))
    trainer = Trainer(cfg, role, store, metrics, device)
    trainer.data_wait.timeout = args.wait_timeout
    trainer.data_wait.extract_command = f"dflash-stream extract --config {args.config}"
    finished = False
    try:
        finished = trainer.run()
        summary = {
            "steps": trainer.steps, "samples_trained": trainer.samples_trained, "final_loss": trainer.final_loss,
            "train_seconds": round(trainer.train_seconds, 2), "data_wait_seconds": round(trainer.data_wait_seconds, 2),
            "checkpoints": trainer.checkpoints, "checkpoint_stall_seconds": round(trainer.checkpoint_stall_seconds, 2),
            "checkpoint": str(trainer.latest_checkpoint) if trainer.latest_checkpoint else None,
        }
        if finished and role.index == 0:
            summary["export"] = str(trainer.export(RunDir(cfg.output_dir).drafter))
        metrics.log("end", summary=summary)
        log.info("training %s: %s", "finished" if finished else "stopped", json.dumps(summary))
    finally:
        trainer.close()
        metrics.close()
        lease.release_all()
        leave_process_group(trainer.group if finished else None)
    if finished:
        return 0
    # Stopped by a signal (here or on another trainer): exit the way a shell reports death by it.
    return 128 + int(signal.Signals[trainer.stopped_by or "SIGTERM"])
