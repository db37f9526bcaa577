"""`extract.from_store`: an extractor that replays the samples of a kept store instead of running the target.

States extracted once (a store whose budget held all of its data, never trained from) can then be trained
again with another budget, codec or epoch order, with every run seeing the very same states: what
`bench quality` compares. The replay stands where the extractor stands (same writer id, same passes, same
resume and redo of damaged segments), so trainers cannot tell the two apart. Pass 0 keeps the kept store's
order; each later pass (`train.epoch_source: reextract`) reshuffles the data, as the extractor does: segments in
a seeded order, and the samples of up to REPLAY_WINDOW_BYTES of them shuffled together.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dflash_stream.config import REPLAY_WINDOW_BYTES, Config
from dflash_stream.data.report import DataReport
from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger, progress
from dflash_stream.observe.metrics import MetricsWriter
from dflash_stream.pipeline.common import log_store_event, pass_order, stay_for_redo, store_fingerprint
from dflash_stream.pipeline.packing import SegmentPacker
from dflash_stream.pipeline.roles import RoleInfo
from dflash_stream.store import Sample, SegmentInfo, Store, StoredSample, StoreFull
from dflash_stream.store.segment import read_segment
from dflash_stream.store.store import FIELD_WORDS

log = get_logger(__name__)

SAME_FIELDS = ("target", "layer_ids", "verifier_layer", "hidden_size", "max_length", "tokenizer", "data_spec")
"""What the kept store and this run must share (the codec may differ: the states are coded anew)."""


def open_kept_store(cfg: Config, store: Store) -> tuple[Store, list[SegmentInfo]]:
    """The store named by extract.from_store and its first pass's segments, all of them still on disk; refused,
    naming the field, when it was made by another config or when a trainer already freed part of it."""
    path = Path(cfg.extract.from_store).expanduser()
    kept = Store.attach(path)
    ours = store_fingerprint(cfg, store.layer_ids, store.hidden_size)
    for key in SAME_FIELDS:
        if kept.fingerprint.get(key) != ours.get(key):
            raise DFlashError(f"extract.from_store: store {path} was made by another config: {FIELD_WORDS.get(key, key)} "
                              f"differ (stored {kept.fingerprint.get(key)!r}, this run {ours.get(key)!r})")
    if not kept.end_of_data:
        raise DFlashError(f"extract.from_store: the extraction into {path} has not finished; let it finish (or "
                          "resume it) before replaying it")
    first = sorted((i for i in kept.published() if i.pass_index == 0), key=lambda i: i.segment_id)
    gone = [i.segment_id for i in first if not (path / "segments" / i.segment_id).is_dir()]
    if gone or not first:
        raise DFlashError(f"extract.from_store: store {path} no longer holds {len(gone)} of its {len(first)} "
                          f"segments (e.g. {gone[:3]}: trained and freed); only a store whose budget held all of its "
                          "data and that no trainer consumed can be replayed")
    if kept.codec == "fp8" and cfg.store.codec != "fp8":
        log.warning("replaying the fp8 (lossy) states of %s into a %s store: they keep fp8's error", path,
                    cfg.store.codec)
    return kept, first


def as_sample(stored: StoredSample) -> Sample:
    """A sample read back from a store, as a writer takes it."""
    return Sample(stored.sample_id, stored.input_ids.numpy().astype(np.int32), stored.loss_mask.numpy(),
                  stored.hidden_states)


class StoreReplay:
    """This rank's share of a kept store (every count-th segment), every pass, into the run's store."""

    def __init__(self, cfg: Config, role: RoleInfo, store: Store, metrics: MetricsWriter) -> None:
        self.cfg, self.store, self.metrics = cfg, store, metrics
        self.kept, segments = open_kept_store(cfg, store)
        self.segments = segments[role.index::role.count]
        self.sample_ids = [i for info in self.segments for i in info.sample_ids]
        report = DataReport(role.index, role.count, rows=len(self.sample_ids), sample_ids=list(self.sample_ids))
        report.write(cfg.output_dir)  # the trainers' schedule and the audit read the kept ids here
        self.writer = store.writer(f"extractor-{role.index}")
        self._packer = SegmentPacker(self.writer, int(cfg.store.segment_bytes), store.width, self._on_segment)
        self.samples_total = len(self.sample_ids) * cfg.extraction_passes
        self.samples_written = self.tokens_written = 0
        self.extract_seconds = 0.0
        self._work = self._plan()
        self._bar = None
        self._done = False
        self._segments_written = 0
        log.info("replaying %d samples (%d segments, codec %s) of the kept store %s into %s (codec %s), %d pass(es)",
                 len(self.sample_ids), len(self.segments), self.kept.codec, self.kept.path, store.path,
                 store.codec, cfg.extraction_passes)

    @property
    def backpressure_seconds(self) -> float:
        """Seconds the replay waited for room: all of its wait is the writer's (no target forward to stall)."""
        return self.writer.waited_seconds

    def run(self, until_full: bool = False) -> bool:
        """Replay until this rank's share is in the store (True), or, with `until_full`, until the buffer is full
        (False; call again once a trainer has freed room)."""
        self.redo_quarantined(block=not until_full)
        if self._done:
            return True
        if self._bar is None:
            self._bar = progress(total=self.samples_total, unit="sample", desc="replay")
        started = time.perf_counter()
        self._packer.non_blocking = until_full
        try:
            if not self._packer.retry_refused():
                return False
            for pass_index, sample in self._work:
                self._packer.add(pass_index, sample)
                if self._packer.full:
                    return False
            self._packer.flush()
            if self._packer.full:
                return False
        finally:
            self.extract_seconds += time.perf_counter() - started
        self.writer.finish()
        self._bar.close()
        self._done = True
        return True

    def redo_quarantined(self, block: bool = True) -> int:
        """Write again, from the kept store, the samples of this writer's segments a trainer found damaged or a
        crash rolled back; the number of parts written (`block` off: stop at the first one the full buffer has no
        room for)."""
        written = 0
        for tag, part in self.store.redo_requests(self.writer.id):
            wanted = set(part["sample_ids"])
            found = [s for info in self.segments if wanted & set(info.sample_ids) for s in self._read(info)
                     if s.sample_id in wanted]
            try:
                info = self.writer.write(found, pass_index=part["pass_index"], block=block,
                                         first_use=part["first_use"], replaces=tag)
            except StoreFull:
                return written
            written += 1
            log.info("replayed the %d sample(s) of %s part %s again: segment %s (from use %d)",
                     len(found), part["why"], tag, info.segment_id, part["first_use"])
        return written

    def serve_redo(self, training_over) -> None:
        """After this rank's data: replay again whatever a trainer quarantines or a crash rolls back, until training
        is over."""
        stay_for_redo(self.store, self.redo_quarantined, training_over)

    def summary(self) -> dict[str, Any]:
        return {"samples": self.samples_written, "tokens": self.tokens_written,
                "extract_seconds": round(self.extract_seconds, 2),
                "tok_s": round(self.tokens_written / max(self.extract_seconds, 1e-9), 1),
                "backpressure_seconds": round(self.backpressure_seconds, 2), "replayed_from": str(self.kept.path)}

    # -- the work plan --------------------------------------------------------------------------------------

    def _read(self, info: SegmentInfo) -> list[Sample]:
        return [as_sample(s) for s in read_segment(info.segment_id, self.kept.path / "segments" / info.segment_id)]

    def _plan(self) -> Iterator[tuple[int, Sample]]:
        """(pass, sample) for every sample this run's store lacks, pass after pass."""
        for pass_index in range(self.cfg.extraction_passes):
            held = self.store.stored_sample_ids().get(pass_index, set())
            if held:
                log.info("pass %d: %d samples already in the store", pass_index, len(held))
                self._bar.update(len(held))
            for window in self._windows(pass_index):
                for sample in pass_order(window, self.cfg.data.seed, pass_index):
                    if sample.sample_id not in held:
                        yield pass_index, sample

    def _windows(self, pass_index: int) -> Iterator[list[Sample]]:
        """Decoded samples of the kept segments: one segment at a time in pass 0, else a seeded order of them
        gathered REPLAY_WINDOW_BYTES at a time."""
        order = pass_order(self.segments, self.cfg.data.seed, pass_index)
        limit = REPLAY_WINDOW_BYTES if pass_index else 0
        window: list[Sample] = []
        size = 0
        for info in order:
            window += self._read(info)
            size += info.raw_bytes
            if size >= limit:
                yield window
                window, size = [], 0
        if window:
            yield window

    def _on_segment(self, samples: list[Sample]) -> None:
        self.samples_written += len(samples)
        self.tokens_written += sum(len(s.input_ids) for s in samples)
        self._segments_written += 1
        self._bar.update(len(samples))
        log_store_event(self.metrics, self.store, segments_written=self._segments_written)
