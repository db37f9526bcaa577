"""The store: a directory of segments whose lifecycle is kept in marker files moved by atomic renames."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_stream import diskfull
from dflash_stream.log import get_logger
from dflash_stream.rundir import write_atomic
from dflash_stream.store import budget as bud
from dflash_stream.store import codecs, lease, ledger, sizes
from dflash_stream.store.backpressure import BackpressureLog
from dflash_stream.store.errors import (
    BudgetTooSmall,
    CorruptChunk,
    FingerprintMismatch,
    StoreError,
    StoreFull,
    WriterStopped,
)
from dflash_stream.store.heartbeat import Heartbeat, read_heartbeats

# segment.py (torch, zarr) is imported where segments are coded, so `store status` starts without torch.
if TYPE_CHECKING:
    from dflash_stream.store.segment import Sample, StoredSample

log = get_logger("store")
DIRS = ("segments", "tmp", "info", "ready", "claimed", "done", ledger.FOLDER, "writers", "budget", "budget/reserved",
        "budget/waiting", "locks", "quarantine", "redo")
_ID = re.compile(r"^[A-Za-z0-9_-]+$")
POLL_SECONDS = (0.02, 0.5)
IDLE_SUFFIX = ".idle"
"""writers/<id>.idle: the writer waits for room with nothing else to do."""
QUARANTINE_SHARE = 0.25
"""Damaged segments are kept for inspection (and counted in the budget) while the quarantine holds less than
this share of the budget; past it only their records are kept."""


def _redo_folder(tag: str) -> str:
    """Where the request answered by a replacement with redo `tag` lives (see `redo_tag`)."""
    return "redo" if "@" in tag else "quarantine"


def _write_json(path: Path, obj: Any) -> None:
    # No waiting on a full disk here: the writer handles it (its reservation, its segment) itself.
    write_atomic(path, json.dumps(obj), wait_when_full=False)


def _check_id(kind: str, value: str) -> str:
    if not _ID.match(value):
        raise StoreError(f"{kind} id '{value}' is invalid; allowed: letters, digits, '_' and '-'")
    return value


def _marker(name: str) -> tuple[str, int]:
    segment, _, use = name.rpartition("@")
    return segment, int(use)


@dataclass(frozen=True)
class Claim:
    segment_id: str
    pass_index: int
    use_index: int
    sample_ids: tuple[int, ...]
    num_tokens: int
    reuse: int = 1
    bytes: int = 0
    """The segment's size on disk: what its deletion frees."""
    last_use: int | None = None
    """The segment's last use (None: reuse - 1); below it only for a replacement of rolled-back uses."""
    replaces: str | None = None
    """The redo tag of the samples this segment holds again (quarantined, or rolled back after a crash)."""

    @property
    def epoch(self) -> int:
        return self.pass_index * self.reuse + self.use_index

    @property
    def final_use(self) -> int:
        """The use whose release deletes the segment."""
        return self.reuse - 1 if self.last_use is None else self.last_use


@dataclass(frozen=True)
class SegmentInfo:
    segment_id: str
    pass_index: int
    sample_ids: tuple[int, ...]
    num_tokens: int
    raw_bytes: int
    bytes: int
    """Allocated bytes on disk, as `du` counts them."""
    first_use: int = 0
    """The first use it is READY for (above 0 only for a replacement of a damaged segment's later uses, or of
    rolled-back uses)."""
    replaces: str | None = None
    """The redo tag whose samples it holds again: `<segment>.<part>` of a quarantined segment, or
    `<segment>@<use>` of uses rolled back after a crash (`Store.request_redo`)."""
    last_use: int | None = None
    """The last use it is READY for (None: store.reuse - 1); set only for a replacement of rolled-back uses,
    whose original segment still serves the uses after them."""


def _info_from_raw(raw: dict[str, Any]) -> SegmentInfo:
    return SegmentInfo(raw["segment_id"], raw["pass_index"], tuple(raw["sample_ids"]), raw["num_tokens"],
                       raw["raw_bytes"], raw["bytes"], raw.get("first_use", 0), raw.get("replaces"),
                       raw.get("last_use"))


def _raw_from_info(info: SegmentInfo) -> dict[str, Any]:
    """The record as info/<seg>.json holds it (the defaults left out: a ledger line stays short)."""
    raw = {**asdict(info), "sample_ids": list(info.sample_ids)}
    if not info.first_use and info.replaces is None:
        del raw["first_use"], raw["replaces"]
    if info.last_use is None:
        del raw["last_use"]
    return raw


def redo_tag(segment_id: str, first_use: int) -> str:
    """The tag of rolled-back uses of `segment_id` from `first_use` on (quarantine tags hold no `@`)."""
    return f"{segment_id}@{first_use}"


