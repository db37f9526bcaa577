"""Device-to-host copies of captured states that overlap the next forward pass.

A copy queued on the forward's own stream runs between two forwards, so the GPU idles on it. Here it runs on a
side stream, into pinned host memory (the only kind a GPU copies to asynchronously), and hands back an event
that the consumer waits on before it reads the host tensor.
"""

from __future__ import annotations

import torch


class HostCopier:
    """`copy(states)` -> (host tensor, ready event or None): on CUDA, a non-blocking copy on a side stream into
    a fresh pinned buffer (torch caches pinned blocks, reusing one only after its copy has finished); elsewhere
    the states are already on the host."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if self.stream is None or not states.is_cuda:
            return states, None
        self.stream.wait_stream(torch.cuda.current_stream(states.device))  # the states are complete
        with torch.cuda.stream(self.stream):
            host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
            host.copy_(states, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        # The states were allocated on the forward's stream: keep the allocator from reusing them mid-copy.
        states.record_stream(self.stream)
        return host, ready
