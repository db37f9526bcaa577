"""The response cache: every part read back, a line torn by a kill skipped and the next answer kept whole; keyed by
what decides an answer (another target or length is another cache, and a line says why); an index in memory, not
the answers; and a sample answered twice keeps its first answer."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np

from dflash_stream.regenerate.cache import (
    INDEX,
    INDEX_BYTES_PER_ANSWER,
    ResponseCache,
    describe_other_caches,
    key_digest,
)
from dflash_stream.rundir import RunDir

KEY = {"data_spec": "d1", "target": "/models/a", "revision": "default", "tokenizer": "t1", "stop_ids": [2],
       "max_length": 160}


def test_parts_are_read_together_and_a_torn_line_costs_one_answer(tmp_path):
    first = ResponseCache(tmp_path, KEY, 0)
    first.add({1: [5, 6, 2], 2: [7]}, {1: "stop", 2: "length"})
    first.close()
    served = ResponseCache(tmp_path, KEY, "regenerate-h-1")
    served.add({3: [8, 2]}, sync=False)
    served.close()
    # A kill in the middle of a write leaves half a line at the end of the file, and no index record for it.
    with RunDir(tmp_path).responses(key_digest(KEY), "regenerate-h-1").open("a") as f:
        f.write('{"sample_id": 4, "tok')
    again = ResponseCache(tmp_path, KEY, "regenerate-h-1")  # any part sees every part's answers
    assert {i: again.get(i) for i in (1, 2, 3, 4)} == {1: [5, 6, 2], 2: [7], 3: [8, 2], 4: None}
    assert again.record(1)["finish"] == "stop" and again.record(2)["finish"] == "length"
    assert len(again) == 3 and 3 in again and 4 not in again
    again.add({4: [9, 2]})
    again.close()
    assert ResponseCache(tmp_path, KEY, 0).get(4) == [9, 2]
    # A writer killed between a line and its index record: the line is found at the next load.
    path = RunDir(tmp_path).responses(key_digest(KEY), 0)
    with path.open("a") as f:
        f.write(json.dumps({"sample_id": 6, "tokens": [1, 2], "t": 1.0}) + "\n")
    assert ResponseCache(tmp_path, KEY, 5).get(6) == [1, 2]


def test_answers_of_another_target_or_length_are_not_taken_and_a_line_says_why(tmp_path):
    """Case 3: the key holds the target, its tokenizer and stop tokens and data.max_length; answers under
    another key are not taken (they are asked for anew), and one line names what differs; a cache written
    before the key held the target is named as such."""
    old = ResponseCache(tmp_path, KEY, 0)
    old.add({1: [5, 6, 2]})
    old.close()
    for change in ({"target": "/models/b"}, {"max_length": 512}, {"stop_ids": [2, 7]}, {"tokenizer": "t2"}):
        other = {**KEY, **change}
        assert ResponseCache(tmp_path, other, 0).get(1) is None
        line = describe_other_caches(tmp_path, other)
        (field, value), = change.items()
        assert line and f"{field} {KEY[field]!r} there, {value!r} here" in line, line
    assert describe_other_caches(tmp_path, KEY) is None
    # A cache of the data spec digest alone (before this key): not read, and said so.
    (RunDir(tmp_path).data / "responses-0123456789abcdef-0.jsonl").write_text('{"sample_id": 1, "tokens": [9]}\n')
    assert "0123456789abcdef (written before the cache key held the target)" in describe_other_caches(tmp_path, KEY)
    assert ResponseCache(tmp_path, KEY, 0).get(1) == [5, 6, 2]


def test_the_cache_holds_an_index_in_memory_not_the_answers(tmp_path):
    """Case 5: 2,000 answers of 1,000 tokens (~12 MB of JSON; ~37 bytes a token as Python lists): loaded, the
    cache keeps its index arrays (a record, a search key and a part number per answer: the steady part of
    INDEX_BYTES_PER_ANSWER), and still reads each answer back."""
    rng = np.random.default_rng(0)
    answers = {i: rng.integers(30_000, 49_000, 1000).tolist() for i in range(2000)}
    writer = ResponseCache(tmp_path, KEY, 0)
    for first in range(0, 2000, 100):
        writer.add({i: answers[i] for i in range(first, first + 100)}, sync=False)
    writer.close()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = ResponseCache(tmp_path, KEY, 1)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 2000 * (INDEX.itemsize + 8 + 2) + 64 * 1024 < 2000 * INDEX_BYTES_PER_ANSWER + 64 * 1024, held
    assert len(cache) == 2000 and cache.get(1234) == answers[1234]


def test_the_host_memory_plan_counts_the_answers_index():
    from dflash_stream.config import config_from_dict
    from dflash_stream.sizing.host_memory import host_memory

    cfg = config_from_dict({"output_dir": "out", "target": {"model": "x"}, "store": {"path": "store", "budget": "1GB"},
                            "data": {"sources": [{"path": "x.jsonl"}], "regenerate": True}})
    plan = host_memory(cfg, 5 * 5120, 1.5, answers=900_000)
    assert plan["extractor"]["parts"]["answers_index"] == 900_000 * INDEX_BYTES_PER_ANSWER
    cfg.data.regenerate = False
    assert "answers_index" not in host_memory(cfg, 5 * 5120, 1.5, answers=900_000)["extractor"]["parts"]


def test_a_sample_answered_twice_keeps_its_first_answer(tmp_path):
    """Case 10: `regenerate` beside `run` answers sample 9 too, before the extractor's own answer comes: the
    extractor looks again before it uses an answer and takes the first, and so does every later load, whatever
    the parts' names sort as."""
    extractor = ResponseCache(tmp_path, KEY, 0)  # loaded before the other writer answered
    beside = ResponseCache(tmp_path, KEY, "regenerate-h-7")
    beside.add({9: [11, 12, 2]})
    extractor.add({9: [21, 22, 2], 10: [5, 2]})
    assert extractor.get(9) == [21, 22, 2]  # not yet seen
    extractor.refresh()
    assert extractor.get(9) == [11, 12, 2]
    extractor.close()
    beside.add({10: [6, 2]})
    beside.close()
    for part in (0, "regenerate-h-7", "zzz"):
        cache = ResponseCache(tmp_path, KEY, part)
        assert (cache.get(9), cache.get(10)) == ([11, 12, 2], [5, 2])
