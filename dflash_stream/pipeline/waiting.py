"""How a trainer waits for data: one line when the wait begins, a reminder every REMIND_SECONDS saying what the
extractors are doing (from their heartbeats in the store), and, with `train --wait-timeout`, an end."""

from __future__ import annotations

import time

from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger
from dflash_stream.observe.units import fmt_duration
from dflash_stream.store.heartbeat import describe_writers

log = get_logger(__name__)

REMIND_SECONDS = 60.0


class DataWaitTimeout(DFlashError):
    """No data came within `train --wait-timeout`."""


class DataWait:
    """Call `tick()` before each poll of `poll_seconds` while starved, and `reset()` once data arrive.

    The timeout counts polls rather than clock time: trainer ranks poll in lockstep (they all-reduce between
    polls), so they all give up at the same poll instead of one leaving the others in a collective."""

    def __init__(self, store, poll_seconds: float, timeout: float | None = None,
                 remind_every: float | None = None) -> None:
        self.store, self.poll_seconds, self.timeout = store, poll_seconds, timeout
        self.remind_every = REMIND_SECONDS if remind_every is None else remind_every
        self.since: float | None = None
        self.polls = 0
        self._last_said = 0.0

    def reset(self) -> None:
        self.since, self.polls = None, 0

    def tick(self, data_on_its_way: bool = False) -> None:
        """`data_on_its_way`: a segment is READY or being decoded, so this poll is no wait for data (it neither
        starts a wait nor counts toward the timeout)."""
        if data_on_its_way and self.since is None:
            return
        now = time.monotonic()
        self.polls += 1
        if self.since is None:
            self.since, self._last_said = now, now
            log.info("waiting for data: no segment ready in the store (store segments: %s); %s",
                     self.store.status()["segments"], describe_writers(self.store.heartbeats()))
            return
        waited = now - self.since
        if self.timeout is not None and (self.polls - 1) * self.poll_seconds >= self.timeout:
            raise DataWaitTimeout(
                f"no data came within --wait-timeout {self.timeout:g} s: store {self.store.path} has "
                f"{self.store.status()['segments']['ready']} ready segment(s); {describe_writers(self.store.heartbeats())}"
            )
        if now - self._last_said >= self.remind_every:
            self._last_said = now
            log.info("still waiting for data after %s (store segments: %s); %s", fmt_duration(waited),
                     self.store.status()["segments"], describe_writers(self.store.heartbeats()))
