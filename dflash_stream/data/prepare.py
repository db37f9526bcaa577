"""Dataset rows to token samples for one extractor shard: ids, loss mask, filtering, the data report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from dflash_stream.config import Config, ConfigError
from dflash_stream.data.formats import RowError, assistant_turns, split_for_regeneration, to_messages
from dflash_stream.data.report import DataReport, SourceReport
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
    reference_tokens: int = 0
    """With data.regenerate: tokens of the dataset's own answer to the prompt (an estimate of the response's
    length for `dflash-stream data`; the target's response replaces it)."""

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


def _regeneration_prompt(encoder: ChatEncoder, messages: list, budget: int) -> tuple[np.ndarray, int]:
    """(prompt ids, index of the answer it replaces) for regeneration: the prompt before the last assistant
    turn, else before the latest earlier one whose prompt fits in `budget` tokens (a long agent trajectory
    still gives a sample: the target answers at an earlier step)."""
    cuts = assistant_turns(messages) or [len(messages)]
    cuts = [c for c in cuts if any(m["role"] == "user" for m in messages[:c])] or cuts[-1:]
    best = encoder.encode_prompt(split_for_regeneration(messages, cuts[-1])), cuts[-1]
    if len(best[0]) <= budget:
        return best
    lo, hi = 0, len(cuts) - 2
    while lo <= hi:  # prompts grow with the cut: the latest cut that fits, else the first (too long)
        mid = (lo + hi) // 2
        ids = encoder.encode_prompt(split_for_regeneration(messages, cuts[mid]))
        if len(ids) <= budget or mid == 0:
            best = ids, cuts[mid]
        if len(ids) <= budget:
            lo = mid + 1
        else:
            hi = mid - 1
    return best


def _build(cfg: Config, encoder: ChatEncoder, row: dict, ref: RowRef, report: DataReport) -> PreparedSample:
    """One row as a sample; raises RowError (with the skip reason) when it cannot be one."""
    source = cfg.data.sources[ref.source]
    messages = to_messages(row, source.format, cfg.data.system_prompt)
    origin = _origin(cfg, ref)
    max_length, needed = cfg.data.max_length, cfg.min_supervised_tokens
    if cfg.data.regenerate:
        prompt, cut = _regeneration_prompt(encoder, messages, max_length - needed)
        if len(prompt) + needed > max_length:
            raise RowError("too_long", f"prompt of {len(prompt)} tokens (even before the first answer) leaves "
                                       f"under {needed} of data.max_length {max_length} for the response")
        answer = messages[cut] if cut < len(messages) else None
        reference = 0
        if answer is not None:
            reference = len(encoder.tokenizer(answer.get("content") or "", add_special_tokens=False)["input_ids"])
        return PreparedSample(ref.sample_id, prompt, np.zeros(len(prompt), dtype=bool), origin, needs_response=True,
                              reference_tokens=reference)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no_assistant_turn", "no answer to train on (set data.regenerate to have the target "
                                            "write it)")
    ids, mask = encoder.encode(messages)
    supervised = int(mask.sum())
    if len(ids) > max_length:
        ids, mask = ids[:max_length], mask[:max_length]
        if int(mask.sum()) >= needed:
            report.truncated += 1
    if int(mask.sum()) < needed:
        if supervised >= needed:
            raise RowError("too_long", f"{len(ids)}+ tokens: under {needed} supervised tokens within data.max_length")
        raise RowError("too_few_supervised_tokens", f"{supervised} supervised tokens, under the {needed} needed")
    return PreparedSample(ref.sample_id, ids, mask, origin)


def prepare_samples(cfg: Config, tokenizer, shard_index: int, shard_count: int
                    ) -> tuple[list[PreparedSample], DataReport]:
    """This shard's samples in extraction order and the report of what was kept and skipped, per source;
    writes nothing (`dflash-stream data` looks at the data with it)."""
    try:
        encoder = ChatEncoder.from_config(tokenizer, cfg.data)
    except ValueError as err:
        raise ConfigError(f"target.model: {err}") from None
    loaded = [load_source(s, i) for i, s in enumerate(cfg.data.sources)]
    datasets = [rows for rows, _ in loaded]
    refs = shard(plan_rows(cfg.data, [len(d) for d in datasets]), shard_index, shard_count)
    report = DataReport(shard_index, shard_count, rows=len(refs),
                        sources=[SourceReport(source_name(s)) for s in cfg.data.sources])
    for ref in refs:
        report.sources[ref.source].rows += 1
    if shard_index == 0:  # malformed lines are no rows of the plan: shard 0 alone counts them, once
        for index, (_, malformed) in enumerate(loaded):
            report.rows += len(malformed)
            report.sources[index].rows += len(malformed)
            for label in malformed:
                report.skip("malformed_line", label, "not a JSON object", source=index)
    samples = []
    for ref in refs:
        try:
            sample = _build(cfg, encoder, datasets[ref.source][ref.row], ref, report)
        except RowError as err:
            detail = str(err).split(": ", 1)[1] if ": " in str(err) else ""
            report.skip(err.reason, _origin(cfg, ref), detail, source=ref.source)
            log.debug("skipped %s: %s", _origin(cfg, ref), err)
            continue
        samples.append(sample)
        report.sample_sources[sample.sample_id] = ref.source
        report.special_text += encoder.special_text_count > 0
    report.sample_ids = [s.sample_id for s in samples]
    report.count_kept()
    return samples, report


def prepare_shard(cfg: Config, tokenizer, shard_index: int, shard_count: int
                  ) -> tuple[list[PreparedSample], DataReport]:
    """This extractor's samples in extraction order, and the report of what was kept and skipped.

    The report goes to OUTPUT/data/report-<shard>.json. With data.regenerate the samples are prompts
    (`needs_response`); the extractor completes them and rewrites the report. A source that keeps under half
    of its rows is a warning here, at the start of the run.
    """
    samples, report = prepare_samples(cfg, tokenizer, shard_index, shard_count)
    refs = report.rows
    report.write(cfg.output_dir)
    log.info(report.summary())
    report.source_warnings([s.format for s in cfg.data.sources])
    report.warn_if_few()
    if refs and not samples:
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(report.skipped.items()))
        raise ConfigError(f"data.sources: no usable row among the {refs} of shard {shard_index} ({reasons}); "
                          f"see {RunDir(cfg.output_dir).data_report(shard_index)}")
    return samples, report
