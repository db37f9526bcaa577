"""`dflash-stream bench pipeline`'s own accounting (the bench itself runs the demo twice over: a benchmark command,
not a test)."""

from __future__ import annotations

import sys

from dflash_stream.bench.pipeline import core_use, timed_run


def test_bench_pipeline_counts_the_cpu_of_every_process_a_run_started(tmp_path):
    """`bench pipeline`'s floor divides a run's CPU seconds over the cores: the CPU of the ranks `accelerate launch`
    starts (grandchildren of the bench) must be in it, not only the launcher's, or the floor would be a fiction."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    spawn = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}], check=True)"
    run = timed_run([sys.executable, "-c", spawn], tmp_path / "log")
    assert run.cpu_seconds >= 0.4  # the grandchild's busy loop
    assert run.seconds >= 0.4
    assert 0 < core_use(run, 1) <= 1.05
