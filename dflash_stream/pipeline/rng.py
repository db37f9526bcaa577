"""The random state a trainer rank checkpoints: its anchor generator and torch's global (and CUDA) RNG."""

from __future__ import annotations

from typing import Any

import torch


class RngState:
    """`state_dict`/`load_state_dict` of the random streams, so a resumed rank draws what it would have drawn."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        state = {"generator": self.generator.get_state(), "torch_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
