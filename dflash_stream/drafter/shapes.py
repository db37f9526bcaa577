"""The fixed family of attention shapes the trainer's micro-batches take, and a count of the graphs it compiles.

On CUDA the drafter's FlexAttention runs under `torch.compile(dynamic=False)`, which builds one graph per input
shape; past torch's recompile limit (8) it falls back to an eager kernel that materialises every score. So a
micro-batch is not shaped by its samples but by its length bucket: S = the bucket's length, A = min(num_anchors,
S - 1) blocks (the most any sample of that length can have; blocks without an anchor are masked out of the
loss), N = the rows of `train.batch_tokens` that fit at that length, capped so that the batch costs no more
than one of the longest bucket (empty rows pad a partial batch). One bucket is one shape is one compiled graph,
so a run compiles at most `len(buckets)` graphs, known before it starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dflash_stream.config import MAX_LENGTH_BUCKETS, Config
from dflash_stream.log import get_logger

log = get_logger(__name__)

MIN_BUCKET = 64


@dataclass(frozen=True)
class Shape:
    rows: int
    """N: samples per micro-batch (empty rows pad a partial batch)."""
    length: int
    """S: context positions (every sample right-padded to it)."""
    blocks: int
    """A: anchor blocks per sample (blocks beyond a sample's eligible anchors are masked out)."""


def default_buckets(max_length: int) -> list[int]:
    """Lengths 2^k and 1.5 x 2^k (each a multiple of 64 and so of FlexAttention's 128-wide tiles from 256 on),
    from 64 up to `max_length`, which is always the last: the largest MAX_LENGTH_BUCKETS of them. Neighbours
    differ by x1.33 or x1.5, so a sample pads by about 20 % on average."""
    series = sorted({b for k in range(6, 20) for b in (2**k, 3 * 2 ** (k - 1)) if MIN_BUCKET <= b < max_length})
    return [*series, max_length][-MAX_LENGTH_BUCKETS:]


class ShapePlan:
    """The length buckets and the one shape each gives a micro-batch."""

    def __init__(self, buckets: Sequence[int], batch_tokens: int, num_anchors: int, block_size: int) -> None:
        self.buckets = list(buckets)
        self.batch_tokens = batch_tokens
        blocks = [max(1, min(num_anchors, b - 1)) for b in self.buckets]
        # A sample costs its context plus its block tokens (S + A x B), and the block tokens dominate: with
        # rows = batch_tokens // S alone, a batch of short samples would cost several times (in time and
        # memory) what a batch of the longest does. So no bucket's batch may cost more than the last one's.
        cost = [b + a * block_size for b, a in zip(self.buckets, blocks, strict=True)]
        ceiling = max(1, batch_tokens // self.buckets[-1]) * cost[-1]
        self.shapes = [Shape(max(1, min(batch_tokens // b, ceiling // c)), b, a)
                       for b, a, c in zip(self.buckets, blocks, cost, strict=True)]

    @classmethod
    def from_config(cls, cfg: Config) -> ShapePlan:
        buckets = cfg.train.length_buckets or default_buckets(cfg.data.max_length)
        return cls(buckets, cfg.train.batch_tokens, cfg.train.num_anchors, cfg.drafter.block_size)

    def __len__(self) -> int:
        return len(self.shapes)

    def bucket(self, length: int) -> int:
        """Index of the shortest bucket that holds `length` tokens (the last for anything longer: samples are
        cut to data.max_length, which the last bucket covers)."""
        for i, b in enumerate(self.buckets):
            if length <= b:
                return i
        return len(self.buckets) - 1

    def describe(self) -> str:
        shapes = ", ".join(f"{s.rows}x{s.length}x{s.blocks}" for s in self.shapes)
        return f"{len(self)} length buckets, at most {len(self)} compiled attention graphs (N x S x A: {shapes})"


def fixed_shapes_on(cfg: Config, flex: bool) -> bool:
    """train.fixed_shapes: `auto` pads to the plan's shapes where attention is compiled (`flex`: the drafter
    uses FlexAttention on this device), where a new shape costs a compile; elsewhere padding only costs time."""
    return cfg.train.fixed_shapes == "on" or (cfg.train.fixed_shapes == "auto" and flex)


def _graphs_so_far() -> int:
    # Dynamo's own tally of the graphs it compiled in this process (FlexAttention is the trainer's only one).
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileWatch:
    """Counts the graphs torch.compile built since the trainer started and warns when one is built beyond the
    plan: every bucket compiles once when it first comes up (the warm-up); any further graph is a recompile that
    the fixed shapes should have prevented (a guard torch did not expect, or shapes outside the family)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.shapes: set[tuple[int, ...]] = set()
        self._start = _graphs_so_far()
        self._warned_at = bound

    @property
    def graphs_compiled(self) -> int:
        return _graphs_so_far() - self._start

    def observe(self, shape: tuple[int, ...]) -> None:
        """Record a micro-batch's shape (N, S) after its forward and check the graph count."""
        self.shapes.add(shape)
        graphs = self.graphs_compiled
        if graphs > self._warned_at:
            self._warned_at = graphs
            log.warning(
                "torch.compile built attention graph %d past the %d planned (one per length bucket); last batch "
                "N x S = %s, %d distinct so far. At torch's recompile limit FlexAttention falls back to an "
                "uncompiled kernel that may run out of memory: set train.fixed_shapes=on (or fewer "
                "train.length_buckets)", graphs, self.bound, "x".join(map(str, shape)), len(self.shapes))
