"""Records of released segments folded into ledgers: info/ and done/ stay as small as the live store, every
reader gives the answers it gave when they accumulated, and a kill at any step of a release (or of the
recovery that finishes it) leaves a store that counts each segment once."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
from test_store import FP, make_samples, open_store

from dflash_stream.store import FingerprintMismatch, SegmentInfo, Store, lease, ledger
from dflash_stream.store import store as store_module
from dflash_stream.store.budget import du

# Each child a fresh process (no thread or lock of pytest's), forked from a server that imported what this module
# imports once: a spawned child's imports cost a second or two, and these tests start dozens. Not this module by
# name: Python 3.11's forkserver ignores the sys.path it is sent, so a test module is not importable there.
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["pytest", "torch", "dflash_stream.store"])


class Killed(BaseException):
    """Stands for a kill -9: nothing of the store catches it, so it leaves the files as they are."""


def entries(store: Store, *dirs: str) -> dict[str, int]:
    return {d: len(os.listdir(store.path / d)) for d in dirs}


def ledger_lines(store: Store) -> list[dict]:
    """Every line of every ledger; each must parse (a torn line would be cut before the next append)."""
    return [json.loads(line) for p in sorted((store.path / "released").iterdir())
            for line in p.read_text().splitlines()]


def fill(store: Store, n: int, writer: str = "w") -> list[SegmentInfo]:
    w = store.writer(writer)
    return [w.write(make_samples([2 * i, 2 * i + 1], [3, 5], seed=i)) for i in range(n)]


def test_released_records_fold_and_the_directories_stay_as_small_as_the_live_store(tmp_path):
    store = open_store(tmp_path / "s", reuse=2)
    w = store.writer("w")
    c = store.consumer("c")
    written, largest = [], {"info": 0, "done": 0}
    for i in range(80):
        written.append(w.write(make_samples([i], [4], seed=i)))
        if i >= 3:  # a few segments stay live
            for _ in range(2):
                c.release([c.claim(timeout=1)])
        for d, n in entries(store, "info", "done").items():
            largest[d] = max(largest[d], n)
    assert largest["info"] <= 8 and largest["done"] == 0  # as many as live segments, not 80
    live = len(os.listdir(store.path / "segments"))
    assert entries(store, "info", "done", "released") == {"info": live, "done": 0, "released": 1}
    # Far smaller than a record file of one block each.
    assert (store.path / "released" / "consumer-c.jsonl").stat().st_size < (80 - live) * 200
    assert sorted(r["segment_id"] for r in ledger_lines(store)) == sorted(
        set(i.segment_id for i in written) - set(os.listdir(store.path / "segments")))
    reopened = Store.attach(store.path)
    assert reopened.published() == written
    assert reopened.stored_sample_ids() == {0: set(range(80))}
    segments = reopened.status()["segments"]
    assert segments["released"] == 80 - live and segments["ready"] + segments["claimed"] >= live
    w.finish()
    store.set_expected_writers(1)
    while (claim := c.claim(timeout=1)) is not None:
        c.release([claim])
    assert entries(store, "info", "done", "segments", "released") == {"info": 0, "done": 0, "segments": 0,
                                                                      "released": 1}
    assert reopened.published() == written and reopened.status()["segments"]["released"] == 80
    assert reopened.status()["used_bytes"] >= du(store.path)


def test_a_resume_after_folding_gives_the_same_records_and_continues_the_segment_ids(tmp_path):
    store = open_store(tmp_path / "s")
    written = fill(store, 6)
    w = store.writer("w")  # a restart of the writer, between the segments
    written.append(w.write(make_samples([100], [4]), pass_index=1, first_use=1, replaces="w.000002.0"))
    unfolded = Store.attach(store.path).published()
    c = store.consumer("c")
    for _ in range(5):
        c.release([c.claim(timeout=1)])
    assert entries(store, "info", "segments") == {"info": 2, "segments": 2}
    resumed = open_store(tmp_path / "s")
    assert resumed.published() == unfolded == written  # replaces and first_use survive the fold too
    assert resumed.stored_sample_ids() == {0: set(range(12)), 1: {100}}
    # The next segment id follows the released ones: a writer restarted with only folded segments behind it
    # must not publish w.000000 again.
    c.release([c.claim(timeout=1), c.claim(timeout=1)])
    assert not os.listdir(store.path / "info")
    assert resumed.writer("w").write(make_samples([200], [4])).segment_id == "w.000007"
    with pytest.raises(Exception, match="sample 3 was consumed and its segment deleted"):
        resumed._find_sample(3)


def _kill_after_done_rename(monkeypatch):
    def killed(path, *args, **kwargs):
        raise Killed
    monkeypatch.setattr(store_module.shutil, "rmtree", killed)


def _kill_before_append(monkeypatch):
    monkeypatch.setattr(store_module.SegmentConsumer, "_fold", lambda self, seg, marker: (_ for _ in ()).throw(Killed))


def _kill_mid_append(monkeypatch):
    real = os.pwrite

    def torn(fd, data, offset):
        real(fd, bytes(data[: len(data) // 2]), offset)  # half the line(s) reach the file
        raise Killed
    monkeypatch.setattr(ledger.os, "pwrite", torn)


def _kill_after_append(monkeypatch):
    monkeypatch.setattr(Store, "_forget_released", lambda self, seg, marker: (_ for _ in ()).throw(Killed))


def _kill_between_the_unlinks(monkeypatch):
    def forget(self, seg, marker):
        (self.path / "info" / f"{seg}.json").unlink()
        raise Killed
    monkeypatch.setattr(Store, "_forget_released", forget)


KILLS = {"after the move to done/": _kill_after_done_rename, "before the append": _kill_before_append,
         "mid-append (torn line)": _kill_mid_append, "after the append": _kill_after_append,
         "between the unlinks": _kill_between_the_unlinks}


@pytest.mark.parametrize("kill", KILLS)
def test_a_kill_at_any_step_of_a_release_counts_the_segment_once_and_recovery_folds_it(tmp_path, monkeypatch,
                                                                                      kill):
    store = open_store(tmp_path / "s")
    written = fill(store, 5)
    c = store.consumer("c")
    for _ in range(2):
        c.release([c.claim(timeout=1)])
    claim = c.claim(timeout=1)
    with monkeypatch.context() as m:
        KILLS[kill](m)
        with pytest.raises(Killed):
            c.release([claim])
    # Seen from any process meanwhile: the killed release counts, once.
    seen = Store.attach(store.path)
    assert seen.published() == written and seen.stored_sample_ids() == {0: set(range(10))}
    assert seen.status()["segments"]["released"] == 3 and seen.status()["segments"]["ready"] == 2
    torn = (store.path / "released" / "consumer-c.jsonl").read_bytes()
    assert torn.endswith(b"\n") == (kill != "mid-append (torn line)")
    # The same consumer, restarted before any recovery, cuts the torn line and folds on.
    c = open_store(tmp_path / "s").consumer("c")
    c.release([c.claim(timeout=1)])
    assert len(ledger_lines(store)) == 3 + (kill in ("after the append", "between the unlinks"))
    report = open_store(tmp_path / "s").recover()
    assert report["records_folded"] == (kill in ("after the move to done/", "before the append", "mid-append (torn line)"))
    assert report["deletions_finished"] == (kill == "after the move to done/")
    assert entries(store, "done", "info", "segments") == {"done": 0, "info": 1, "segments": 1}
    assert sorted({r["segment_id"] for r in ledger_lines(store)}) == [i.segment_id for i in written[:4]]
    after = Store.attach(store.path)
    assert after.published() == written and after.status()["segments"]["released"] == 4
    assert open_store(tmp_path / "s").recover()["records_folded"] == 0


def test_a_kill_mid_recovery_leaves_a_store_the_next_recovery_finishes(tmp_path, monkeypatch):
    """A store of the layout before the ledgers (a record and a marker kept per released segment) is folded by
    its first recovery; that recovery killed mid-append, the next one folds it again, each record once."""
    store = open_store(tmp_path / "s")
    written = fill(store, 6)
    c = store.consumer("c")
    with monkeypatch.context() as m:
        m.setattr(store_module.SegmentConsumer, "_fold", lambda self, seg, marker: None)  # the old release
        for _ in range(5):
            c.release([c.claim(timeout=1)])
    assert entries(store, "info", "done") == {"info": 6, "done": 5}
    with monkeypatch.context() as m:
        _kill_mid_append(m)
        with pytest.raises(Killed):
            open_store(tmp_path / "s").recover()
    assert Store.attach(store.path).published() == written
    whole = (store.path / "released" / "recovery.jsonl").read_bytes().count(b"\n")
    assert 0 < whole < 5  # the killed recovery appended some lines whole, then one torn
    report = open_store(tmp_path / "s").recover()
    assert report["records_folded"] == 5 - whole and entries(store, "info", "done") == {"info": 1, "done": 0}
    assert [r["segment_id"] for r in ledger_lines(store)] == [i.segment_id for i in written[:5]]
    assert Store.attach(store.path).published() == written


def test_a_full_disk_while_folding_leaves_the_record_in_info_and_the_release_done(tmp_path, monkeypatch, caplog):
    store = open_store(tmp_path / "s")
    written = fill(store, 3)
    c = store.consumer("c")
    real_pwrite = os.pwrite

    def partial_then_full(fd, data, offset):
        real_pwrite(fd, bytes(data[:7]), offset)  # a few bytes landed before the disk filled
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with monkeypatch.context() as m:
        m.setattr(ledger.os, "pwrite", partial_then_full)
        c.release([c.claim(timeout=1)])
    assert "could not fold the record of released segment w.000000" in caplog.text
    assert entries(store, "info", "done") == {"info": 3, "done": 1}
    c.release([c.claim(timeout=1)])  # the next fold cuts the partial line first
    assert [r["segment_id"] for r in ledger_lines(store)] == ["w.000001"]
    assert Store.attach(store.path).published() == written
    assert open_store(tmp_path / "s").recover()["records_folded"] == 1
    assert entries(store, "info", "done") == {"info": 1, "done": 0}


def release_forever(path: str) -> None:
    store = open_store(Path(path))
    c = store.consumer("c")
    while (claim := c.claim(timeout=1)) is not None:
        c.release([claim])


@pytest.mark.slow
def test_kill_9_of_a_consumer_mid_release_again_and_again(tmp_path):
    path = tmp_path / "s"
    store = open_store(path)
    written = fill(store, 200)
    store.writer("w").finish()
    store.set_expected_writers(1)
    rng = random.Random(0)
    kills = 0
    while os.listdir(path / "ready") and kills < 12:
        proc = CTX.Process(target=release_forever, args=(str(path),))
        proc.start()
        deadline = time.monotonic() + 60
        # Wait until it releases, then kill it at a random instant.
        while len(os.listdir(path / "info")) > 195 - 15 * kills and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.05))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        kills += 1
        # Between kills, without recovery: every reader counts each segment once.
        seen = Store.attach(path)
        assert seen.published() == written and seen.stored_sample_ids() == {0: set(range(400))}
    assert kills >= 5
    open_store(path).recover()
    release_forever(str(path))
    report = open_store(path).recover()
    assert report["records_folded"] == 0
    assert entries(store, "info", "done", "segments", "ready") == {"info": 0, "done": 0, "segments": 0, "ready": 0}
    lines = ledger_lines(store)
    assert sorted({r["segment_id"] for r in lines}) == [i.segment_id for i in written]
    after = Store.attach(path)
    assert after.published() == written and after.status()["segments"]["released"] == 200


def test_a_store_whose_segments_were_all_released_still_refuses_another_config(tmp_path):
    """Only the ledgers remember what it holds: it is not an empty store that takes any config."""
    store = open_store(tmp_path / "s")
    fill(store, 3)
    c = store.consumer("c")
    for _ in range(3):
        c.release([c.claim(timeout=1)])
    assert entries(store, "info", "segments", "done") == {"info": 0, "segments": 0, "done": 0}
    with pytest.raises(FingerprintMismatch, match=r"maximum lengths .* \(3 segment\(s\) published in it\)"):
        open_store(tmp_path / "s", fingerprint={**FP, "max_length": 512})


def test_two_objects_of_one_consumer_id_in_one_process_never_cut_each_others_lines(tmp_path):
    """A resuming trainer opens its consumer twice (see DataPosition.load_state_dict): an append cuts only a
    torn tail, never a complete line another object appended."""
    store = open_store(tmp_path / "s")
    written = fill(store, 4)
    first, second = store.consumer("c"), store.consumer("c")
    for c in (first, second, first, second):
        c.release([c.claim(timeout=1)])
    assert [r["segment_id"] for r in ledger_lines(store)] == [i.segment_id for i in written]


def test_a_replacement_of_rolled_back_uses_serves_exactly_them_and_the_original_its_other_uses(tmp_path, monkeypatch):
    """train.release on_use: a crash undid use 0 of a segment already released (its next use READY). The
    replacement asked for (`request_redo`) serves use 0 alone and is then deleted and folded, the original keeps
    serving uses 1 and 2; the request is durable and asked once, routed to the segment's writer, holds the end of
    data back until it is answered, and a kill between publishing the replacement and marking it READY leaves it
    marked redone first (so it is never written twice), READY after recovery."""
    store = open_store(tmp_path / "s", reuse=3)
    w, c = store.writer("w"), store.consumer("c")
    info = w.write(make_samples([1, 2], [3, 5]))
    w.finish()
    store.set_expected_writers(1)
    c.release([c.claim(timeout=1)])  # use 0 trained and released; use 1 READY
    part = {"segment_id": info.segment_id, "pass_index": 0, "first_use": 0, "last_use": 0, "sample_ids": [1, 2]}
    [tag] = store.request_redo([part], "a crash undid it")
    assert store.request_redo([part], "asked again after a second crash") == [tag]
    assert [r["reason"] for r in store.rollbacks()] == ["a crash undid it"]
    assert [t for t, _ in store.redo_requests("w")] == [tag] and store.redo_requests("other") == []
    assert store.redo_waiting()[0]["why"] == "rolled back" and not store.end_of_data

    def killed(self, seg, use=0):
        raise Killed

    monkeypatch.setattr(Store, "_mark_ready", killed)
    with pytest.raises(Killed):
        w.write(make_samples([1, 2], [3, 5]), first_use=0, replaces=tag)
    monkeypatch.undo()
    assert store.rollbacks()[0]["redone"] and not store.redo_pending()  # redone before READY
    lease.release_all()
    store = Store.attach(store.path)
    store.recover()
    c = store.consumer("c")
    replacement = c.claim(timeout=1)  # the lowest epoch first: the replacement's use 0 before the original's use 1
    assert (replacement.use_index, replacement.final_use, replacement.replaces) == (0, 0, tag)
    assert replacement.segment_id != info.segment_id and replacement.sample_ids == (1, 2)
    c.release([replacement])
    assert not (store.path / "segments" / replacement.segment_id).exists()  # its one use done: deleted, folded
    uses = []
    while (claim := c.claim(timeout=1)) is not None:
        uses.append((claim.segment_id, claim.use_index))
        c.release([claim])
    assert uses == [(info.segment_id, 1), (info.segment_id, 2)]
    assert store.drained() and not os.listdir(store.path / "segments")
    assert [i.segment_id for i in store.published()] == [info.segment_id, replacement.segment_id]
    assert store.published()[1].last_use == 0 and store.stored_sample_ids() == {0: {1, 2}}
