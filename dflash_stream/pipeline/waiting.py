"""How a trainer waits for data: one line when the wait begins, a reminder every REMIND_SECONDS saying what the
extractors are doing (from their heartbeats in the store), and, with `train --wait-timeout`, an end."""

from __future__ import annotations

import time
from typing import Any

from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger
from dflash_stream.store.heartbeat import describe_writers
from dflash_stream.units import fmt_duration

log = get_logger(__name__)

REMIND_SECONDS = 60.0
SHOWN = 3  # sample ids and segments named in a line; the count says how many more
EXTRACT_COMMAND = "dflash-stream extract --config FILE"


class DataWaitTimeout(DFlashError):
    """No data came within `train --wait-timeout`."""


def describe_redo(parts: list[dict[str, Any]], extractor_alive: bool, command: str) -> str | None:
    """The samples of quarantined segments, or of uses a crash rolled back, that wait for re-extraction (count and
    a few ids) and who brings them back, for a waiting trainer's lines; None when there are none. Only a writer
    extracts them again: a trainer launched alone after `extract` finished waits for them until `extract` runs
    again."""
    if not parts:
        return None
    ids = list(dict.fromkeys(i for part in parts for i in part["sample_ids"]))
    segments = list(dict.fromkeys(part["segment_id"] for part in parts))
    shown_ids = ", ".join(map(str, ids[:SHOWN])) + (", ..." if len(ids) > SHOWN else "")
    shown_segments = ", ".join(segments[:SHOWN]) + (f" and {len(segments) - SHOWN} more" if len(segments) > SHOWN
                                                     else "")
    how = ("the running extractor extracts them again" if extractor_alive
           else f"run `{command}` again (it extracts just those)")
    why = " or ".join(dict.fromkeys(part.get("why", "quarantined") for part in parts))
    return (f"{len(ids)} sample(s) of {why} segment{'s' if len(segments) > 1 else ''} {shown_segments} "
            f"wait for re-extraction (ids {shown_ids}): {how}")


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
        self.extract_command = EXTRACT_COMMAND  # `train` names its own config file here

    def _waiting_on(self) -> str:
        """What the data wait on: samples that only re-extraction brings back, then the extractors' state."""
        beats = self.store.heartbeats()
        redo = describe_redo(self.store.redo_waiting(), any(b["alive"] for b in beats.values()), self.extract_command)
        if redo is None:
            return describe_writers(beats)
        # No heartbeat here means the extractors finished (they wrote what was quarantined), not that none began.
        return f"{redo}; " + (describe_writers(beats) if beats else "no extractor is running on this store")

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
                     self.store.status()["segments"], self._waiting_on())
            return
        waited = now - self.since
        if self.timeout is not None and (self.polls - 1) * self.poll_seconds >= self.timeout:
            raise DataWaitTimeout(
                f"no data came within --wait-timeout {self.timeout:g} s: store {self.store.path} has "
                f"{self.store.status()['segments']['ready']} ready segment(s); {self._waiting_on()}"
            )
        if now - self._last_said >= self.remind_every:
            self._last_said = now
            log.info("still waiting for data after %s (store segments: %s); %s", fmt_duration(waited),
                     self.store.status()["segments"], self._waiting_on())
