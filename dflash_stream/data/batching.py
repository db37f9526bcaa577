"""Length-sorted batches under a token budget that counts padding."""

from __future__ import annotations

from collections.abc import Sequence


def take_batch(lengths: Sequence[int], start: int, budget: int) -> int:
    """End of the batch that begins at `start` in `lengths` sorted longest first: rows x longest <= budget.

    A sample longer than the budget still forms a batch of one; it cannot be split.
    """
    longest = lengths[start]
    end = start + 1
    while end < len(lengths) and (end - start + 1) * longest <= budget:
        end += 1
    return end


def token_budget_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices into `lengths` grouped into batches, longest first, each within `budget` tokens padded."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ordered = [lengths[i] for i in order]
    batches, start = [], 0
    while start < len(order):
        end = take_batch(ordered, start, budget)
        batches.append(order[start:end])
        start = end
    return batches
