"""Which process does what: the split of an `accelerate launch` into extractors and trainers.

Ranks `0 .. E-1` extract and ranks `E .. W-1` train, so the trainers form one contiguous data-parallel group
whose collectives never involve an extractor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from dflash_stream.config import Config

Role = Literal["extractor", "trainer", "single"]


@dataclass(frozen=True)
class RoleInfo:
    role: Role
    index: int
    """Position among the processes of the same role (extractor shard index, or trainer data-parallel rank)."""
    count: int
    """Processes with this role."""
    global_rank: int
    world_size: int
    trainer_group: dist.ProcessGroup | None = None
    """The trainers' process group (None when one process trains)."""

    @property
    def speaks_for_role(self) -> bool:
        """The one process per role that draws bars and writes role-wide files."""
        return self.index == 0


def world() -> tuple[int, int]:
    """(rank, world size) as set by `accelerate launch` / torchrun, or (0, 1) for a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed() -> torch.device:
    """Join the launch's process group through accelerate (gloo on CPU, nccl on GPU); this process's device."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available()).device


def assign_role(cfg: Config) -> RoleInfo:
    """This process's role in a combined run (`dflash-stream run`)."""
    rank, world_size = world()
    extractors, trainers = cfg.roles.split(world_size)
    if extractors == 0:
        return RoleInfo("single", 0, 1, rank, world_size)
    init_distributed()
    # Every rank must take part in creating a group, even the ranks outside it.
    group = dist.new_group(list(range(extractors, world_size))) if trainers > 1 else None
    if rank < extractors:
        return RoleInfo("extractor", rank, extractors, rank, world_size)
    return RoleInfo("trainer", rank - extractors, trainers, rank, world_size, group)


def assign_uniform(role: Role) -> RoleInfo:
    """All processes of this launch share one role (`dflash-stream extract` or `dflash-stream train`)."""
    rank, world_size = world()
    init_distributed()
    group = dist.group.WORLD if role == "trainer" and world_size > 1 else None
    return RoleInfo(role, rank, world_size, rank, world_size, group)
