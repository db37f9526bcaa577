"""The store: a disk-budgeted ring buffer of hidden-state segments between extractors and trainers.

On-disk layout (every state change is one atomic `rename` or an `O_EXCL`/`mkdir` create, or an append to a file
with one writer, so it holds on NFS):

    PATH/store.json                  format, fingerprint, codec, reuse, width, budget (created once)
    PATH/segments/<seg>/             published segments: zarr v3 groups, immutable (see `segment.py`)
    PATH/tmp/<writer>/<seg>/         a segment being written; published by renaming it into segments/
    PATH/info/<seg>.json             a live segment's record: pass index, sample ids, tokens, bytes on disk.
                                     Written before publishing; folded into a ledger once the segment is released.
    PATH/ready/<seg>@<use>           empty marker: READY for its use number <use> (0 .. reuse-1)
    PATH/claimed/<consumer>/<seg>@<use>  the same marker, renamed here by the one consumer that claimed it
    PATH/done/<seg>@<use>            released for the last time; unlinked once the segment is deleted and its
                                     record folded into a ledger
    PATH/released/consumer-<id>.jsonl  records of the segments that consumer released for the last time, one JSON
                                     line each, appended by it alone and fsynced; a torn last line is skipped,
                                     then cut (`ledger.py`). recovery.jsonl: those recovery folded. Read by
                                     `published` and `stored_sample_ids` (resume).
    PATH/writers/expected            how many writers end the data; PATH/writers/<writer>.finished markers
    PATH/budget/lock/                mkdir lock around the reserve step (holder named inside, stale-aware)
    PATH/budget/reserved/<writer>    bytes reserved by that writer's in-flight segment
    PATH/budget/waiting/<writer>     present while that writer waits for the budget

Segment ids are `<writer>.<seq>`. Lifecycle: reserve -> tmp -> info -> rename (published) -> ready@0 ->
claimed -> release: ready@u+1, or after `reuse` uses done -> delete -> ledger line -> unlink info and done
(recovery finishes a release a crash interrupted; a record both in info/ and a ledger counts once). So info/,
done/ and ready/ hold only live segments, and a step costs the same after any number of segments. Budget: `du`
of everything outside segments/ and tmp/ (ledgers included), plus each published segment's recorded size, plus
reservations, plus a small slack, stays <= budget; readiness never comes from zarr (a missing chunk would read
back as fill values).
Published segments are not fsynced: they survive any process crash, and a machine crash shows up as a
checksum error on read.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from dflash_stream.store.errors import (
    BudgetTooSmall,
    CorruptChunk,
    FingerprintMismatch,
    StoreError,
    StoreFull,
    WriterStopped,
)

if TYPE_CHECKING:
    from dflash_stream.store.reader import SegmentReader
    from dflash_stream.store.segment import Sample, StoredSample
    from dflash_stream.store.store import Claim, SegmentConsumer, SegmentInfo, SegmentWriter, Store

# Imported on first use, so that `store status` and other cheap commands do not import torch and zarr.
_LAZY = {
    "SegmentReader": "reader", "Sample": "segment", "StoredSample": "segment", "Claim": "store",
    "SegmentConsumer": "store", "SegmentInfo": "store", "SegmentWriter": "store", "Store": "store",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(import_module(f"dflash_stream.store.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BudgetTooSmall", "Claim", "CorruptChunk", "FingerprintMismatch", "Sample", "SegmentConsumer", "SegmentInfo",
    "SegmentReader", "SegmentWriter", "Store", "StoreError", "StoreFull", "StoredSample", "WriterStopped",
]
