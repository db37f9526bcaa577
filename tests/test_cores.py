"""A CPU-only launch's cores go to the role that has work (pipeline/cores.py)."""

from __future__ import annotations

import os

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
