"""A CPU-only launch's cores go to the role that has work.

`accelerate launch` starts every process with OMP_NUM_THREADS=1, so that the extractors and trainers of one host do
not oversubscribe its cores; on a CPU-only run (the demo) the roles then split the cores between them for the
whole run. But a role often cannot work: the trainers until the first segment is ready (the extractor regenerates
and extracts the first window meanwhile), the extractors once all the data is extracted (the trainers train its
last uses meanwhile), or while the full buffer holds them back with no answer left to generate ahead
(`Store.writers_idle`). Then the other role takes the idle cores: `HostCores.use(True)` while its counterpart
cannot run, `use(False)` (its launch share) as soon as it can. On a GPU, or in a process that already has every
core (single-process mode, a separate `extract` or `train`), it changes nothing.
"""

from __future__ import annotations

import os

import torch

from dflash_stream.log import get_logger

log = get_logger(__name__)


class HostCores:
    """The torch threads of one process: its launch share, or the host's cores over `peers` (the processes of its
    role on this host, which take them together)."""

    def __init__(self, device: torch.device, peers: int = 1) -> None:
        self.share = torch.get_num_threads()
        self.lent = max(self.share, len(os.sched_getaffinity(0)) // max(peers, 1))
        self.enabled = device.type == "cpu" and self.lent > self.share
        self.using = self.share

    def use(self, all_of_them: bool) -> None:
        """Take the cores the other role leaves idle (True), or keep to this process's share (False). Call it from
        the thread that runs the model: torch's thread count is set per calling thread."""
        want = self.lent if all_of_them and self.enabled else self.share
        if want != self.using:
            torch.set_num_threads(want)
            self.using = want
            log.debug("torch threads: %d", want)
