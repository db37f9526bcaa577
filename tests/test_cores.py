"""A CPU-only launch's cores go to the role that has work (pipeline/cores.py)."""

from __future__ import annotations

import os
import sys

import torch

from dflash_stream.pipeline.cores import HostCores


def test_a_role_takes_the_idle_cores_of_its_host_and_gives_them_back():
    """Under `accelerate launch` a process starts with one thread (OMP_NUM_THREADS=1): it takes the host's cores
    (shared with its peers) while the other role cannot run, and returns to its share as soon as it can. On a GPU,
    or with every core already, nothing changes."""
    before = torch.get_num_threads()
    host = len(os.sched_getaffinity(0))
    try:
        torch.set_num_threads(1)
        cores = HostCores(torch.device("cpu"))
        assert cores.enabled == (host > 1)
        cores.use(True)
        assert torch.get_num_threads() == host
        cores.use(False)
        assert torch.get_num_threads() == 1
        assert HostCores(torch.device("cpu"), peers=host).enabled is False  # one core each already
        gpu = HostCores(torch.device("cuda"))
        gpu.use(True)
        assert not gpu.enabled and torch.get_num_threads() == 1
        torch.set_num_threads(host)
        assert HostCores(torch.device("cpu")).enabled is False
    finally:
        torch.set_num_threads(before)


def test_bench_pipeline_counts_the_cpu_of_every_process_a_run_started(tmp_path):
    """`bench pipeline`'s floor divides a run's CPU seconds over the cores: the CPU of the ranks `accelerate launch`
    starts (grandchildren of the bench) must be in it, not only the launcher's, or the floor would be a fiction."""
    from dflash_stream.bench.pipeline import _timed, core_use

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    spawn = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}], check=True)"
    run = _timed([sys.executable, "-c", spawn], tmp_path / "log")
    assert run.cpu_seconds >= 0.4  # the grandchild's busy loop
    assert run.seconds >= 0.4
    assert 0 < core_use(run, 1) <= 1.05
