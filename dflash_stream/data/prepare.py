"""Dataset rows to token samples for one extractor shard: ids, loss mask, filtering, the data report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from dflash_stream.config import Config, ConfigError
from dflash_stream.data.formats import RowError, split_for_regeneration, to_messages
from dflash_stream.data.report import DataReport
from dflash_stream.data.sources import RowRef, load_source, plan_rows, shard, source_name
from dflash_stream.data.template import ChatEncoder
from dflash_stream.log import get_logger
from dflash_stream.rundir import RunDir

log = get_logger(__name__)


@dataclass(frozen=True)
class PreparedSample:
    sample_id: int
    input_ids: np.ndarray
    """int32 [T]."""
    loss_mask: np.ndarray
    """bool [T]: the assistant's tokens."""
    origin: str
    """`source#row` (plus `/copy`), to name the sample in messages."""
    needs_response: bool = False
    """With data.regenerate: `input_ids` is the prompt; the target's response is still to be appended."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def with_response(self, response: Sequence[int], max_length: int) -> PreparedSample:
        """Prompt + generated tokens, the mask over the generated ones, cut to `max_length`."""
        ids = np.concatenate([self.input_ids, np.asarray(response, dtype=np.int32)])[:max_length]
        mask = np.zeros(len(ids), dtype=bool)
        mask[len(self.input_ids):] = True
        return replace(self, input_ids=ids, loss_mask=mask, needs_response=False)


def _origin(cfg: Config, ref: RowRef) -> str:
    label = f"{source_name(cfg.data.sources[ref.source])}#{ref.row}"
    return f"{label}/{ref.copy}" if ref.copy else label


def _build(cfg: Config, encoder: ChatEncoder, row: dict, ref: RowRef, report: DataReport) -> PreparedSample:
    """One row as a sample; raises RowError (with the skip reason) when it cannot be one."""
    source = cfg.data.sources[ref.source]
    messages = to_messages(row, source.format, cfg.data.system_prompt)
    origin = _origin(cfg, ref)
    max_length, needed = cfg.data.max_length, cfg.min_supervised_tokens
    if cfg.data.regenerate:
        prompt = encoder.encode_prompt(split_for_regeneration(messages))
        if len(prompt) + needed > max_length:
            raise RowError("too_long", f"prompt of {len(prompt)} tokens leaves under {needed} for the response")
        return PreparedSample(ref.sample_id, prompt, np.zeros(len(prompt), dtype=bool), origin, needs_response=True)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no_assistant_turn")
    ids, mask = encoder.encode(messages)
    supervised = int(mask.sum())
    if len(ids) > max_length:
        ids, mask = ids[:max_length], mask[:max_length]
        if int(mask.sum()) >= needed:
            report.truncated += 1
    if int(mask.sum()) < needed:
        raise RowError("too_long" if supervised >= needed else "too_few_supervised_tokens")
    return PreparedSample(ref.sample_id, ids, mask, origin)


def prepare_shard(cfg: Config, tokenizer, shard_index: int, shard_count: int
                  ) -> tuple[list[PreparedSample], DataReport]:
    """This extractor's samples in extraction order, and the report of what was kept and skipped.

    The report goes to OUTPUT/data/report-<shard>.json. With data.regenerate the samples are prompts
    (`needs_response`); the extractor completes them and rewrites the report.
    """
    try:
        encoder = ChatEncoder(tokenizer)
    except ValueError as err:
        raise ConfigError(f"target.model: {err}") from None
    loaded = [load_source(s, i) for i, s in enumerate(cfg.data.sources)]
    datasets = [rows for rows, _ in loaded]
    refs = shard(plan_rows(cfg.data, [len(d) for d in datasets]), shard_index, shard_count)
    report = DataReport(shard_index, shard_count, rows=len(refs))
    if shard_index == 0:  # malformed lines are no rows of the plan: shard 0 alone counts them, once
        for _, malformed in loaded:
            report.rows += len(malformed)
            for label in malformed:
                report.skip("malformed_line", label)
    samples = []
    for ref in refs:
        try:
            samples.append(_build(cfg, encoder, datasets[ref.source][ref.row], ref, report))
        except RowError as err:
            report.skip(err.reason, _origin(cfg, ref))
            log.debug("skipped %s: %s", _origin(cfg, ref), err)
    report.sample_ids = [s.sample_id for s in samples]
    report.write(cfg.output_dir)
    log.info(report.summary())
    report.warn_if_few()
    if refs and not samples:
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(report.skipped.items()))
        raise ConfigError(f"data.sources: no usable row among the {len(refs)} of shard {shard_index} ({reasons}); "
                          f"see {RunDir(cfg.output_dir).data_report(shard_index)}")
    return samples, report