class Store:
    """Open with `Store.open`; see the package docstring for the layout and the lifecycle."""

    def __init__(self, path: Path, manifest: dict[str, Any], budget: int, keep_free: int = 0) -> None:
        self.path = path
        self.keep_free = keep_free
        """Bytes writers leave free on the store's filesystem, whatever the budget (checkpoints, other jobs)."""
        self.fingerprint: dict[str, Any] = manifest["fingerprint"]
        self.codec: str = manifest["codec"]
        self.reuse: int = manifest["reuse"]
        self.budget = budget
        self.layer_ids: list[int] = list(self.fingerprint["layer_ids"])
        self.hidden_size: int = int(self.fingerprint["hidden_size"])
        self.width: int = manifest["width"]
        self.block = bud.block_size(path)
        self._info: dict[str, SegmentInfo] = {}
        self._ledgers = ledger.LedgerReader(path / ledger.FOLDER)
        self._released: dict[str, SegmentInfo] = {}
        """Records folded into the ledgers, as read so far (`_folded`)."""

    # ---- opening -------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, budget: int, codec: str, reuse: int, fingerprint: dict,
             max_segment_raw_bytes: int, create: bool = True, keep_free: int = 0) -> Store:
        path = Path(path)
        if codec not in codecs.REGISTRY:
            raise StoreError(f"unknown store codec '{codec}'; allowed: {', '.join(codecs.names())}")
        if reuse < 1:
            raise StoreError(f"store reuse must be >= 1, got {reuse}")
        try:
            width = len(fingerprint["layer_ids"]) * int(fingerprint["hidden_size"])
        except (KeyError, TypeError, ValueError):
            raise StoreError("the store fingerprint must give layer_ids and hidden_size (the shape of the states)") from None
        smallest = sizes.smallest_budget(path, max_segment_raw_bytes, width, codec)
        if budget < smallest:
            raise BudgetTooSmall(
                f"store budget {budget:,} bytes cannot hold one worst-case segment of {max_segment_raw_bytes:,} raw "
                f"bytes with codec {codec}; the smallest workable budget is {smallest:,} bytes"
            )
        if not path.exists():
            if not create:
                raise StoreError(f"no store at {path} (the directory does not exist)")
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise StoreError(f"cannot create store directory {path}: {err.strerror}") from None
        elif not path.is_dir():
            raise StoreError(f"store path {path} exists and is not a directory")
        _probe_writable(path)
        from dflash_stream.store.segment import FORMAT

        requested = {"format": FORMAT, "fingerprint": fingerprint, "codec": codec, "reuse": reuse, "width": width}
        manifest = _create_or_read_manifest(path, {**requested, "budget": budget}, create)
        manifest = _check_fingerprint(path, manifest, requested, create)
        if manifest.get("budget") != budget:
            # The budget may change between runs; `store status` reports the latest one.
            _write_json(path / "store.json", {**manifest, "budget": budget})
        for d in DIRS:
            (path / d).mkdir(exist_ok=True)
        return cls(path, manifest, budget, keep_free)

    @classmethod
    def attach(cls, path: str | os.PathLike) -> Store:
        """An existing store with the parameters it was last opened with (for inspection commands)."""
        path = Path(path)
        if not (path / "store.json").is_file():
            raise StoreError(f"no store at {path} (store.json is missing)")
        manifest = _create_or_read_manifest(path, {}, create=False)
        return cls(path, manifest, manifest["budget"])

    # ---- the public surface --------------------------------------------------------------------------------
    def writer(self, writer_id: str) -> SegmentWriter:
        # One process per writer id: a second one would write the same segment ids (see lease.py).
        lease.acquire(self.path / "locks" / f"writer-{_check_id('writer', writer_id)}",
                      f"writer id {writer_id} of store {self.path}")
        return SegmentWriter(self, writer_id)

    def consumer(self, consumer_id: str, keep: Iterable[str] = ()) -> SegmentConsumer:
        lease.acquire(self.path / "locks" / f"consumer-{_check_id('consumer', consumer_id)}",
                      f"consumer id {consumer_id} of store {self.path}")
        return SegmentConsumer(self, consumer_id, set(keep))

    def heartbeat(self, writer_id: str) -> Heartbeat:
        """Start showing that this writer is alive (from before it loads its target); `stop()` it when done."""
        return Heartbeat(self.path / "writers", _check_id("writer", writer_id))

    def heartbeats(self) -> dict[str, dict[str, Any]]:
        """writer id -> {age_s, alive, finished, host, pid} for every writer that showed a heartbeat here."""
        return read_heartbeats(self.path / "writers")

    def set_expected_writers(self, n: int) -> None:
        _write_json(self.path / "writers" / "expected", n)

    @property
    def end_of_data(self) -> bool:
        try:
            expected = json.loads((self.path / "writers" / "expected").read_text())
        except FileNotFoundError:
            return False
        # Samples of a damaged segment still to be extracted again are data yet to come.
        return len(self._finished_writers()) >= expected and not self.redo_pending()

    def writers_idle(self) -> bool:
        """Every expected writer has finished, or says it is idle (`SegmentWriter.idle`: waiting for room with
        nothing else to do). A CPU run's trainers take the host's cores meanwhile."""
        try:
            expected = json.loads((self.path / "writers" / "expected").read_text())
        except FileNotFoundError:
            return False
        names = self._ls("writers")
        quiet = {n.removesuffix(".finished") for n in names if n.endswith(".finished")}
        quiet |= {n.removesuffix(IDLE_SUFFIX) for n in names if n.endswith(IDLE_SUFFIX)}
        return len(quiet) >= expected

    def consumers_alive(self) -> bool:
        """Some other live process holds a consumer id of this store (a trainer is running)."""
        return lease.any_live(self.path / "locks", "consumer-")

    def work_for_consumers(self) -> bool:
        """Some segment use is READY or claimed: a consumer has (or is decoding) something to train."""
        return bool(self._ls("ready")) or any(self._ls(f"claimed/{c}") for c in self._ls("claimed"))

    def drained(self) -> bool:
        """End of data, and every segment consumed for the last time."""
        return self.end_of_data and not self._ls("ready") and not any(self._ls(f"claimed/{c}") for c in self._ls("claimed"))

    def published(self) -> list[SegmentInfo]:
        """Every segment ever published here, live or already released and deleted, in segment id order."""
        # In the order a release moves a segment, so that a concurrent one cannot hide it: segments/ is listed
        # before done/ (the marker moves to done/ before the segment is deleted), and the ledgers are read last
        # (a record is appended there before its info/ file and its marker are unlinked).
        names = set(self._ls("segments")) | {_marker(n)[0] for n in self._ls("done")}
        names |= {n.removesuffix(".json") for n in self._ls("quarantine") if n.endswith(".json")}
        found = {seg: info for seg in names if (info := self._record(seg)) is not None}
        for seg, info in self._folded().items():  # a record both folded and in info/ counts once
            found.setdefault(seg, info)
        return [found[seg] for seg in sorted(found)]

    def stored_sample_ids(self) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for info in self.published():
            out.setdefault(info.pass_index, set()).update(info.sample_ids)
        return out

    def status(self) -> dict[str, Any]:
        reserved = self._reserved()
        used = self._used()
        live = [i for i in (self._record(s) for s in self._ls("segments")) if i is not None]
        claimed = [n for c in self._ls("claimed") for n in self._ls(f"claimed/{c}")]
        # done/ before the ledgers (see `published`); a segment in both counts once.
        released = {_marker(n)[0] for n in self._ls("done")} | self._folded().keys()
        return {
            "path": str(self.path), "codec": self.codec, "reuse": self.reuse,
            "budget_bytes": self.budget, "used_bytes": used, "reserved_bytes": reserved,
            "segments": {"ready": len(self._ls("ready")), "claimed": len(claimed), "writing": len(self._ls("tmp", "*/*")),
                         "released": len(released)},
            "samples": sum(len(i.sample_ids) for i in live), "tokens": sum(i.num_tokens for i in live),
            "writers_finished": len(self._finished_writers()), "writers_waiting": len(self._ls("budget/waiting")),
            "end_of_data": self.end_of_data,
        }

    def recover(self, keep_consumers: Iterable[str] = ()) -> dict[str, int]:
        """Clean up after any crash. Only when no other process uses the store (at job start).

        Claims of `keep_consumers` stay: a resuming trainer decides itself which of its claims to keep.
        """
        lease.check_free(self.path / "locks", f"store {self.path}")
        report = {"partial_writes": 0, "reservations": 0, "claims_returned": 0, "deletions_finished": 0}
        for record in self.quarantined():
            self._finish_quarantine(record)
        writers = set(self._ls("tmp")) | set(self._ls("budget/reserved")) | set(self._ls("budget/waiting"))
        for w in writers:
            report["partial_writes"] += len(self._ls(f"tmp/{w}"))
            report["reservations"] += (self.path / "budget" / "reserved" / w).exists()
            self._clean_writer(w)
        for seg in self._ls("segments"):
            if not self._has_marker(seg):
                self._mark_published(seg)
        for c in set(self._ls("claimed")) - set(keep_consumers):
            report["claims_returned"] += self._return_claims(c, set())
        report["records_folded"] = self._finish_releases(report)
        shutil.rmtree(self.path / "budget" / "lock", ignore_errors=True)
        # Running totals of records that earlier versions kept; the budget now measures info/ itself.
        shutil.rmtree(self.path / "budget" / "records", ignore_errors=True)
        return report

    def _finish_releases(self, report: dict[str, int]) -> int:
        """Finish the last releases a crash interrupted (between the marker's move to done/ and its unlink):
        delete the segment, fold its record into the recovery ledger unless its consumer did, then unlink the
        record and the marker. Also folds every release of a store written before the ledgers existed."""
        folder = self.path / ledger.FOLDER
        for name in self._ls(ledger.FOLDER):  # no process appends now: cut torn last lines
            ledger.repair(folder / name)
        pending = sorted((_marker(name)[0], name) for name in self._ls("done"))
        for seg, _ in pending:
            if (self.path / "segments" / seg).exists():
                shutil.rmtree(self.path / "segments" / seg, ignore_errors=True)
                report["deletions_finished"] += 1
        folded = self._folded()
        new = {seg: info for seg, _ in pending if seg not in folded and (info := self._record(seg)) is not None}
        if new:
            ledger.append(folder / ledger.RECOVERY, [_raw_from_info(i) for i in new.values()])
            folded.update(new)
        for seg, name in pending:
            if seg in folded:  # a marker whose record is nowhere (a damaged store) stays, and still counts
                self._forget_released(seg, name)
        return len(new)

    def _folded(self) -> dict[str, SegmentInfo]:
        """The records folded into the ledgers: segment id -> record (the first line of a segment folded twice)."""
        for raw in self._ledgers.read_new():
            self._released.setdefault(raw["segment_id"], _info_from_raw(raw))
        return self._released

    def _forget_released(self, seg: str, marker: str) -> None:
        """Once its record is in a ledger: unlink a released segment's record, then its marker (so that a
        marker without its record means "folded", for recovery)."""
        (self.path / "info" / f"{seg}.json").unlink(missing_ok=True)
        (self.path / "done" / marker).unlink(missing_ok=True)
        self._info.pop(seg, None)

    def _find_sample(self, sample_id: int) -> str:
        """The live segment holding `sample_id`."""
        for seg in sorted(self._ls("segments")):
            info = self._record(seg)
            if info is not None and sample_id in info.sample_ids:
                return seg
        if any(sample_id in ids for ids in self.stored_sample_ids().values()):
            raise StoreError(f"sample {sample_id} was consumed and its segment deleted from {self.path}")
        raise StoreError(f"sample {sample_id} is not in the store at {self.path}")

    # ---- shared helpers ------------------------------------------------------------------------------------
    def _record(self, segment_id: str) -> SegmentInfo | None:
        """A live segment's immutable record from info/; None for an unpublished one, or one released and
        folded into a ledger (see `_folded`)."""
        if segment_id not in self._info:
            try:
                raw = json.loads((self.path / "info" / f"{segment_id}.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                return None
            self._info[segment_id] = _info_from_raw(raw)
        return self._info[segment_id]

    def _ls(self, rel: str, pattern: str | None = None) -> list[str]:
        d = self.path / rel
        try:
            if pattern:
                return [str(p.relative_to(d)) for p in d.glob(pattern)]
            return [n for n in os.listdir(d) if not n.startswith(".")]
        except FileNotFoundError:
            return []

    def _finished_writers(self) -> list[str]:
        return [n for n in self._ls("writers") if n.endswith(".finished")]

    def _reserved(self) -> int:
        total = 0
        for w in self._ls("budget/reserved"):
            try:
                total += int((self.path / "budget" / "reserved" / w).read_text() or 0)
            except (FileNotFoundError, ValueError):
                continue
        return total

    def _used(self) -> int:
        return sum(self._usage())

    def _usage(self) -> tuple[int, int]:
        """(bytes of published segments at their recorded size, bytes of everything outside segments and partial
        writes). Segments are listed before the rest is measured, so a segment deleted in between is still
        counted; whoever asks whether the store holds segments must judge by this listing (the first figure), not
        by a later one. info/ and done/ hold only live segments (released ones are folded into the few ledger
        files), so measuring them all costs the same after any number of segments."""
        charged = 0
        for seg in self._ls("segments"):
            info = self._record(seg)
            # A segment dir without its record is a crashed publish being recovered, or one being deleted
            # whose record was folded already: measure it.
            charged += info.bytes if info else bud.du(self.path / "segments" / seg)
        return charged, bud.du(self.path, frozenset({"segments", "tmp"}))

    def _has_marker(self, seg: str) -> bool:
        names = self._ls("ready") + self._ls("done") + [n for c in self._ls("claimed") for n in self._ls(f"claimed/{c}")]
        return any(_marker(n)[0] == seg for n in names)

    def _mark_ready(self, seg: str, use: int = 0) -> None:
        (self.path / "ready" / f"{seg}@{use}").touch()

    def _mark_published(self, seg: str) -> None:
        """The steps after a segment's publishing rename: a replacement marks its quarantined part redone (before
        READY, so that a crash between the two cannot have it extracted a third time), then READY."""
        info = self._record(seg)
        if info is not None and info.replaces:
            (self.path / _redo_folder(info.replaces) / f"{info.replaces}.redone").touch()
        self._mark_ready(seg, info.first_use if info else 0)

    def _final_use(self, seg: str) -> int:
        """The use whose release deletes segment `seg`."""
        info = self._record(seg)
        return self.reuse - 1 if info is None or info.last_use is None else info.last_use

    # ---- damaged segments ----------------------------------------------------------------------------------
    def quarantined(self) -> list[dict[str, Any]]:
        """Records of the quarantined segments: segment_id, pass_index, use_index, sample_ids, reason, kept
        (whether the damaged files are still in quarantine/) and redo: the parts to extract again, each
        {pass_index, first_use, sample_ids}."""
        records = []
        for name in sorted(self._ls("quarantine")):
            if name.endswith(".json"):
                try:
                    records.append(json.loads((self.path / "quarantine" / name).read_text()))
                except (FileNotFoundError, json.JSONDecodeError):
                    continue
        return records

    def redo_requests(self, writer_id: str) -> list[tuple[str, dict[str, Any]]]:
        """(tag, part) for each part that writer `writer_id` has not extracted again yet: the quarantined ones,
        then the rolled-back ones (`request_redo`). A part gives pass_index, first_use, sample_ids and why
        ("quarantined" or "rolled back"); the writer writes them with `write(samples, pass_index,
        first_use=..., replaces=tag)`, which takes the part's last use from its request."""
        redone = {n.removesuffix(".redone") for n in self._ls("quarantine") if n.endswith(".redone")}
        quarantined = [(f"{r['segment_id']}.{k}", {**part, "why": "quarantined"}) for r in self.quarantined()
                       if r["segment_id"].rpartition(".")[0] == writer_id
                       for k, part in enumerate(r["redo"]) if f"{r['segment_id']}.{k}" not in redone]
        return quarantined + [(r["tag"], {**r, "why": "rolled back"}) for r in self.rollbacks()
                              if not r["redone"] and r["segment_id"].rpartition(".")[0] == writer_id]

    def redo_pending(self) -> bool:
        return bool(self.redo_waiting())

    def redo_waiting(self) -> list[dict[str, Any]]:
        """The parts no writer has extracted again yet, of every writer: {segment_id, pass_index, first_use,
        sample_ids, why} each, `why` "quarantined" or "rolled back" (what a waiting trainer names)."""
        waiting = []
        names = self._ls("quarantine")
        if names:
            redone = {n.removesuffix(".redone") for n in names if n.endswith(".redone")}
            waiting = [{"segment_id": r["segment_id"], **part, "why": "quarantined"} for r in self.quarantined()
                       for k, part in enumerate(r["redo"]) if f"{r['segment_id']}.{k}" not in redone]
        return waiting + [{**r, "why": "rolled back"} for r in self.rollbacks() if not r["redone"]]

    # ---- uses rolled back after a crash --------------------------------------------------------------------
    def request_redo(self, parts: list[dict[str, Any]], reason: str) -> list[str]:
        """Have the writers extract again samples whose trained uses a crash undid after their segment use was
        released (train.release: on_use): each part {segment_id, pass_index, first_use, last_use, sample_ids}
        comes back as a replacement segment READY for exactly those uses, written by the writer of
        `segment_id`. Durable when this returns. A part asked for already (a resume that crashed after asking)
        is left as it is: a segment use is released once, so its tag names one request. The tags."""
        tags = []
        for part in parts:
            tag = redo_tag(part["segment_id"], part["first_use"])
            path = self.path / "redo" / f"{tag}.json"
            if not path.exists():
                write_atomic(path, json.dumps({"tag": tag, **part, "reason": reason, "time": time.time()}),
                             durable=True)
            tags.append(tag)
        return tags

    def rollbacks(self) -> list[dict[str, Any]]:
        """The requests of `request_redo`, each with `redone`: whether its replacement is published."""
        names = self._ls("redo")
        redone = {n.removesuffix(".redone") for n in names if n.endswith(".redone")}
        records = []
        for name in sorted(names):
            if name.endswith(".json"):
                with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                    record = json.loads((self.path / "redo" / name).read_text())
                    records.append({**record, "redone": record["tag"] in redone})
        return records

    def _requested_last_use(self, tag: str) -> int | None:
        """The last use a replacement answering redo `tag` serves (None: every use up to reuse - 1, also when the
        request is not found)."""
        try:
            if _redo_folder(tag) == "redo":
                part = json.loads((self.path / "redo" / f"{tag}.json").read_text())
            else:
                seg, _, k = tag.rpartition(".")
                part = json.loads((self.path / "quarantine" / f"{seg}.json").read_text())["redo"][int(k)]
        except (FileNotFoundError, IndexError, ValueError):
            return None
        return part.get("last_use")

    def _finish_quarantine(self, record: dict[str, Any]) -> None:
        """Move a quarantined segment's files aside (or delete them) and drop its markers; repeatable, so that
        recovery completes a quarantine a crash interrupted."""
        seg = record["segment_id"]
        body = self.path / "segments" / seg
        if record["kept"]:
            with contextlib.suppress(FileNotFoundError):
                os.rename(body, self.path / "quarantine" / seg)
        else:
            shutil.rmtree(body, ignore_errors=True)
        for rel in ["ready", *(f"claimed/{c}" for c in self._ls("claimed"))]:
            for name in self._ls(rel):
                if _marker(name)[0] == seg:
                    (self.path / rel / name).unlink(missing_ok=True)

    def verify(self) -> dict[str, Any]:
        """Read every live segment and check every chunk's checksum; changes nothing."""
        from dflash_stream.store.segment import read_segment

        segments, damaged = sorted(self._ls("segments")), []
        for seg in segments:
            try:
                read_segment(seg, self.path / "segments" / seg)
            except CorruptChunk as err:
                if (self.path / "segments" / seg).exists():  # not merely deleted by a consumer meanwhile
                    damaged.append(seg)
                    log.warning("%s", err)
        return {"segments": len(segments), "damaged": damaged, "ok": not damaged}

    def _clean_writer(self, writer_id: str) -> None:
        """Remove a writer's partial writes, its unpublished records and its reservation; mark its published
        but unmarked segments READY (it died between publishing and marking)."""
        for seg in self._ls(f"tmp/{writer_id}"):
            (self.path / "info" / f"{seg}.json").unlink(missing_ok=True)
        shutil.rmtree(self.path / "tmp" / writer_id, ignore_errors=True)
        for seg in self._ls("segments"):
            if seg.rpartition(".")[0] == writer_id and not self._has_marker(seg):
                self._mark_published(seg)
        for rel in ("budget/reserved", "budget/waiting"):
            (self.path / rel / writer_id).unlink(missing_ok=True)
        (self.path / "writers" / f"{writer_id}{IDLE_SUFFIX}").unlink(missing_ok=True)

    def _return_claims(self, consumer_id: str, keep: set[str]) -> int:
        returned = 0
        for name in self._ls(f"claimed/{consumer_id}"):
            if _marker(name)[0] not in keep:
                os.rename(self.path / "claimed" / consumer_id / name, self.path / "ready" / name)
                returned += 1
        return returned


class SegmentWriter:
    """Writes segments for one writer id; one process owns a writer id at a time."""

    def __init__(self, store: Store, writer_id: str) -> None:
        self.store, self.id = store, writer_id
        self.waited_seconds = 0.0
        self.stop_when: Callable[[], bool] | None = None
        """Asked while a write waits for room: True ends the wait with WriterStopped (training is over, nothing
        will free room)."""
        self._pressure = BackpressureLog(log, writer_id)
        self._idle = False
        store._clean_writer(writer_id)
        (store.path / "writers" / f"{writer_id}.finished").unlink(missing_ok=True)
        # Past every segment this writer published: the live ones' records (info/), then the released ones'
        # (the ledgers, read after: a record leaves info/ only once it is folded).
        mine = [n.removesuffix(".json") for n in store._ls("info") if n.endswith(".json")]
        mine += list(store._folded())
        seqs = [seq for w, _, seq in (s.rpartition(".") for s in mine) if w == writer_id and seq.isdigit()]
        self._seq = max(map(int, seqs), default=-1) + 1
        (store.path / "tmp" / writer_id).mkdir(exist_ok=True)

    def write(self, samples: list[Sample], pass_index: int = 0, block: bool = True, first_use: int = 0,
              replaces: str | None = None) -> SegmentInfo:
        """`first_use` and `replaces` (a tag from `Store.redo_requests`) write a damaged segment's samples again."""
        from dflash_stream.store.segment import check_samples, encode_segment, files_bound, write_files

        st = self.store
        tokens = check_samples(samples, st.width)
        raw = sizes.raw_bytes(tokens, len(samples), st.width)
        seg = f"{self.id}.{self._seq:06d}"
        record = {"segment_id": seg, "pass_index": pass_index, "sample_ids": [int(s.sample_id) for s in samples],
                  "num_tokens": tokens, "raw_bytes": raw}
        last_use = None
        if replaces is not None:
            record.update(first_use=first_use, replaces=replaces)
            last_use = st._requested_last_use(replaces)
            if last_use is not None:
                record["last_use"] = last_use
        files = encode_segment(samples, st.codec, st.layer_ids, st.hidden_size)
        record_bytes = len(json.dumps({**record, "bytes": 0})) + 32
        # The segment, its record, and this writer's reservation file.
        need = files_bound(files, st.block) + (-(-record_bytes // st.block) + 1) * st.block
        tmp = st.path / "tmp" / self.id / seg
        waited, delay = 0.0, 1.0
        while True:
            try:
                self._reserve(need, block)
                write_files(tmp, files)
                info = SegmentInfo(seg, pass_index, tuple(record["sample_ids"]), tokens, raw, bud.du(tmp),
                                   record.get("first_use", 0), replaces, last_use)
                if info.bytes > need:
                    log.warning("segment %s took %d bytes, more than the %d reserved for it", seg, info.bytes, need)
                _write_json(st.path / "info" / f"{seg}.json", {**record, "bytes": info.bytes})
                os.rename(tmp, st.path / "segments" / seg)
                break
            except OSError as err:
                with contextlib.suppress(OSError):  # a read-only disk refuses this too; recovery finishes it
                    (st.path / "info" / f"{seg}.json").unlink(missing_ok=True)
                    shutil.rmtree(tmp, ignore_errors=True)
                    self._unreserve()
                if not diskfull.is_full(err):
                    raise StoreError(f"writing segment {seg} under {st.path} failed: {err.strerror or err}; the "
                                     "partial write was removed") from None
                # The filesystem filled below the budget (another job took the space): wait for room.
                free = diskfull.free_bytes(st.path)
                if not block:
                    raise StoreFull(f"the disk under {st.path} filled while writing segment {seg} ({free:,} bytes "
                                    "free); the partial write was removed") from None
                if waited >= diskfull.WAIT_SECONDS:
                    raise diskfull.DiskFull(f"the disk under {st.path} stayed full for {waited:.0f} s ({free:,} bytes "
                                            "free); free space there and run the same command again") from None
                log.warning("disk full while writing segment %s under %s (%s bytes free): the partial write was "
                            "removed; retrying in %.0f s", seg, st.path, f"{free:,}", delay)
                time.sleep(delay)
                waited, delay = waited + delay, min(delay * 2, diskfull.MAX_DELAY)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                self._unreserve()
                raise
        # Published: from here on only forward, never undone.
        st._info[seg] = info
        diskfull.retry_when_full(f"the markers of segment {seg}", st.path, lambda: st._mark_published(seg))
        self._unreserve()  # the record in info/ is measured by the budget from now on
        self._seq += 1
        return info

    def finish(self) -> None:
        self._pressure.flowing(final=True)
        self.idle(False)
        (self.store.path / "writers" / f"{self.id}.finished").touch()

    def idle(self, idle: bool) -> None:
        """Say whether this writer has nothing to do but wait for room (writers/<id>.idle, `Store.writers_idle`);
        only a change touches the disk."""
        if idle != self._idle:
            marker = self.store.path / "writers" / f"{self.id}{IDLE_SUFFIX}"
            with contextlib.suppress(OSError):  # only a hint for the trainers' cores; a full disk may refuse it
                if idle:
                    marker.touch()
                else:
                    marker.unlink(missing_ok=True)
                self._idle = idle

    # ---- budget --------------------------------------------------------------------------------------------
    def _reserve(self, need: int, block: bool) -> None:
        st = self.store
        slack = bud.SLACK_BLOCKS * st.block
        waiting_since: float | None = None
        delay = POLL_SECONDS[0]
        while True:
            with bud.DirLock(st.path / "budget" / "lock"):
                # Reservations are read before segments and segments before the rest: see `_used`.
                reserved = st._reserved()
                in_segments, outside = st._usage()
                used = in_segments + outside
                fits_budget = used + reserved + need + slack <= st.budget
                # The filesystem may be smaller, or fuller, than the budget: leave store.keep_free to the rest.
                free = diskfull.free_bytes(st.path)
                fits_disk = need + slack <= free - reserved - st.keep_free
                if fits_budget and fits_disk:
                    try:
                        _write_json(st.path / "budget" / "reserved" / self.id, need)
                        break
                    except OSError as err:
                        if not diskfull.is_full(err):
                            raise
                        fits_disk = False
            # Empty by the listing `used` was measured on: a segment a trainer deleted since is counted in `used`
            # but gone from a new listing, and would pass for records that never leave.
            empty = reserved == 0 and in_segments == 0
            if not fits_budget and empty and used + need + slack > st.budget:
                raise BudgetTooSmall(
                    f"store budget {st.budget:,} bytes cannot fit a segment needing {need:,} bytes beside the "
                    f"{used:,} bytes of records already there; raise store.budget"
                )
            waited_long = waiting_since is not None and time.monotonic() - waiting_since > diskfull.WAIT_SECONDS
            if not fits_disk and empty and (not block or waited_long):
                raise diskfull.DiskFull(
                    f"the filesystem under {st.path} has {free:,} bytes free, store.keep_free keeps {st.keep_free:,} "
                    f"of them, a segment needs {need:,}, and the store holds nothing a trainer could free; free space "
                    "there (or lower store.keep_free) and run the same command again"
                )
            if not block:
                raise StoreFull(
                    f"store {st.path} is full: used {used:,} + reserved {reserved:,} of {st.budget:,} bytes; "
                    f"{need:,} bytes needed" + ("" if fits_disk else f"; the disk has {free:,} bytes free")
                )
            if waiting_since is None:
                waiting_since = time.monotonic()
                with contextlib.suppress(OSError):  # only a hint for the trainers; a full disk may refuse it
                    (st.path / "budget" / "waiting" / self.id).touch()
                if fits_disk:
                    self._pressure.blocked(f"used {used:,} + reserved {reserved:,} of budget {st.budget:,} bytes, "
                                           f"{need:,} bytes needed")
                else:
                    log.warning("writer %s waits for space: the filesystem under %s has %s bytes free (store.keep_free "
                                "keeps %s of them), below what store.budget allows; %s bytes needed", self.id,
                                st.path, f"{free:,}", f"{st.keep_free:,}", f"{need:,}")
            else:
                self._pressure.remind()
            if self.stop_when is not None and self.stop_when():
                (st.path / "budget" / "waiting" / self.id).unlink(missing_ok=True)
                raise WriterStopped(f"writer {self.id} stopped waiting for room in {st.path}: it was told to stop")
            time.sleep(delay)
            delay = min(delay * 2, POLL_SECONDS[1])
        if waiting_since is not None:
            waited = time.monotonic() - waiting_since
            self.waited_seconds += waited
            (st.path / "budget" / "waiting" / self.id).unlink(missing_ok=True)
            self._pressure.resumed(waited)
        else:
            self._pressure.flowing()

    def _unreserve(self) -> None:
        (self.store.path / "budget" / "reserved" / self.id).unlink(missing_ok=True)


class SegmentConsumer:
    """Claims READY segments for one consumer id; one process owns a consumer id at a time."""

    def __init__(self, store: Store, consumer_id: str, keep: set[str]) -> None:
        self.store, self.id = store, consumer_id
        self._dir = store.path / "claimed" / consumer_id
        self._dir.mkdir(exist_ok=True)
        store._return_claims(consumer_id, keep)
        self._ledger = store.path / ledger.FOLDER / ledger.consumer_ledger(consumer_id)

    def claim(self, timeout: float | None = None) -> Claim | None:
        """A READY segment use, exclusively; blocks until one is ready, the end of data or `timeout`
        (None in the last two cases: `exhausted()` tells them apart)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = POLL_SECONDS[0]
        while True:
            claim = self._try_claim()
            if claim is not None:
                return claim
            if self.exhausted():
                return None
            if deadline is not None and time.monotonic() >= deadline:
                return None
            pause = delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic()))
            time.sleep(pause)
            delay = min(delay * 2, POLL_SECONDS[1])

    def read(self, claim: Claim) -> list[StoredSample]:
        from dflash_stream.store.segment import read_segment

        return read_segment(claim.segment_id, self.store.path / "segments" / claim.segment_id)

    def release(self, claims: list[Claim]) -> None:
        st = self.store
        for c in claims:
            src = self._dir / f"{c.segment_id}@{c.use_index}"
            last = c.use_index >= c.final_use
            try:
                if last:
                    os.rename(src, st.path / "done" / src.name)  # released: from here on only forward
                else:
                    os.rename(src, st.path / "ready" / f"{c.segment_id}@{c.use_index + 1}")
            except FileNotFoundError:
                raise StoreError(
                    f"segment {c.segment_id} (use {c.use_index}) is not claimed by consumer {self.id}; it was "
                    "released already or returned to READY by recovery"
                ) from None
            except OSError as err:  # a store that became read-only (or vanished): say so in one line
                raise StoreError(f"releasing segment {c.segment_id} in {st.path} failed: {err.strerror or err}; "
                                 "it stays claimed, and the next run releases it") from None
            if last:
                shutil.rmtree(st.path / "segments" / c.segment_id, ignore_errors=True)
                self._fold(c.segment_id, src.name)

    def _fold(self, seg: str, marker: str) -> None:
        """Move a released segment's record from info/ into this consumer's ledger, and drop its marker, so
        that info/ and done/ keep only live segments. Left to recovery when it fails (a full disk)."""
        st = self.store
        info = st._record(seg)
        if info is None:
            return
        try:
            ledger.append(self._ledger, [_raw_from_info(info)])
            st._forget_released(seg, marker)
        except OSError as err:  # the release itself is done; recovery folds what is left
            log.warning("could not fold the record of released segment %s into %s (%s); it stays in info/ until "
                        "the store is recovered", seg, self._ledger, err.strerror or err)

    def writers_waiting(self) -> bool:
        return bool(self.store._ls("budget/waiting"))

    def has_ready(self) -> bool:
        """Some segment use is READY to claim."""
        return bool(self.store._ls("ready"))

    def quarantine(self, claim: Claim, reason: str, trained: Iterable[int] = ()) -> None:
        """Set a damaged segment aside instead of stopping: its writer extracts its samples again for this use
        and the later ones, so every epoch still trains each sample once. `trained`: ids of this use already
        trained (a half-trained segment found damaged on resume); only the rest come back for this use."""
        st, seg = self.store, claim.segment_id
        path = st.path / "quarantine" / f"{seg}.json"
        record = None
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            record = json.loads(path.read_text())  # quarantined before a crash: keep what it decided
        if record is None:
            done = set(trained)
            rest = [i for i in claim.sample_ids if i not in done]
            # A replacement of rolled-back uses ends at its own last use: the parts end there too.
            last = {} if claim.last_use is None else {"last_use": claim.last_use}
            redo = [{"pass_index": claim.pass_index, "first_use": claim.use_index, "sample_ids": rest, **last}
                    ] if rest else []
            if done and claim.use_index < claim.final_use:
                redo.append({"pass_index": claim.pass_index, "first_use": claim.use_index + 1,
                             "sample_ids": [i for i in claim.sample_ids if i in done], **last})
            kept = bud.du(st.path / "quarantine") + claim.bytes <= st.budget * QUARANTINE_SHARE
            record = {"segment_id": seg, "pass_index": claim.pass_index, "use_index": claim.use_index,
                      "sample_ids": list(claim.sample_ids), "reason": reason, "kept": kept, "redo": redo,
                      "time": time.time()}
            # The decision is durable before anything moves; recovery completes the rest after a crash.
            diskfull.retry_when_full(f"quarantine record {path}", st.path, lambda: _write_json(path, record))
            where = (f"its files kept in {st.path / 'quarantine' / seg} (counted in the budget until you delete them)"
                     if kept else "its files deleted (the quarantine already holds a quarter of the budget)")
            log.warning("quarantined damaged segment %s (%s); %s; its %d sample(s) %s will be extracted again by "
                        "writer %s", seg, reason, where, len(claim.sample_ids), list(claim.sample_ids),
                        seg.rpartition(".")[0])
        st._finish_quarantine(record)

    def _try_claim(self) -> Claim | None:
        st = self.store
        ready = []
        for name in st._ls("ready"):
            seg, use = _marker(name)
            info = st._record(seg)
            if info is None:
                raise StoreError(f"store {st.path} is damaged: ready/{name} has no record info/{seg}.json")
            ready.append((info.pass_index * st.reuse + use, name, info, use))
        # Lowest epoch first, so every segment's use u is served before any segment's use u + 1.
        for _, name, info, use in sorted(ready, key=lambda r: r[:2]):
            try:
                os.rename(st.path / "ready" / name, self._dir / name)
            except FileNotFoundError:
                continue  # another consumer took it
            return Claim(info.segment_id, info.pass_index, use, info.sample_ids, info.num_tokens, st.reuse, info.bytes,
                         info.last_use, info.replaces)
        return None

    def exhausted(self) -> bool:
        """True once nothing is left to claim, now or later: the writers are done, nothing is READY, and no
        claim will come back to READY for another use."""
        st = self.store
        if not st.end_of_data:
            return False
        # claimed, ready, claimed again: a marker moving between the two directories is seen at least once.
        first = self._claimed_elsewhere()
        if st._ls("ready"):
            return False
        return not (first or self._claimed_elsewhere())

    def _claimed_elsewhere(self) -> bool:
        """Some claim will come back to READY for another use."""
        st = self.store
        return any(use < st._final_use(seg) for c in st._ls("claimed")
                   for seg, use in map(_marker, st._ls(f"claimed/{c}")))


def _probe_writable(path: Path) -> None:
    probe = path / f".probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise StoreError(f"store directory {path} is not writable: {err.strerror}") from None


def _create_or_read_manifest(path: Path, requested: dict[str, Any], create: bool) -> dict[str, Any]:
    manifest = path / "store.json"
    if not manifest.exists():
        if not create:
            raise StoreError(f"no store at {path} (store.json is missing)")
        tmp = path / f".store.json.{os.getpid()}"
        tmp.write_text(json.dumps({**requested, "created": time.time()}, indent=1))
        try:
            os.link(tmp, manifest)  # fails if another process created it first; theirs wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    try:
        return json.loads(manifest.read_text())
    except json.JSONDecodeError as err:
        raise StoreError(f"{manifest} is not valid JSON: {err}") from None


FIELD_WORDS = {
    "format": "store formats", "codec": "codecs (store.codec)", "reuse": "uses per segment (store.reuse)",
    "target": "target models (target.model)", "layer_ids": "captured target layers (target.layer_ids, extract.verifier_states)",
    "verifier_layer": "verifier states (extract.verifier_states)",
    "hidden_size": "hidden sizes of the target", "max_length": "maximum lengths (data.max_length)",
    "tokenizer": "tokenizers (target.model, target.revision)", "data_spec": "data specs",
    "sources": "data sources (data.sources)", "system_prompt": "system prompts (data.system_prompt)",
    "regenerate": "regeneration settings (data.regenerate)", "generation": "generation settings (data.generation)",
    "min_supervised_tokens": "minimum supervised tokens (data.min_supervised_tokens)", "seed": "data seeds (data.seed)",
    "extract_engine": "engines that computed the states (extract.engine; none stored means hf)",
}
"""How a mismatch names each field, in words."""
DETAIL = "_detail"
"""A fingerprint key `X_detail` spells out field X (a digest) so that a mismatch can say what differs; it is
compared only through X."""


def _mismatch(stored: dict[str, Any], requested: dict[str, Any]) -> str | None:
    """The first field in which a store's manifest and a run's request differ, in words; None if none does."""
    fields = [(k, stored.get(k), requested[k]) for k in ("format", "codec", "reuse")]
    old_fp, new_fp = stored.get("fingerprint", {}), requested["fingerprint"]
    keys = sorted(k for k in set(old_fp) | set(new_fp) if not k.endswith(DETAIL))
    fields += [(k, old_fp.get(k), new_fp.get(k)) for k in keys]
    for name, old, new in fields:
        if old == new:
            continue
        old_detail, new_detail = old_fp.get(name + DETAIL), new_fp.get(name + DETAIL)
        if isinstance(old_detail, dict) and isinstance(new_detail, dict):
            for sub in sorted(set(old_detail) | set(new_detail)):
                if old_detail.get(sub) != new_detail.get(sub):
                    return (f"{FIELD_WORDS.get(sub, sub)} differ: stored {old_detail.get(sub)!r}, "
                            f"this run {new_detail.get(sub)!r}")
        words = FIELD_WORDS.get(name, name)
        return f"{words} differ: stored {old!r}, this run {new!r}"
    return None


def _holds_nothing(path: Path) -> bool:
    """No segment was ever published, claimed or begun, and no writer holds a reservation."""
    for rel in ("info", "segments", "ready", "done", ledger.FOLDER, "budget/reserved"):
        d = path / rel
        if d.is_dir() and any(not n.startswith(".") for n in os.listdir(d)):
            return False
    return not any(any(sub.iterdir()) for rel in ("tmp", "claimed") if (path / rel).is_dir()
                   for sub in (path / rel).iterdir() if sub.is_dir())


def _check_fingerprint(path: Path, manifest: dict[str, Any], requested: dict[str, Any], create: bool
                       ) -> dict[str, Any]:
    """The manifest to use. A store that holds nothing yet (an earlier run failed before its first segment)
    takes the new config instead of refusing it; otherwise a mismatch is refused, naming what differs."""
    why = _mismatch(manifest, requested)
    if why is None:
        return manifest
    alive = [w for w, b in read_heartbeats(path / "writers").items() if b["alive"]]
    if create and _holds_nothing(path) and not alive:
        log.info("store %s holds no segment yet: it takes this run's config (%s)", path, why)
        manifest = {**manifest, **requested}
        _write_json(path / "store.json", manifest)
        return manifest
    published = len(Store(path, manifest, manifest.get("budget", 0)).published())
    raise FingerprintMismatch(
        f"store {path} was made by another config: {why}; use another store.path, or delete the store "
        f"({published} segment(s) published in it)"
    )
