"""The store across processes: budget under concurrency measured from outside, exactly-once delivery, kill -9."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
from test_store import MAX_RAW, make_samples, open_store

from dflash_stream.store import SegmentReader, Store
from dflash_stream.store.budget import du

pytestmark = pytest.mark.slow
# Each child a fresh process (no thread or lock of pytest's), forked from a server that imported what this module
# imports once: a spawned child's imports cost a second or two, and these tests start dozens. Not this module by
# name: Python 3.11's forkserver ignores the sys.path it is sent, so a test module is not importable there.
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["pytest", "torch", "dflash_stream.store"])


def writer_proc(path: str, budget: int, reuse: int, writer_id: str, ids: list[int], seed: int) -> None:
    store = open_store(Path(path), budget=budget, reuse=reuse)
    w = store.writer(writer_id)
    rng = random.Random(seed)
    while ids:
        take = ids[: rng.randint(1, 4)]
        ids = ids[len(take):]
        # Random segment sizes, within the store's largest segment (MAX_RAW: 256 tokens).
        w.write(make_samples(take, [rng.randint(8, 64) for _ in take], seed=take[0]))
    w.finish()
    Path(path, f"../{writer_id}.waited").write_text(str(w.waited_seconds))


def consumer_proc(path: str, budget: int, reuse: int, consumer_id: str, out: str) -> None:
    store = open_store(Path(path), budget=budget, reuse=reuse)
    consumer = store.consumer(consumer_id)
    reader = SegmentReader(consumer, prefetch=1)
    with open(out, "w") as f:
        for claim, samples in reader:
            for s in samples:
                f.write(f"{s.sample_id} {claim.epoch}\n")
            f.flush()
            time.sleep(random.uniform(0, 0.02))  # a trainer step
            consumer.release([claim])


def sample_du(path: Path, stop: threading.Event, peaks: list[int]) -> None:
    while not stop.is_set():
        peaks.append(du(path))
        time.sleep(0.002)


def test_budget_and_exactly_once_with_many_processes(tmp_path):
    path, reuse = tmp_path / "s", 2
    with pytest.raises(Exception, match="smallest workable budget is") as err:
        open_store(path, budget=1)
    # Room for a few segments only, so writers wait on the consumers again and again.
    budget = int(str(err.value).rsplit("is ", 1)[1].split()[0].replace(",", "")) + 3 * MAX_RAW
    store = open_store(path, budget=budget, reuse=reuse)
    store.set_expected_writers(3)
    ids = [list(range(w, 90, 3)) for w in range(3)]
    stop, peaks = threading.Event(), []
    sampler = threading.Thread(target=sample_du, args=(path, stop, peaks))
    sampler.start()
    procs = [CTX.Process(target=writer_proc, args=(str(path), budget, reuse, f"w{i}", ids[i], i)) for i in range(3)]
    outs = [tmp_path / f"c{i}.txt" for i in range(2)]
    procs += [CTX.Process(target=consumer_proc, args=(str(path), budget, reuse, f"c{i}", str(outs[i]))) for i in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
    finally:
        stop.set()
        sampler.join()
        for p in procs:
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0] * 5
    waited = sum(float((tmp_path / f"w{i}.waited").read_text()) for i in range(3))
    assert waited > 0, "no writer ever waited: the test did not exercise backpressure"
    assert len(peaks) > 50 and max(peaks) <= budget, f"du peaked at {max(peaks):,} over a budget of {budget:,}"
    delivered = sorted(tuple(map(int, line.split())) for o in outs for line in o.read_text().splitlines())
    assert delivered == sorted((i, e) for i in range(90) for e in range(reuse))
    assert store.stored_sample_ids() == {0: set(range(90))}
    assert store.status()["segments"] == {"ready": 0, "claimed": 0, "writing": 0, "released": len(store.published())}
    # Two consumers folded every record into their ledgers: nothing is left in info/ or done/.
    assert not os.listdir(path / "info") and not os.listdir(path / "done")


def endless_writer(path: str) -> None:
    store = open_store(Path(path))
    w = store.writer("w")
    first = len(store.stored_sample_ids().get(0, ()))
    for i in range(first, 10_000):
        w.write(make_samples([i], [250], seed=i))


def claim_and_hang(path: str, ready) -> None:
    store = open_store(Path(path))
    c = store.consumer("c")
    c.claim(timeout=10)
    ready.set()
    time.sleep(60)


def test_kill_9_writer_mid_write_and_consumer_after_claim(tmp_path):
    path = tmp_path / "s"
    open_store(path)
    for _ in range(3):  # until the kill lands while a segment sits half-written in the writer's tmp dir
        writer = CTX.Process(target=endless_writer, args=(str(path),))
        writer.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(os.listdir(path / "segments")) >= 3 and os.listdir(path / "tmp" / "w"):
                os.kill(writer.pid, signal.SIGKILL)
                break
            time.sleep(0.0005)
        writer.join()
        assert writer.exitcode == -signal.SIGKILL
        if os.listdir(path / "tmp" / "w"):
            break
    assert os.listdir(path / "tmp" / "w"), "never caught the writer mid-write"
    published = {s: Store.attach(path)._record(s).sample_ids for s in os.listdir(path / "segments")}

    ready = CTX.Event()
    consumer = CTX.Process(target=claim_and_hang, args=(str(path), ready))
    consumer.start()
    assert ready.wait(60)
    os.kill(consumer.pid, signal.SIGKILL)
    consumer.join()
    assert len(os.listdir(path / "claimed" / "c")) == 1

    store = open_store(path)
    report = store.recover()
    assert report["claims_returned"] == 1 and report["partial_writes"] == 1
    assert list((path / "tmp").glob("*/*")) == [] and os.listdir(path / "budget" / "reserved") == []
    status = store.status()
    assert status["segments"]["ready"] == len(published) and status["used_bytes"] >= du(path)
    store.set_expected_writers(0)
    c = store.consumer("c2")
    got = {}
    while (claim := c.claim(timeout=5)) is not None:
        got[claim.segment_id] = tuple(s.sample_id for s in c.read(claim))
        c.release([claim])
    # Nothing published is lost; nothing unpublished appears.
    assert got == published
    assert store.stored_sample_ids()[0] == {i for ids in published.values() for i in ids}
