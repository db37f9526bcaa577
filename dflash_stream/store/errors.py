"""Store errors: each one reads as a single line that names the file, field or figure at fault."""

from dflash_stream.errors import DFlashError


class StoreError(DFlashError, RuntimeError):
    """Base class of every error the store raises on purpose."""


class FingerprintMismatch(StoreError):
    """The store on disk was produced by a different configuration."""


class BudgetTooSmall(StoreError):
    """The byte budget cannot hold even one worst-case segment."""


class StoreFull(StoreError):
    """A non-blocking write found no room in the budget."""


class WriterStopped(StoreError):
    """A writer waiting for room was told to stop (`SegmentWriter.stop_when`): its write did not happen."""


class CorruptChunk(StoreError):
    """A chunk failed its checksum or is missing; the message names the segment and the chunk."""
