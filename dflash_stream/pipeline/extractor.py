"""The extractor: prepared samples -> target forward with capture hooks -> segments in the store.

The forward loop runs in the calling thread. A sink thread takes each captured batch from a bounded queue,
finishes its device-to-host copy, checks it, packs samples into segments of ~store.segment_bytes and writes
them (the store encodes inside `write`), so the target waits only when that queue is full: the ring buffer is
full, or encoding falls behind. Batches are length-sorted within windows of a few segments' worth of samples,
which keeps padding low while every window still covers the whole range of lengths.

With in-process regeneration the states of a window's samples are recorded while the target decodes their
answers (`generate_with_states`), when a generation batch's states fit `extract.batch_tokens` (the most a capture
forward holds): those samples skip the capture forward, which would run prompt and answer through the target a
second time. Answers from the cache (a resumed run, a later pass, a redo) and larger batches take the forward.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash_stream.config import Config
from dflash_stream.data import PreparedSample, prepare_shard, take_batch
from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger, progress
from dflash_stream.observe.metrics import MetricsWriter
from dflash_stream.pipeline.common import log_store_event, pass_order, stay_for_redo
from dflash_stream.pipeline.cores import HostCores
from dflash_stream.pipeline.packing import SegmentPacker
from dflash_stream.pipeline.roles import RoleInfo
from dflash_stream.pipeline.state_health import StateHealth
from dflash_stream.regenerate.cache import ResponseCache, answers_key, describe_other_caches
from dflash_stream.regenerate.phase import ServerRegenerator, summary_lines
from dflash_stream.sizing.memory import records_while_generating
from dflash_stream.store import Sample, Store, StoreFull, WriterStopped, sizes
from dflash_stream.target_model import (
    TargetShape,
    load_target,
    model_shape,
    stop_token_ids,
    stored_layer_ids,
)
from dflash_stream.target_model.capture import LayerCapture
from dflash_stream.target_model.generate import generate_responses, generate_with_states
from dflash_stream.target_model.host_copy import HostCopier

log = get_logger(__name__)

WINDOW_SEGMENTS = 4
"""Segments' worth of samples sorted by length together."""


@dataclass
class _Captured:
    pass_index: int
    samples: list[PreparedSample]
    states: torch.Tensor
    """bf16 [B, T, K*D] on the host (or being copied there until `ready` fires)."""
    ready: torch.cuda.Event | None
    done: Callable[[], None] | None = None
    """Called once the samples are in the packer (a served extractor deletes their spool files)."""


@dataclass
class _EndOfPass:
    pass_index: int


_STOP = object()


class _SegmentSink:
    """The background side: host copies, checks, and the packer's segment writes."""

    def __init__(self, packer: SegmentPacker, queue_size: int, health: StateHealth) -> None:
        self.packer, self.health = packer, health
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, non_blocking: bool) -> None:
        self.packer.non_blocking, self.error = non_blocking, None
        self._thread = threading.Thread(target=self._loop, name="extract-sink", daemon=True)
        self._thread.start()

    def put(self, item: Any, meanwhile: Callable[[], bool] | None = None) -> float:
        """Hand an item to the sink; returns the seconds spent waiting for room. While the queue stays full,
        `meanwhile()` is called between looks: it does a piece of other work (True; its seconds are not counted as
        waiting) or has none left (False: it is not called again during this put)."""
        started = time.perf_counter()
        worked = 0.0
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.queue.put(item, timeout=0.1)
                return time.perf_counter() - started - worked
            except queue.Full:
                if meanwhile is None:
                    continue
                began = time.perf_counter()
                if not meanwhile():
                    meanwhile = None
                worked += time.perf_counter() - began

    def stop(self) -> None:
        """Let the sink finish what is queued and end; what it could not write stays with the packer."""
        if self._thread is None:
            return
        if self.error is None:
            self.queue.put(_STOP)
        self._thread.join()
        self._thread = None
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        try:
            while (item := self.queue.get()) is not _STOP:
                if isinstance(item, _EndOfPass):
                    self.packer.flush()
                else:
                    self._take(item)
        except BaseException as err:  # handed to the forward loop, which re-raises it
            self.error = err

    def _take(self, item: _Captured) -> None:
        if item.ready is not None:
            item.ready.synchronize()
        for row, sample in enumerate(item.samples):
            # A copy, so the batch tensor is freed once its samples are packed.
            states = item.states[row, : sample.num_tokens].clone()
            self.health.check(sample, states)
            self.packer.add(item.pass_index, Sample(sample.sample_id, sample.input_ids, sample.loss_mask, states))
        if item.done is not None:
            item.done()


