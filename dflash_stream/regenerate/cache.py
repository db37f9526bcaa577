"""The response cache: the target's answers, appended as they come, so that a restart, a later extraction pass
or another engine never asks for an answer twice (and, when sampling, gets the answer the first pass trained on).

Keyed by what decides an answer's tokens (`answers_key`): the data spec, the target (model, GGUF file, revision),
its tokenizer, its stop tokens and data.max_length. Another target or length is another cache: its answers are
asked for anew, and a line says why the answers on disk were not taken (`describe_other_caches`).

Files, in OUTPUT/data/: `responses-<key>-<part>.jsonl` (one JSON line per answer: sample_id, tokens, finish, t)
and beside it `.idx`, one fixed INDEX record per line (sample id, offset, length, time). A part has one writer
(an extractor's shard index, or `regenerate-<host>-<pid>`), as NFS needs, and each record is one `write` call, so
lines cannot interleave; every part is read, so the process count may change between runs. A sample answered
twice (`regenerate` beside `run`) keeps its first answer, by the time written into each record, and the
extractor looks again (`refresh`) before it uses an answer, so every pass trains on that one.

Only the index is held in memory (numpy arrays, INDEX_BYTES_PER_ANSWER per answer at most), never the tokens: an
answer is read from its file when asked for. Caches written before the key held the target (responses-<data digest>-*)
are not read: their target is unknown, so their answers are asked for again.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from dflash_stream.config import Config
from dflash_stream.data.spec import data_spec_digest
from dflash_stream.log import get_logger
from dflash_stream.rundir import RunDir, write_atomic

log = get_logger(__name__)

SYNC_EVERY_S = 1.0
"""How often answers appended one by one reach the disk (a killed process loses nothing already written; this
bounds what a power cut loses)."""
INDEX = np.dtype([("sample_id", "<i8"), ("offset", "<i8"), ("length", "<i4"), ("time", "<f8")])
"""One answer's record in a part's .idx file: where its line is in the .jsonl, and when it was written."""
INDEX_BYTES_PER_ANSWER = 3 * (INDEX.itemsize + 8 + 2) + 8
"""Memory per cached answer at most: the index arrays kept (its record, its sample id as the sorted search key,
its part number) and, while new answers are merged in, their concatenation, its sorted copy and the sort's int64
order."""
FOLD_AT = 65536
"""Answers learned since the last merge (this process's, other writers') kept in a dict before they are merged into
the arrays."""


def answers_key(cfg: Config, tokenizer: Any, stop_ids: set[int]) -> dict[str, Any]:
    """What decides an answer's tokens: the data spec (prompts and generation settings), the target and its
    revision, its tokenizer (size, chat template, a probe text's ids), its stop tokens, data.max_length (which
    caps the answers)."""
    from dflash_stream.regenerate.client import PROBE_TEXT

    target = cfg.target
    template = getattr(tokenizer, "chat_template", None) or ""
    return {
        "data_spec": data_spec_digest(cfg),
        "target": f"{target.model}{'/' + target.gguf_file if target.gguf_file else ''}",
        "revision": target.revision or "default",
        "tokenizer": hashlib.sha256(json.dumps([len(tokenizer), template, tokenizer.encode(PROBE_TEXT)],
                                               ensure_ascii=False).encode()).hexdigest()[:16],
        "stop_ids": sorted(stop_ids),
        "max_length": cfg.data.max_length,
    }


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def regenerate_part() -> str:
    """The part `dflash-stream regenerate` writes: its own, so that two of them (or one beside a run) never share
    a file."""
    return f"regenerate-{socket.gethostname()}-{os.getpid()}"


class ResponseCache:
    def __init__(self, output_dir: str | Path, key: dict[str, Any], part: int | str) -> None:
        self.run = RunDir(output_dir)
        self.run.data.mkdir(parents=True, exist_ok=True)
        self.key = key
        self.digest = key_digest(key)
        self.path = self.run.responses(self.digest, part)
        self._parts: list[Path] = []  # part number -> its .jsonl
        self._indexed: list[int] = []  # bytes of each part's .idx read so far
        self._fds: dict[int, int] = {}
        self._ids = np.empty(0, np.int64)
        self._where = np.empty(0, INDEX)
        self._part_of = np.empty(0, np.int16)
        self._new: dict[int, list[tuple[float, int, int, int]]] = {}  # sample id -> (time, part, offset, length)
        self._bad: set[tuple[int, int]] = set()  # (part, offset) of lines that did not read back
        self._out: tuple[int, int] | None = None  # this process's (data fd, index fd) once it writes
        self._end = 0
        self._synced = 0.0
        # The extractor's server thread adds answers while its forward loop reads them.
        self._lock = threading.RLock()
        self._load()

    # -- reading --------------------------------------------------------------------------------------------

    def _load(self) -> None:
        records, parts = [], []
        for path in sorted(self.run.data.glob(self.run.responses(self.digest, "*").name)):
            number = self._part_number(path)
            found = self._read_index(number, 0)
            found = np.concatenate([found, self._scan_tail(number, found)])
            records.append(found)
            parts.append(np.full(len(found), number, np.int16))
        if records:
            self._merge(np.concatenate(records), np.concatenate(parts))

    def _part_number(self, path: Path) -> int:
        if path in self._parts:
            return self._parts.index(path)
        self._parts.append(path)
        self._indexed.append(0)
        return len(self._parts) - 1

    def _index_path(self, number: int) -> Path:
        part = self._parts[number].name.removeprefix(f"responses-{self.digest}-").removesuffix(".jsonl")
        return self.run.responses_index(self.digest, part)

    def _read_index(self, number: int, start: int) -> np.ndarray:
        """The whole records of part `number`'s .idx from byte `start` whose lines are on disk (a power cut may
        keep an index record and lose its line)."""
        path = self._parts[number]
        try:
            with open(self._index_path(number), "rb") as f:
                f.seek(start)
                raw = f.read()
            size = path.stat().st_size
        except FileNotFoundError:
            return np.empty(0, INDEX)
        found = np.frombuffer(raw[: len(raw) - len(raw) % INDEX.itemsize], INDEX)
        # Up to the first record whose line is not (yet) seen on disk; a later look takes the rest.
        beyond = np.flatnonzero(found["offset"] + found["length"] > size)
        found = found[: beyond[0]] if len(beyond) else found
        self._indexed[number] = start + len(found) * INDEX.itemsize
        return found

    def _scan_tail(self, number: int, indexed: np.ndarray) -> np.ndarray:
        """Records of the whole lines past the last indexed one (a writer killed between a line and its index
        record); a torn last line is left out, and asked for again."""
        path = self._parts[number]
        start = int((indexed["offset"] + indexed["length"]).max()) if len(indexed) else 0
        with open(path, "rb") as f:
            f.seek(start)
            tail = f.read()
        found, offset = [], start
        for line in tail.split(b"\n")[:-1]:
            try:
                record = json.loads(line)
                found.append((int(record["sample_id"]), offset, len(line) + 1, float(record.get("t", 0.0))))
            except (ValueError, KeyError, TypeError):
                pass  # a line torn by a crash (the next writer starts a line of its own after it)
            offset += len(line) + 1
        return np.array(found, INDEX)

    def _merge(self, records: np.ndarray, parts: np.ndarray) -> None:
        """Fold `records` into the arrays, sorted by sample id, then time (the first answer first)."""
        ids = np.concatenate([self._ids, records["sample_id"]])
        where = np.concatenate([self._where, records])
        part_of = np.concatenate([self._part_of, parts])
        order = np.lexsort((where["time"], ids))
        self._ids, self._where, self._part_of = ids[order], where[order], part_of[order]

    def _fold(self) -> None:
        with self._lock:
            self._fold_locked()

    def _fold_locked(self) -> None:
        if not self._new:
            return
        rows = [(sid, offset, length, t, part) for sid, entries in self._new.items()
                for t, part, offset, length in entries]
        self._new = {}
        records = np.array([r[:4] for r in rows], INDEX)
        self._merge(records, np.array([r[4] for r in rows], np.int16))

    def refresh(self) -> None:
        """Learn the answers other writers appended since (new parts included): before an answer is used, so that
        a sample answered twice is trained on its first answer."""
        paths = sorted(self.run.data.glob(self.run.responses(self.digest, "*").name))
        with self._lock:
            for path in paths:
                number = self._part_number(path)
                if self._out is not None and path == self.path:
                    continue  # this process's own answers are known as written
                for sid, offset, length, t in self._read_index(number, self._indexed[number]).tolist():
                    self._learn(sid, t, number, offset, length)
            if len(self._new) >= FOLD_AT:
                self._fold_locked()

    def _learn(self, sample_id: int, t: float, part: int, offset: int, length: int) -> None:
        self._new.setdefault(sample_id, []).append((t, part, offset, length))

    def _candidates(self, sample_id: int) -> list[tuple[float, int, int, int]]:
        """(time, part, offset, length) of every answer of `sample_id`, first written first."""
        with self._lock:
            lo, hi = np.searchsorted(self._ids, [sample_id, sample_id + 1])
            found = [(float(w["time"]), int(p), int(w["offset"]), int(w["length"]))
                     for w, p in zip(self._where[lo:hi], self._part_of[lo:hi], strict=True)]
            return sorted(found + self._new.get(sample_id, []))

    def record(self, sample_id: int) -> dict[str, Any] | None:
        """The first answer of `sample_id` that reads back whole (its JSON record), or None."""
        for _, part, offset, length in self._candidates(sample_id):
            if (part, offset) in self._bad:
                continue
            try:
                record = json.loads(os.pread(self._fd(part), length, offset))
                if int(record["sample_id"]) == sample_id:
                    return record
            except (OSError, ValueError, KeyError, TypeError):
                pass
            log.warning("response cache: the answer of sample %d at byte %d of %s does not read back; another "
                        "answer of it is taken, or it is asked for again", sample_id, offset, self._parts[part])
            self._bad.add((part, offset))
        return None

    def get(self, sample_id: int) -> list[int] | None:
        record = self.record(sample_id)
        return None if record is None else record["tokens"]

    def __contains__(self, sample_id: int) -> bool:
        return bool(self._candidates(sample_id))

    def __len__(self) -> int:
        self._fold()
        return int(len(np.unique(self._ids)))

    def _fd(self, part: int) -> int:
        with self._lock:
            if part not in self._fds:
                self._fds[part] = os.open(self._parts[part], os.O_RDONLY)
            return self._fds[part]

    # -- writing --------------------------------------------------------------------------------------------

    def add(self, responses: dict[int, list[int]], finish: dict[int, str] | None = None, sync: bool = True) -> None:
        """Append answers; `sync` forces them to disk now, otherwise at most SYNC_EVERY_S later."""
        with self._lock:
            data_fd, index_fd = self._open()
            number = self._part_number(self.path)
            for sample_id, tokens in responses.items():
                now = time.time()
                record = {"sample_id": int(sample_id), "tokens": [int(t) for t in tokens], "t": now}
                if finish and sample_id in finish:
                    record["finish"] = finish[sample_id]
                line = (json.dumps(record) + "\n").encode()
                _write_all(data_fd, line)  # one record, one write: a line is never split between writers
                _write_all(index_fd, np.array([(sample_id, self._end, len(line), now)], INDEX).tobytes())
                self._learn(int(sample_id), now, number, self._end, len(line))
                self._end += len(line)
            if len(self._new) >= FOLD_AT:
                self._fold_locked()
        if sync or time.monotonic() - self._synced > SYNC_EVERY_S:
            self.sync()

    def sync(self) -> None:
        with self._lock:
            if self._out is not None:
                for fd in self._out:
                    os.fsync(fd)
                self._synced = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self._out is not None:
                self.sync()
                for fd in self._out:
                    os.close(fd)
                self._out = None
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}

    def _open(self) -> tuple[int, int]:
        """This part's files for appending: a torn last line is ended, the index completed with the lines it
        lacks (read at load), a torn index record cut; and the key's description written once."""
        if self._out is not None:
            return self._out
        manifest = self.run.responses_key(self.digest)
        if not manifest.exists():
            write_atomic(manifest, json.dumps(self.key, indent=2) + "\n")
        number = self._part_number(self.path)
        data_fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        index_path = self._index_path(number)
        index_fd = os.open(index_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(data_fd).st_size
        if size and os.pread(self._fd(number), 1, size - 1) != b"\n":
            _write_all(data_fd, b"\n")  # the next record starts on a line of its own
            size += 1
        indexed = os.fstat(index_fd).st_size
        os.ftruncate(index_fd, indexed - indexed % INDEX.itemsize)
        on_file = np.frombuffer(index_path.read_bytes(), INDEX)
        missing = (self._part_of == number) & ~np.isin(self._where["offset"], on_file["offset"])
        if missing.any():  # lines read from the tail at load, in file order
            tail = np.sort(self._where[missing], order="offset")
            _write_all(index_fd, tail.tobytes())
        self._end = size
        self._out = (data_fd, index_fd)
        return self._out


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def describe_other_caches(output_dir: str | Path, key: dict[str, Any]) -> str | None:
    """One line when OUTPUT/data holds answers under another key (another target, tokenizer, stop tokens or
    data.max_length; or written before the key held them): they are not reused. None when there are none."""
    run = RunDir(output_dir)
    ours = key_digest(key)
    others: dict[str, int] = {}
    for path in run.data.glob("responses-*-*.jsonl"):
        digest = path.name.removeprefix("responses-").split("-", 1)[0]
        if digest != ours:
            others[digest] = others.get(digest, 0) + path.stat().st_size
    if not others:
        return None
    why = []
    for digest in sorted(others):
        try:
            theirs = json.loads(run.responses_key(digest).read_text())
        except (OSError, ValueError):
            why.append(f"{digest} (written before the cache key held the target)")
            continue
        differ = [f"{k} {theirs.get(k)!r} there, {key[k]!r} here" for k in key if theirs.get(k) != key[k]]
        why.append(f"{digest} ({'; '.join(differ) or 'another key'})")
    return (f"the response cache in {run.data} holds answers this run does not take, as they may differ from "
            f"this target's: {', '.join(why)}; the answers this run lacks are asked for anew (delete those files to "
            f"free their {sum(others.values()):,} bytes)")
