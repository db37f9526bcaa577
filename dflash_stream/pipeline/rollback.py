"""Release on use (train.release: on_use): what a trainer rank released since its latest checkpoint, and what a
crash makes it extract again.

A segment use leaves the store as soon as its samples are trained, so a crash can undo training whose segment is
gone (or has moved on to its next use). Before each release the rank appends the use to its release journal
(`OUTPUT/ledger/released-trainer-R.jsonl`, fsynced: one writer, plain appends, a torn last line skipped), with the
step whose optimizer update holds its last samples. A checkpoint at step S holds every use released at a step
<= S; a resume from S finds the uses released after S in the journal and asks their writers to extract the
samples again (`Store.request_redo`), less those the checkpoint records as trained; the replacements come back
READY for exactly those uses, so every sample is trained once per epoch in the final weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_stream.rundir import RunDir, write_atomic
from dflash_stream.store import ledger as appending

if TYPE_CHECKING:
    from dflash_stream.store import Claim


def claim_from_record(record: dict[str, Any]) -> Claim:
    from dflash_stream.store import Claim

    return Claim(**{**record, "sample_ids": tuple(record["sample_ids"])})


class ReleaseJournal:
    """One trainer rank's releases since its latest checkpoint; only that rank's training thread writes it."""

    def __init__(self, output_dir: str | Path, rank: int) -> None:
        self.path = RunDir(output_dir).release_journal(rank)

    def record(self, step: int, claims: list[Claim]) -> None:
        """Durably note that `claims` are released with step `step`'s update; before the store releases them."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        appending.append(self.path, [{"step": step, "claim": asdict(claim)} for claim in claims])

    def _lines(self) -> list[dict[str, Any]]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]  # a torn tail is skipped

    def released_after(self, step: int) -> list[Claim]:
        """The uses released after the checkpoint at `step`: their training is not in it."""
        return [claim_from_record(line["claim"]) for line in self._lines() if line["step"] > step]

    def forget_upto(self, step: int) -> None:
        """A checkpoint at `step` is durable: it holds every use released up to it. Nothing is rewritten while
        the journal has nothing that old."""
        lines = self._lines()
        kept = [line for line in lines if line["step"] > step]
        if len(kept) != len(lines):
            write_atomic(self.path, "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in kept),
                         durable=True)


def redo_parts(lost: list[Claim], trained: dict[tuple[str, int], set[int]]) -> list[dict[str, Any]]:
    """What to extract again for the uses `lost` (released after the checkpoint resumed from): each use's samples
    less those `trained` records as trained in that checkpoint ((segment, use) -> ids), as parts
    {segment_id, pass_index, first_use, last_use, sample_ids}. Consecutive uses of a segment with the same samples
    share one part, so a segment all of whose uses were lost is extracted again once, not once per use."""
    parts: list[dict[str, Any]] = []
    for claim in sorted(lost, key=lambda c: (c.segment_id, c.use_index)):
        done = trained.get((claim.segment_id, claim.use_index), set())
        ids = [i for i in claim.sample_ids if i not in done]
        if not ids:
            continue
        last = parts[-1] if parts else None
        if (last is not None and last["segment_id"] == claim.segment_id and last["last_use"] + 1 == claim.use_index
                and last["sample_ids"] == ids):
            last["last_use"] = claim.use_index
        else:
            parts.append({"segment_id": claim.segment_id, "pass_index": claim.pass_index,
                          "first_use": claim.use_index, "last_use": claim.use_index, "sample_ids": ids})
    return parts
