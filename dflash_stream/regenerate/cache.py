"""The response cache: the target's answers, appended to OUTPUT/data/responses-<data digest>-<part>.jsonl as they
come, so a restart, a later extraction pass or another engine never asks for an answer twice (and, when sampling,
gets the answer the first pass trained on). A part is an extractor's shard, or `regenerate` for the phase run on
its own; every part is read, so the process count may change between runs."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO

from dflash_stream.rundir import RunDir

SYNC_EVERY_S = 1.0
"""How often answers appended one by one reach the disk (a killed process loses nothing already written; this
bounds what a power cut loses)."""


class ResponseCache:
    def __init__(self, output_dir: str | Path, digest: str, part: int | str) -> None:
        run = RunDir(output_dir)
        run.data.mkdir(parents=True, exist_ok=True)
        self.path = run.responses(digest, part)
        self.responses: dict[int, list[int]] = {}
        self.finish: dict[int, str] = {}
        for path in sorted(run.data.glob(run.responses(digest, "*").name)):
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                    sample_id, tokens = int(record["sample_id"]), record["tokens"]
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue  # a line torn by a crash: that answer is asked for again
                self.responses[sample_id] = tokens
                if "finish" in record:
                    self.finish[sample_id] = record["finish"]
        self._file: IO[str] | None = None
        self._synced = 0.0

    def __len__(self) -> int:
        return len(self.responses)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self.responses

    def get(self, sample_id: int) -> list[int] | None:
        return self.responses.get(sample_id)

    def add(self, responses: dict[int, list[int]], finish: dict[int, str] | None = None, sync: bool = True) -> None:
        """Append answers; `sync` forces them to disk now, otherwise at most SYNC_EVERY_S later."""
        f = self._open()
        for sample_id, tokens in responses.items():
            record = {"sample_id": sample_id, "tokens": tokens}
            if finish and sample_id in finish:
                record["finish"] = finish[sample_id]
                self.finish[sample_id] = finish[sample_id]
            f.write(json.dumps(record) + "\n")
        f.flush()
        if sync or time.monotonic() - self._synced > SYNC_EVERY_S:
            self.sync()
        self.responses.update(responses)

    def sync(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._synced = time.monotonic()

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            self._file.close()
            self._file = None

    def _open(self) -> IO[str]:
        if self._file is None:
            torn = False
            if self.path.exists() and self.path.stat().st_size > 0:
                with self.path.open("rb") as f:
                    f.seek(-1, os.SEEK_END)
                    torn = f.read(1) != b"\n"
            self._file = self.path.open("a")
            if torn:  # the next record starts on a line of its own
                self._file.write("\n")
        return self._file
