"""Where one trainer rank is in the data: the segment uses it holds and which of their samples it trained.

Exactly-once rests on this record. A checkpoint saves it (`state_dict`: the finished uses not yet released, and
the half-trained ones, with the ids already trained); a resume loads it (`load_state_dict`), which releases what
was finished, asks for the uses released after the checkpoint to be extracted again (train.release on_use,
`rollback.py`), and re-queues the untrained rest of every half-trained segment, so nothing is lost or trained
twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dflash_stream.drafter.batches import Member, TokenBatcher
from dflash_stream.log import get_logger
from dflash_stream.pipeline.rollback import ReleaseJournal, claim_from_record, redo_parts

if TYPE_CHECKING:
    from dflash_stream.store import Claim, SegmentConsumer, Store, StoredSample

log = get_logger(__name__)


@dataclass
class SegmentUse:
    """One claimed use of a segment and how far training got through it."""

    claim: Claim
    remaining: set[int]
    trained: list[int] = field(default_factory=list)
    since_checkpoint: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return not self.remaining


def _ledger_entry(claim: Claim, sample_ids: list[int]) -> dict[str, Any]:
    """One ledger line; a replacement's samples (extracted again) are marked with the redo tag it answers."""
    entry: dict[str, Any] = {"segment": claim.segment_id, "epoch": claim.epoch, "sample_ids": list(sample_ids)}
    if claim.replaces is not None:
        entry["redo"] = claim.replaces
    return entry


