"""Rows in, token samples out: sources, row formats, chat template + assistant mask, ids, sharding, batching."""

from dflash_stream.data.batching import take_batch, token_budget_batches
from dflash_stream.data.formats import RowError, to_messages
from dflash_stream.data.prepare import PreparedSample, prepare_shard
from dflash_stream.data.report import DataReport
from dflash_stream.data.sources import plan_rows, stable_hash
from dflash_stream.data.template import ChatEncoder

__all__ = [
    "ChatEncoder", "DataReport", "PreparedSample", "RowError", "plan_rows", "prepare_shard", "stable_hash",
    "take_batch", "to_messages", "token_budget_batches",
]
