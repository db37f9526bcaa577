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
    """Decoded `(claim, samples)` until the end of data, from `next(timeout)` or by iterating. Up to
    `prefetch` segments are claimed and decoded ahead; they stay claimed by this consumer until released
    (recovery returns them if the process dies). A segment that fails its checksums is quarantined
    (`SegmentConsumer.quarantine`) and skipped."""

    def __init__(self, consumer: SegmentConsumer, prefetch: int = 2) -> None:
        self.consumer = consumer
        self.wait_seconds = 0.0
        self.exhausted = False
        """True once `next` has seen the end of data."""
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._in_flight = 0  # claimed by the thread, not yet handed out by `next`
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="segment-reader", daemon=True)
        self._thread.start()

    def next(self, timeout: float | None = None) -> tuple[Claim, list[StoredSample]] | None:
        """The next decoded segment; None at the end of data or when none is decoded within `timeout`
        (0: only one already decoded; None: wait as long as it takes)."""
        if self.exhausted:
            return None
        start = time.monotonic()
        try:
            item = self._queue.get(block=timeout != 0, timeout=timeout or None)
        except queue.Empty:
            return None
        finally:
            self.wait_seconds += time.monotonic() - start
        if item is _END:
            self.exhausted = True
            return None
        if isinstance(item, BaseException):
            raise item
        with self._lock:
            self._in_flight -= 1
        return item

    def data_coming(self) -> bool:
        """A segment is being decoded for this consumer, or one is READY for it to claim: `next` with a
        timeout will likely return it soon."""
        with self._lock:
            if self._in_flight:
                return True
        return self.consumer.has_ready()

    def __iter__(self) -> Iterator[tuple[Claim, list[StoredSample]]]:
        while (item := self.next()) is not None:
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
                claim = self.consumer.claim(timeout=0.5)
                if claim is None:
                    if self.consumer.exhausted():
                        break
                    continue
                with self._lock:
                    self._in_flight += 1
                try:
                    samples = self.consumer.read(claim)
                except CorruptChunk as err:  # one bad segment must not end the run: its writer redoes it
                    with self._lock:
                        self._in_flight -= 1
                    self.consumer.quarantine(claim, str(err))
                    continue
                if not self._put((claim, samples)):
                    return
        except BaseException as err:  # handed to the thread that asks for segments
            self._put(err)
            return
        self._put(_END)