class DataPosition:
    """The segment uses of consumer `consumer_id` and their samples queued in `batcher`. `consumer` exists
    once `load_state_dict` ran (with the empty state `EMPTY` for a fresh start). `journal`: the release journal
    of `release_used` (train.release on_use), which a resume reads whatever the rule."""

    EMPTY: dict[str, list] = {"finished": [], "partial": []}

    def __init__(self, store: Store, consumer_id: str, batcher: TokenBatcher, journal: ReleaseJournal) -> None:
        self.store, self.consumer_id, self.batcher, self.journal = store, consumer_id, batcher, journal
        self.uses: dict[str, SegmentUse] = {}
        self.consumer: SegmentConsumer
        self.released_entries: list[dict[str, Any]] = []
        """Ledger lines of uses released since the latest checkpoint was taken (they left `uses`)."""
        self.rolled_back: list[dict[str, Any]] = []
        """The redo parts the last `load_state_dict` asked for."""

    def __len__(self) -> int:
        """Segment uses held, finished or not."""
        return len(self.uses)

    def add(self, claim: Claim, samples: list[StoredSample]) -> None:
        """A freshly claimed segment use: all its samples are still to train."""
        self.uses[claim.segment_id] = SegmentUse(claim, {s.sample_id for s in samples})
        self.batcher.add(claim.segment_id, samples)

    def mark_trained(self, members: list[Member]) -> int:
        """Record a trained batch; the highest epoch it belonged to."""
        epoch = 0
        for member in members:
            use = self.uses[member.segment_id]
            use.remaining.discard(member.sample.sample_id)
            use.trained.append(member.sample.sample_id)
            use.since_checkpoint.append(member.sample.sample_id)
            epoch = max(epoch, use.claim.epoch)
        return epoch

    def finished_bytes(self) -> int:
        """Disk bytes of the uses finished but not released (what a checkpoint would free)."""
        return sum(use.claim.bytes for use in self.uses.values() if use.done)

    def ledger_entries(self) -> list[dict[str, Any]]:
        """The audit's ledger lines: each use's samples trained since the previous checkpoint, released or not."""
        return self.released_entries + [_ledger_entry(u.claim, u.since_checkpoint)
                                        for u in self.uses.values() if u.since_checkpoint]

    def state_dict(self) -> dict[str, list]:
        """Copies, not views: a background checkpoint writes them while training appends to the live lists."""
        return {
            "finished": [asdict(u.claim) for u in self.uses.values() if u.done],
            "partial": [{"claim": asdict(u.claim), "trained": list(u.trained)}
                        for u in self.uses.values() if u.trained and not u.done],
        }

    def checkpoint_taken(self) -> list[Claim]:
        """A checkpoint recorded `state_dict` and `ledger_entries` as they are now: the next ledger starts empty.
        The finished uses it records, to `release` once it is durable; uses that finish later wait for the next
        checkpoint even if this one becomes durable after they finished (it does not record them)."""
        for use in self.uses.values():
            use.since_checkpoint = []
        self.released_entries = []
        return [u.claim for u in self.uses.values() if u.done]

    def release(self, finished: list[Claim]) -> int:
        """After the checkpoint that recorded `finished` is durable: let those uses leave the store."""
        if finished:
            self.consumer.release(finished)
        for claim in finished:
            del self.uses[claim.segment_id]
        return len(finished)

    def release_used(self, step: int) -> int:
        """train.release on_use: let every finished use leave the store now, journaled first as released with
        step `step`'s update (which must hold their last samples); their ledger lines wait for the next
        checkpoint. The number released."""
        finished = [u for u in self.uses.values() if u.done]
        if not finished:
            return 0
        claims = [u.claim for u in finished]
        self.journal.record(step, claims)
        self.consumer.release(claims)
        for use in finished:
            if use.since_checkpoint:
                self.released_entries.append(_ledger_entry(use.claim, use.since_checkpoint))
            del self.uses[use.claim.segment_id]
        return len(claims)

    def release_finished(self) -> int:
        """After a durable checkpoint written just now (training stood still): release the finished uses it
        recorded and start the next ledger."""
        return self.release(self.checkpoint_taken())

    def load_state_dict(self, state: dict[str, list], step: int = 0) -> None:
        """Open the consumer keeping the claims `state` (checkpoint step `step`) records, release the finished
        ones, have the uses released after the checkpoint extracted again, and re-queue the untrained samples of
        the half-trained ones; every other claim of this consumer goes back to READY."""
        from dflash_stream.store import CorruptChunk, StoreError

        finished = [claim_from_record(r) for r in state["finished"]]
        partial = [(claim_from_record(r["claim"]), r["trained"]) for r in state["partial"]]
        lost = self.journal.released_after(step)
        if finished or lost:
            held = finished + [claim for claim, _ in partial] + lost
            consumer = self.store.consumer(self.consumer_id, keep=[c.segment_id for c in held])
            released = 0
            # Finished ones: trained and recorded, so never retrained. Lost ones: journaled as released, so
            # extracted again below. The crash may have come before their release, or after it (then the store no
            # longer holds this use for us, and says so).
            for claim in finished + lost:
                try:
                    consumer.release([claim])
                    released += claim in finished
                except StoreError:
                    continue
            if released:
                log.info("released %d segment use(s) finished before the restart", released)
        if lost:
            self._roll_back(lost, partial, step)
        lost_uses = {(c.segment_id, c.use_index) for c in lost}
        partial = [(claim, trained) for claim, trained in partial if (claim.segment_id, claim.use_index) not in lost_uses]
        half_done = [claim.segment_id for claim, _ in partial]
        # `keep` matches segment ids, so it also kept any later use of a finished or lost segment that we had
        # claimed after releasing it; that use was not trained and goes back to READY now.
        self.consumer = self.store.consumer(self.consumer_id, keep=half_done)
        for claim, trained in partial:
            done = set(trained)
            try:
                samples = [s for s in self.consumer.read(claim) if s.sample_id not in done]
            except CorruptChunk as err:  # its untrained rest is extracted again (the trained part is recorded)
                self.consumer.quarantine(claim, str(err), trained=done)
                continue
            self.uses[claim.segment_id] = SegmentUse(claim, set(claim.sample_ids) - done, list(trained))
            self.batcher.add(claim.segment_id, samples)

    def _roll_back(self, lost: list[Claim], partial: list[tuple[Claim, list[int]]], step: int) -> None:
        """The uses `lost` were released after checkpoint `step` and their training since it is undone: ask
        their writers to extract again the samples the checkpoint does not record as trained. The journal keeps
        them until the next durable checkpoint: a second crash before it resumes from `step` again, and must
        again know them as lost, or it would read their half-trained records in that checkpoint from segments
        already gone; asking again changes nothing (one request per use, left as it is)."""
        trained = {(claim.segment_id, claim.use_index): set(ids) for claim, ids in partial}
        self.rolled_back = redo_parts(lost, trained)
        self.store.request_redo(self.rolled_back, f"released by {self.consumer_id} after checkpoint step {step}, "
                                                  "whose training a crash undid")
        uses = sum(len(p["sample_ids"]) * (p["last_use"] - p["first_use"] + 1) for p in self.rolled_back)
        log.info("rolled back %d segment use(s) released after checkpoint step %d: %d sample use(s) to train again, "
                 "%d sample(s) to extract again (%d part(s))", len(lost), step, uses,
                 sum(len(p["sample_ids"]) for p in self.rolled_back), len(self.rolled_back))
