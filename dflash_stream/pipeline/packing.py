"""Samples packed into segments of about store.segment_bytes, and the segments a full buffer turned away."""

from __future__ import annotations

from collections.abc import Callable

from dflash_stream.store import Sample, SegmentWriter, StoreFull, sizes


class SegmentPacker:
    """Collects samples of one pass until the next would pass `segment_bytes`, then writes them as a segment.

    With `non_blocking`, a segment the full buffer refuses waits in `refused` (the later ones queue behind it,
    in order) until `retry_refused` gets it in; `full` says that the packer is holding refused segments.
    """

    def __init__(self, writer: SegmentWriter, segment_bytes: int, width: int,
                 on_segment: Callable[[list[Sample]], None]) -> None:
        self.writer, self.segment_bytes, self.width, self.on_segment = writer, segment_bytes, width, on_segment
        self.non_blocking = False
        self.pending: list[Sample] = []
        self.pending_pass = 0
        self.pending_tokens = 0
        self.refused: list[tuple[int, list[Sample]]] = []

    @property
    def full(self) -> bool:
        return bool(self.refused)

    def add(self, pass_index: int, sample: Sample) -> None:
        tokens = self.pending_tokens + len(sample.input_ids)
        full = sizes.raw_bytes(tokens, len(self.pending) + 1, self.width) > self.segment_bytes
        if self.pending and (pass_index != self.pending_pass or full):
            self.flush()
        self.pending.append(sample)
        self.pending_pass = pass_index
        self.pending_tokens += len(sample.input_ids)

    def flush(self) -> None:
        """Write what is pending as one segment (or queue it behind a refused one)."""
        if not self.pending:
            return
        samples, pass_index = self.pending, self.pending_pass
        self.pending, self.pending_tokens = [], 0
        if self.refused:  # keep segments in order behind the one the buffer refused
            self.refused.append((pass_index, samples))
            return
        try:
            self.writer.write(samples, pass_index=pass_index, block=not self.non_blocking)
        except StoreFull:
            self.refused.append((pass_index, samples))
            return
        self.on_segment(samples)

    def retry_refused(self) -> bool:
        """Write the segments a full buffer refused earlier; False while it is still full."""
        while self.refused:
            pass_index, samples = self.refused[0]
            try:
                self.writer.write(samples, pass_index=pass_index, block=False)
            except StoreFull:
                return False
            self.refused.pop(0)
            self.on_segment(samples)
        return True