class Extractor:
    """Extracts this rank's share of the data, every pass, into the store; resumable after a crash."""

    def __init__(self, cfg: Config, role: RoleInfo, store: Store, metrics: MetricsWriter, device: torch.device,
                 target: tuple[Any, Any] | None = None) -> None:
        self.cfg, self.role, self.store, self.metrics, self.device = cfg, role, store, metrics, device
        self.tokenizer, shape, stop_ids = self._open_target(target)
        # The drafter's layers, and the verifier's last layer when the run stores it.
        self.layer_ids = stored_layer_ids(shape.num_layers, cfg.target, cfg.verifier_states)
        self.health = StateHealth(self.layer_ids, shape.hidden_size, cfg.extract.engine)
        # A CPU run's extractors take the trainers' cores while the store holds nothing for them to train.
        self._cores = HostCores(device, peers=role.count)
        self.samples, self.report = prepare_shard(cfg, self.tokenizer, role.index, role.count)
        self.cache: ResponseCache | None = None
        self._server: ServerRegenerator | None = None
        if cfg.data.regenerate:
            key = answers_key(cfg, self.tokenizer, stop_ids)
            self.cache = ResponseCache(cfg.output_dir, key, role.index)
            other = describe_other_caches(cfg.output_dir, key) if role.index == 0 else None
            if other:
                log.warning("%s", other)
            if cfg.data.generation.engine == "openai":
                # The extractors share data.generation.concurrency: each keeps its part of it in flight.
                self._server = ServerRegenerator(cfg, self.tokenizer, self.cache, stop_ids,
                                                 concurrency=math.ceil(cfg.data.generation.concurrency / role.count),
                                                 on_progress=lambda figures: metrics.log("regenerate", **figures))
        self._dropped: dict[int, tuple[str, str]] = {}
        width = len(self.layer_ids) * shape.hidden_size
        self.bytes_per_token = sizes.raw_bytes_per_token(width)
        self.batch_tokens = cfg.extract.batch_tokens
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.samples_total = len(self.samples) * cfg.extraction_passes
        self.samples_written = self.tokens_written = 0
        self._samples_held = 0  # already in the store when this process started (a resumed run)
        self._dropped_uses = 0  # samples whose regenerated response was too short, per pass: not to extract
        self._regen_bar = None
        self._generated_tokens, self._generate_seconds = 0, 0.0
        self._recorded: dict[int, torch.Tensor] = {}
        """States recorded while generating, by sample id (prompt + response), until the sample is extracted."""
        self.samples_recorded = 0
        # This pass's samples in extraction order, and how far generating their answers ahead went (`_meanwhile`).
        self._ahead: list[PreparedSample] = []
        self._ahead_at = 0
        self.ahead_seconds = 0.0
        """Seconds spent generating answers ahead while the forward loop waited for the full buffer."""
        self.backpressure_seconds = self.extract_seconds = 0.0
        self.writer = store.writer(f"extractor-{role.index}")
        self._packer = SegmentPacker(self.writer, int(cfg.store.segment_bytes), width, self._on_segment)
        self._sink = _SegmentSink(self._packer, cfg.extract.queue_size, self.health)
        self._work = self._plan()
        self._bar = None
        self._run_started = 0.0
        self._forwarded_tokens = 0
        self._done = False
        self._segments_written = 0

    def _open_target(self, target: tuple[Any, Any] | None) -> tuple[Any, TargetShape, set[int]]:
        """(tokenizer, shape, stop ids) of the target, here loaded to run in this process with capture hooks."""
        self.model, tokenizer = target if target is not None else load_target(self.cfg.target, self.device)
        shape = model_shape(self.model)
        self.capture = LayerCapture(self.model, stored_layer_ids(shape.num_layers, self.cfg.target, self.cfg.verifier_states))
        self._host = HostCopier(self.device)
        return tokenizer, shape, stop_token_ids(self.model, tokenizer)

    # -- the public loop ------------------------------------------------------------------------------------

    def run(self, until_full: bool = False) -> bool:
        """Extract until this rank's share is in the store (True), or, with `until_full`, until the buffer is
        full (False; call again once the trainer has freed room). Samples of damaged segments that a trainer
        quarantined, or of uses a crash rolled back, are extracted again first."""
        self.redo_quarantined(block=not until_full)
        if self._done:
            return True
        if self._bar is None:
            if self._server is not None:  # the servers answer ahead while the windows are extracted
                self._server.start(self.samples)
            self._bar = progress(total=self.samples_total, unit="sample", desc="extract")
        self._run_started = time.perf_counter()
        try:
            finished = self._packer.retry_refused() and self._feed(until_full)
        except BaseException:
            self._bar.close()
            raise
        finally:
            self.extract_seconds += time.perf_counter() - self._run_started
        if not finished:
            return False
        self._finish_report()  # before the end of data: a trainer that finds nothing to train reads it
        self.writer.finish()
        self._log_progress(self.extract_seconds)  # the final count, also when the last samples dropped out
        self._bar.close()
        if self._regen_bar is not None:
            self._regen_bar.close()
        if self._server is not None:
            self._server.close()
            summary = self._server.summary()
            for line in summary_lines(summary) if summary["asked"] else ["every answer came from the cache"]:
                log.info(line)
        self._done = True
        return True

    def redo_quarantined(self, block: bool = True) -> int:
        """Extract again the samples of this writer's quarantined segments (see `SegmentConsumer.quarantine`) and
        of its segment uses a crash rolled back (`Store.request_redo`), one replacement segment per part; returns
        the number of parts written. `block` off: stop at the first part the full buffer has no room for."""
        requests = self.store.redo_requests(self.writer.id)
        by_id = {s.sample_id: s for s in self.samples}
        written = 0
        for tag, part in requests:
            missing = [i for i in part["sample_ids"] if i not in by_id]
            if missing:
                raise DFlashError(f"redo part {tag} holds samples {missing[:5]} that this extractor's shard does not "
                                  "have; rerun with the same data and number of extractors")
            todo = [by_id[i] for i in part["sample_ids"]]
            if self.cache is not None:
                todo = self._respond(todo, keep_states=False)  # the cached responses: the same samples as before
            todo.sort(key=lambda s: -s.num_tokens)
            lengths, start, stored = [s.num_tokens for s in todo], 0, []
            while start < len(todo):
                end = take_batch(lengths, start, self.batch_tokens)
                for batch, states, ready in self._forward(todo[start:end]):
                    if ready is not None:
                        ready.synchronize()
                    for row, p in enumerate(batch):
                        stored.append(Sample(p.sample_id, p.input_ids, p.loss_mask, states[row, : p.num_tokens].clone()))
                        self.health.check(p, stored[-1].hidden_states)
                start = end
            try:
                info = self.writer.write(stored, pass_index=part["pass_index"], block=block,
                                         first_use=part["first_use"], replaces=tag)
            except StoreFull:  # single-process mode: the trainer frees room, then the next round writes it
                return written
            written += 1
            self.health.segment([s.sample_id for s in stored])  # checked above; only new segments are logged
            log.info("extracted the %d sample(s) of %s part %s again: segment %s (from use %d)",
                     len(stored), part["why"], tag, info.segment_id, part["first_use"])
        return written

    def serve_redo(self, training_over) -> None:
        """After this rank's data: stay to extract again whatever a trainer quarantines or a crash rolls back, until
        the store is drained or `training_over()` (a trainer that stops at train.max_steps leaves segments
        unconsumed)."""
        stay_for_redo(self.store, self.redo_quarantined, training_over,
                      staying="all data extracted; staying to extract again any segment a trainer finds damaged or a "
                              "crash rolls back")

    def summary(self) -> dict[str, Any]:
        return {
            "samples": self.samples_written, "tokens": self.tokens_written,
            "extract_seconds": round(self.extract_seconds, 2),
            "tok_s": round(self.tokens_written / max(self.extract_seconds, 1e-9), 1),
            "backpressure_seconds": round(self.backpressure_seconds, 2),
            # In-process regeneration: all of it, and the part done while the full buffer held the forward back.
            "generate_seconds": round(self._generate_seconds, 2),
            "generate_ahead_seconds": round(self.ahead_seconds, 2),
            # Samples whose states were recorded while their answers were generated (no capture forward).
            "recorded_while_generating": self.samples_recorded,
            "batch_tokens": self.batch_tokens,
            "data": {k: v for k, v in self.report.to_dict().items() if k != "sample_ids"},
            **({"regenerate": self._server.summary()} if self._server is not None else {}),
        }

    # -- forward loop ---------------------------------------------------------------------------------------

    def _feed(self, until_full: bool) -> bool:
        """Extract the work plan's batches until the work is done (True) or the buffer refused a segment."""
        self._sink.start(non_blocking=until_full)
        exhausted = False
        try:
            while not self._packer.full:
                item = next(self._work, None)
                if item is None:
                    exhausted = True
                    break
                pass_index, batch = item
                if batch is None:  # every state of the pass goes to the packer before it closes the pass
                    self._flush()
                    self._to_sink(_EndOfPass(pass_index))
                    continue
                self._extract_batch(pass_index, batch)
            self._flush()
        finally:
            # The forward loop is done: while the sink writes the last batches into a full buffer (which takes as
            # long as the trainers need to free the room), this extractor has nothing else to do.
            self.writer.idle(True)
            try:
                self._sink.stop()
            finally:
                self.writer.idle(False)
        return exhausted and not self._packer.full

    def _extract_batch(self, pass_index: int, batch: list[PreparedSample]) -> None:
        """Run one batch through the target and hand its states to the sink (the states recorded while its
        answers were generated go without a forward)."""
        recorded = [s for s in batch if s.sample_id in self._recorded]
        batch = [s for s in batch if s.sample_id not in self._recorded]
        if recorded:
            rows = [self._recorded.pop(s.sample_id)[: s.num_tokens] for s in recorded]
            states = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
            self._to_sink(_Captured(pass_index, recorded, states, None))
            self._forwarded_tokens += sum(s.num_tokens for s in recorded)
            self.samples_recorded += len(recorded)
            self._advance(len(recorded))
        if not batch:
            return
        for part, states, ready in self._forward(batch):
            self._to_sink(_Captured(pass_index, part, states, ready))
            self._forwarded_tokens += sum(s.num_tokens for s in part)
            self._advance(len(part))

    def _flush(self) -> None:
        """Hand the sink whatever is still on its way (here: nothing; the forward hands over as it goes)."""

    def _to_sink(self, item: _Captured | _EndOfPass) -> None:
        """Give the sink an item; while it has no room (the buffer is full), generate the coming answers."""
        try:
            self.backpressure_seconds += self._sink.put(item, self._meanwhile)
        finally:
            self.writer.idle(False)

    def _meanwhile(self) -> bool:
        """While the forward loop waits for the sink: generate the answers of the next data.generation.batch_size
        samples of this pass that lack one (True). Regeneration would otherwise stop whenever the buffer is full,
        and follow training instead of running beside it. With nothing to generate (False), say that this writer
        is idle: a CPU run's trainers take its cores until it has work again."""
        if self.cache is not None and self._server is None:
            chunk = []
            while self._ahead_at < len(self._ahead) and len(chunk) < self.cfg.data.generation.batch_size:
                sample = self._ahead[self._ahead_at]
                self._ahead_at += 1
                if sample.sample_id not in self.cache:
                    chunk.append(sample)
            if chunk:
                started = time.perf_counter()
                self._generate(chunk)
                self.ahead_seconds += time.perf_counter() - started
                return True
        self.writer.idle(True)
        return False

    def _forward(self, batch: list[PreparedSample]) -> Iterator[tuple[list[PreparedSample], torch.Tensor, Any]]:
        """Capture a longest-first batch; on out-of-memory halve extract.batch_tokens and retry it in parts."""
        todo = [batch]
        while todo:
            part = todo.pop(0)
            self._weigh_cores()
            try:
                states, ready = self._capture(part)
            except torch.OutOfMemoryError:
                longest = part[0].num_tokens
                if len(part) == 1:
                    raise DFlashError(f"sample {part[0].sample_id} ({part[0].origin}, {longest} tokens) does not fit "
                                      f"on {self.device} even alone; lower data.max_length") from None
                self.batch_tokens = max(longest, min(self.batch_tokens, len(part) * longest) // 2)
                log.warning("out of memory on %d samples x %d tokens: extract.batch_tokens now %d, retrying",
                            len(part), longest, self.batch_tokens)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                lengths = [s.num_tokens for s in part]
                splits, start = [], 0
                while start < len(part):
                    end = take_batch(lengths, start, self.batch_tokens)
                    splits.append(part[start:end])
                    start = end
                todo = splits + todo
                continue
            yield part, states, ready

    def _weigh_cores(self) -> None:
        """A CPU run: every core while the store holds nothing to train, this process's share otherwise."""
        if self._cores.enabled:  # elsewhere not even a look at the store (called at every decoding step)
            self._cores.use(not self.store.work_for_consumers())

    def _capture(self, part: list[PreparedSample]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        # Right padding: causal attention keeps every real token blind to the pads after it.
        width = part[0].num_tokens
        ids = torch.full((len(part), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for row, sample in enumerate(part):
            ids[row, : sample.num_tokens] = torch.from_numpy(sample.input_ids.astype(np.int64))
            mask[row, : sample.num_tokens] = 1
        states = self.capture(ids.to(self.device), mask.to(self.device))
        # On CUDA the copy runs on a side stream during the next forward; the sink waits on `ready`.
        return self._host.copy(states)

    # -- the work plan --------------------------------------------------------------------------------------

    def _plan(self) -> Iterator[tuple[int, list[PreparedSample] | None]]:
        """(pass, batch) for every sample the store lacks, then (pass, None) at the end of each pass.

        Batches are cut lazily, so a budget halved after an out-of-memory error applies to the rest.
        """
        for pass_index in range(self.cfg.extraction_passes):
            held = self.store.stored_sample_ids().get(pass_index, set())
            todo = [s for s in pass_order(self.samples, self.cfg.data.seed, pass_index) if s.sample_id not in held]
            self._ahead, self._ahead_at = todo, 0
            if len(todo) < len(self.samples):
                log.info("pass %d: %d samples already in the store, %d to extract",
                         pass_index, len(self.samples) - len(todo), len(todo))
                self._advance(len(self.samples) - len(todo))
                self._samples_held += len(self.samples) - len(todo)
            for window in self._windows(todo):
                if self.cache is not None:
                    window = self._respond(window)
                window.sort(key=lambda s: -s.num_tokens)
                lengths = [s.num_tokens for s in window]
                start = 0
                while start < len(window):
                    end = take_batch(lengths, start, self.batch_tokens)
                    yield pass_index, window[start:end]
                    start = end
            yield pass_index, None

    def _windows(self, samples: list[PreparedSample]) -> Iterator[list[PreparedSample]]:
        limit = WINDOW_SEGMENTS * int(self.cfg.store.segment_bytes)
        regenerating = self.cache is not None
        expected_response = self.cfg.data.generation.max_new_tokens if regenerating else 0
        # A window also holds at least one full generation batch, the first one included: a smaller batch takes
        # most of a full one's time (a decoding step reads every weight whatever the batch), and the trainers it
        # would start sooner drain it before the next, larger one is decoded.
        min_samples = self.cfg.data.generation.batch_size if regenerating and self._server is None else 1
        window, size = [], 0
        for sample in samples:
            window.append(sample)
            size += (sample.num_tokens + expected_response) * self.bytes_per_token
            if len(window) >= min_samples and size >= limit:
                yield window
                window, size = [], 0
        if window:
            yield window

    def _respond(self, prompts: list[PreparedSample], keep_states: bool = True) -> list[PreparedSample]:
        """Prompts completed with the target's own (cached or newly generated) responses; short ones dropped.
        `keep_states`: the states of the answers generated here are recorded for `_extract_batch`."""
        gen, max_length = self.cfg.data.generation, self.cfg.data.max_length
        self.cache.refresh()  # another writer's earlier answer to one of these is the one to take
        missing = sorted((s for s in prompts if s.sample_id not in self.cache), key=lambda s: s.num_tokens)
        if self._server is not None:
            if not self._server.wait([s.sample_id for s in missing], self.writer.stop_when):
                raise WriterStopped(f"writer {self.writer.id} stopped waiting for the servers' answers: it was told "
                                    "to stop")
            missing = []
        for first in range(0, len(missing), gen.batch_size):
            self._generate(missing[first : first + gen.batch_size], keep_states)
        complete = []
        for prompt in prompts:
            response = self.cache.get(prompt.sample_id)
            if response is None:  # the servers gave no answer (an error; a rerun asks again)
                self._dropped[prompt.sample_id] = ("no_answer", prompt.origin)
                self._dropped_uses += 1
                self._advance(1)
                continue
            sample = prompt.with_response(response, max_length)
            if int(sample.loss_mask.sum()) < self.cfg.min_supervised_tokens:
                self._recorded.pop(sample.sample_id, None)
                self._dropped[sample.sample_id] = ("short_response", sample.origin)
                self._dropped_uses += 1
                self._advance(1)
            else:
                complete.append(sample)
        return complete

    def _generate(self, prompts: list[PreparedSample], keep_states: bool = False) -> None:
        """The target's answers to `prompts` (one generation batch), into the cache; with `keep_states`, and when
        the batch's states fit extract.batch_tokens, their states into `_recorded` too."""
        gen = self.cfg.data.generation
        if self._regen_bar is None:
            # Its own bar: generating is usually slower than the forward pass that captures the states.
            todo = sum(1 for s in self.samples if s.sample_id not in self.cache)
            self._regen_bar = progress(total=todo, unit="sample", desc="regenerate")
        chunk = sorted(prompts, key=lambda s: s.num_tokens)
        budget = min(gen.max_new_tokens, self.cfg.data.max_length - chunk[0].num_tokens)
        started = time.perf_counter()
        # The trainers may run out of data in the middle of a batch (it decodes for a while, and they get nothing
        # new until its window is extracted): the cores are weighed again at every decoding step.
        prompts_ids = [s.input_ids for s in chunk]
        if keep_states and records_while_generating(len(chunk), chunk[-1].num_tokens, budget, self.batch_tokens):
            answered = generate_with_states(self.model, self.tokenizer, prompts_ids, gen, budget, self.capture,
                                            on_step=self._weigh_cores)
            responses = [response for response, _ in answered]
            self._recorded.update((s.sample_id, states) for s, (_, states) in zip(chunk, answered, strict=True))
        else:
            responses = generate_responses(self.model, self.tokenizer, prompts_ids, gen, budget,
                                           on_step=self._weigh_cores)
        self._generate_seconds += time.perf_counter() - started
        self._generated_tokens += sum(len(r) for r in responses)
        self.cache.add({s.sample_id: r for s, r in zip(chunk, responses, strict=True)})
        self._regen_bar.set_postfix_str(
            f"{self._generated_tokens / max(self._generate_seconds, 1e-9):,.0f} tok/s generated", refresh=False)
        self._regen_bar.update(len(chunk))

    # -- bookkeeping ----------------------------------------------------------------------------------------

    def _advance(self, samples: int) -> None:
        elapsed = self.extract_seconds + time.perf_counter() - self._run_started
        self._bar.update(samples)
        self._bar.set_postfix_str(f"{self._forwarded_tokens / max(elapsed, 1e-9):,.0f} tok/s", refresh=False)

    def _on_segment(self, samples: list[Sample]) -> None:
        """Called by the sink after each segment is published."""
        self.samples_written += len(samples)
        self.tokens_written += sum(len(s.input_ids) for s in samples)
        self._log_progress()
        self._segments_written += 1
        log_store_event(self.metrics, self.store, segments_written=self._segments_written)
        self.metrics.log("health", segment=self._segments_written, samples=len(samples),
                         **self.health.segment([s.sample_id for s in samples]))

    def _log_progress(self, elapsed: float | None = None) -> None:
        """An `extract` event. Samples count those a resumed run found in the store; the total leaves out the
        ones regeneration dropped, so a finished shard reads 100 %. `backpressure_s` is the time writes were
        held back by the full buffer (summary.json's extractor_backpressure_seconds), `stall_s` how much of
        it reached the target's forward loop."""
        if elapsed is None:
            elapsed = self.extract_seconds + time.perf_counter() - self._run_started
        self.metrics.log(
            "extract", samples=self._samples_held + self.samples_written, tokens=self.tokens_written,
            samples_total=self.samples_total - self._dropped_uses,
            tok_s=round(self.tokens_written / max(elapsed, 1e-9), 1),
            backpressure_s=round(self.writer.waited_seconds, 3), stall_s=round(self.backpressure_seconds, 3),
        )

    def _finish_report(self) -> None:
        """With regeneration, the samples whose response was too short leave the report's kept ids."""
        if self._dropped:
            for reason, origin in self._dropped.values():
                self.report.skip(reason, origin)
            self.report.sample_ids = [i for i in self.report.sample_ids if i not in self._dropped]
            self.report.write(self.cfg.output_dir)
            log.info("after regeneration: %s", self.report.summary())
            self.report.warn_if_few()
