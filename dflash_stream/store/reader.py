"""Claims and decodes segments ahead of the trainer in a background thread."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from dflash_stream.store.errors import CorruptChunk
from dflash_stream.store.segment import StoredSample
from dflash_stream.store.store import Claim, SegmentConsumer

_END = object()


class SegmentReader:
    """Iterate `(claim, samples)` until the end of data. Up to `prefetch` segments are claimed and decoded
    ahead; they stay claimed by this consumer until released (recovery returns them if the process dies). A segment
that fails its checksums is quarantined (`SegmentConsumer.quarantine`) and skipped."""

    def __init__(self, consumer: SegmentConsumer, prefetch: int = 2) -> None:
        self.consumer = consumer
        self.wait_seconds = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="segment-reader", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[tuple[Claim, list[StoredSample]]]:
        while True:
            start = time.monotonic()
            item = self._queue.get()
            self.wait_seconds += time.monotonic() - start
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop prefetching; segments already claimed stay claimed."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                claim, exhausted = self.consumer._poll(timeout=0.5)
                if exhausted:
                    break
                if claim is None:
                    continue
                try:
                    samples = self.consumer.read(claim)
                except CorruptChunk as err:  # one bad segment must not end the run: its writer redoes it
                    self.consumer.quarantine(claim, str(err))
                    continue
                if not self._put((claim, samples)):
                    return
        except BaseException as err:  # handed to the iterating thread
            self._put(err)
            return
        self._put(_END)
