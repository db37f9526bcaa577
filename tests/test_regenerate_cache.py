"""The response cache: every part read back, a line torn by a kill skipped and the next answer kept whole."""

from __future__ import annotations

from dflash_stream.regenerate.cache import ResponseCache
from dflash_stream.rundir import RunDir


def test_parts_are_read_together_and_a_torn_line_costs_one_answer(tmp_path):
    first = ResponseCache(tmp_path, "d1", 0)
    first.add({1: [5, 6, 2], 2: [7]}, {1: "stop", 2: "length"})
    first.close()
    served = ResponseCache(tmp_path, "d1", "regenerate")
    served.add({3: [8, 2]}, sync=False)
    served.close()
    # A kill in the middle of a write leaves half a line at the end of the file.
    with RunDir(tmp_path).responses("d1", "regenerate").open("a") as f:
        f.write('{"sample_id": 4, "tok')
    again = ResponseCache(tmp_path, "d1", "regenerate")  # any part sees every part's answers
    assert {i: again.get(i) for i in (1, 2, 3, 4)} == {1: [5, 6, 2], 2: [7], 3: [8, 2], 4: None}
    assert again.finish == {1: "stop", 2: "length"} and len(again) == 3 and 3 in again
    again.add({4: [9, 2]})
    again.close()
    assert ResponseCache(tmp_path, "d1", 0).get(4) == [9, 2]
    assert ResponseCache(tmp_path, "d2", 0).get(1) is None  # another data spec: another cache
