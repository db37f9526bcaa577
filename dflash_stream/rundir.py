"""The run directory (OUTPUT = cfg.output_dir): where every part of a run writes, and the one atomic write.

Every reader and writer of OUTPUT goes through `RunDir`, so the layout below has one home:

    config.yaml                  the resolved config
    metrics/<role>-<rank>.jsonl  per-rank events
    checkpoints/step-N/          a trainer checkpoint; complete once its COMPLETE marker exists (written last)
    checkpoints/.step-N.tmp/     the same while being written
    ledger/trainer-R/N.jsonl     segment uses trainer rank R trained between the previous checkpoint and step N
    ledger/released-trainer-R.jsonl  segment uses rank R released since its latest checkpoint (train.release on_use)
    data/report-<shard>.json     what the data stage kept and skipped (the audit's expected ids)
    data/responses-<key>-<part>.jsonl   regenerated responses, appended as made (.idx: where each line is;
                                 responses-<key>.json: what the key stands for)
    spool/                       extract.engine vllm: the servers' state files until an extractor packs them
                                 (the default extract.spool)
    tensorboard/<role>-<rank>/   TensorBoard scalars (metrics.tensorboard)
    drafter/                     the final export
    training-over.json           this launch's training is over (its id): the extractors leave
    summary-parts/<role>-<index>.json, summary.json, eval.json, report/*.png

It sits beside config.py at the bottom of the package, so every part (data, store, pipeline, observe, drafter)
can import it without an import pointing up the data flow.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from dflash_stream.diskfull import retry_when_full

COMPLETE = "COMPLETE"
"""The marker a checkpoint folder gets last; without it the folder is an interrupted attempt."""
_STEP = "step-"


class RunDir:
    """Paths of one run's output folder; nothing is created until a writer asks for it."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    # ---------------------------------------------------------------- metrics

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    def metrics_file(self, role: str, rank: int) -> Path:
        return self.metrics / f"{role}-{rank}.jsonl"

    def metrics_files(self) -> list[Path]:
        return sorted(self.metrics.glob("*.jsonl"))

    def tensorboard(self, role: str, rank: int) -> Path:
        return self.root / "tensorboard" / f"{role}-{rank}"

    @property
    def spool(self) -> Path:
        """Where vLLM servers write the states extractors read (extract.engine vllm), unless extract.spool
        names another folder."""
        return self.root / "spool"

    # ---------------------------------------------------------------- checkpoints

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{_STEP}{step}"

    def staging(self, step: int) -> Path:
        """Where checkpoint `step` is written before it is renamed into place."""
        return self.checkpoints / f".{_STEP}{step}.tmp"

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        found = [p for p in self.checkpoints.glob(f"{_STEP}*")
                 if p.name[len(_STEP):].isdigit() and (p / COMPLETE).is_file()]
        return sorted(found, key=checkpoint_step)

    def incomplete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, folder) of interrupted attempts: staging folders, and renamed folders without COMPLETE."""
        found = []
        for path in self.checkpoints.glob(f"*{_STEP}*"):
            step = path.name.removeprefix(".").removeprefix(_STEP).removesuffix(".tmp")
            if step.isdigit() and not (path / COMPLETE).is_file():
                found.append((int(step), path))
        return sorted(found)

    def latest_checkpoint(self) -> Path | None:
        """The highest complete checkpoint: what a trainer resumes from and what the audit counts up to."""
        found = self.complete_checkpoints()
        return found[-1] if found else None

    # ---------------------------------------------------------------- ledger

    def ledger(self, rank: int) -> Path:
        return self.root / "ledger" / f"trainer-{rank}"

    def ledger_file(self, rank: int, step: int) -> Path:
        return self.ledger(rank) / f"{step}.jsonl"

    def release_journal(self, rank: int) -> Path:
        """The segment uses trainer rank `rank` released after its latest checkpoint (train.release on_use): what a
        crash makes it extract again. Beside the ledger folders, not in them (those hold one file per step)."""
        return self.root / "ledger" / f"released-trainer-{rank}.jsonl"

    def ledger_files(self, rank: int | None = None) -> list[tuple[int, Path]]:
        """(step, path) of one trainer rank's ledger files, or of every rank's, in path order."""
        pattern = f"trainer-{'*' if rank is None else rank}/*.jsonl"
        return [(int(p.stem), p) for p in sorted((self.root / "ledger").glob(pattern)) if p.stem.isdigit()]

    # ---------------------------------------------------------------- data stage

    @property
    def data(self) -> Path:
        return self.root / "data"

    def data_report(self, shard: int) -> Path:
        return self.data / f"report-{shard}.json"

    def data_reports(self) -> list[Path]:
        return sorted(self.data.glob("report-*.json"))

    def responses(self, digest: str, part: int | str) -> Path:
        """Regenerated responses under cache key `digest` written by `part` (an extractor's shard, or a
        `regenerate` process; "*": a glob pattern for every part's file)."""
        return self.data / f"responses-{digest}-{part}.jsonl"

    def responses_index(self, digest: str, part: int | str) -> Path:
        """Where each line of `responses(digest, part)` is, and when it was written (fixed-size records)."""
        return self.data / f"responses-{digest}-{part}.idx"

    def responses_key(self, digest: str) -> Path:
        """What cache key `digest` stands for (target, tokenizer, stop tokens, max length, data spec)."""
        return self.data / f"responses-{digest}.json"

    # ---------------------------------------------------------------- results

    @property
    def drafter(self) -> Path:
        return self.root / "drafter"

    @property
    def summary_parts(self) -> Path:
        return self.root / "summary-parts"

    def summary_part(self, role: str, index: int) -> Path:
        return self.summary_parts / f"{role}-{index}.json"

    def summary_part_files(self) -> list[Path]:
        return sorted(self.summary_parts.glob("*.json"))

    @property
    def training_over(self) -> Path:
        """Written by trainer 0 once training is over, naming its launch: the extractors of that launch leave."""
        return self.root / "training-over.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def eval(self) -> Path:
        return self.root / "eval.json"

    @property
    def report(self) -> Path:
        """`dflash-stream report`'s plots."""
        return self.root / "report"


def checkpoint_step(path: Path | None) -> int:
    """The step of checkpoint folder `path` (0 for no checkpoint: training starts at step 0)."""
    return 0 if path is None else int(path.name.removeprefix(_STEP))


def fsync(path: Path) -> None:
    """Flush a file's or a folder's content (a folder: the names in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, text: str, durable: bool = False, wait_when_full: bool = True) -> Path:
    """Write-then-rename, so readers see the old file or the new one, never a torn one. The temporary name
    is unique per process and thread, so concurrent writers of one file cannot interleave. `durable`: also
    fsync the file and its folder, so the new content survives a machine crash once this returns. A full disk
    is waited out, then stops the process in one line (see diskfull.py), unless `wait_when_full` is off."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")

    def write() -> None:
        try:
            tmp.write_text(text)
            if durable:
                fsync(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk must not leave a torn temporary behind
            raise

    if wait_when_full:
        retry_when_full(str(path), path.parent, write)
    else:
        write()
    if durable:
        fsync(path.parent)
    return path
