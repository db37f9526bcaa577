"""extract.engine vllm: an extractor whose states come from vLLM servers instead of its own forward.

It is the extractor in every other respect (same shard, passes, windows, regeneration, packing, codecs, budget,
backpressure, resume, redo of quarantined segments, state health); only the capture differs. The target's
weights are never loaded here: its config gives the layer ids and width, its tokenizer the samples. Each sample
is one request to the servers (`target_model/served_states.py`); requests stay in flight within this extractor's
share of the spool, their states go to the sink as they come (in any order within a pass), and a spool file is
deleted once its states are in the packer. A full store stops the sink, so no new request goes out; a crash
before a segment is published only means its samples are asked for again by the next run.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dflash_stream.data import PreparedSample
from dflash_stream.errors import DFlashError
from dflash_stream.pipeline.extractor import Extractor, _Captured
from dflash_stream.target_model import TargetShape, stored_layer_ids, target_shape
from dflash_stream.target_model.loading import load_tokenizer, target_stop_ids
from dflash_stream.target_model.served_states import Failed, Served, StateClient, share_bytes
from dflash_stream.target_model.vllm_serve import spool_dir


def spool_writer(output_dir: str | Path, index: int) -> str:
    """What the spool files of extractor `index` of the run in `output_dir` are named after: servers and spools
    shared by several runs keep their files apart."""
    run = hashlib.sha1(str(Path(output_dir).absolute()).encode()).hexdigest()[:8]
    return f"{run}-extractor-{index}"


class ServedExtractor(Extractor):
    """This rank's share of the data, every pass, into the store, with the states computed by vLLM servers."""

    def _open_target(self, target: tuple[Any, Any] | None) -> tuple[Any, TargetShape, set[int]]:
        cfg = self.cfg
        self.model = None  # the servers hold the target
        tokenizer = load_tokenizer(cfg.target)
        shape = target_shape(cfg.target, download=True, hints=False, count=False)
        self.client = StateClient(cfg.extract, spool_dir(cfg), stored_layer_ids(shape.num_layers, cfg.target, cfg.verifier_states),
                                  shape.hidden_size, spool_writer(cfg.output_dir, self.role.index),
                                  share_bytes(cfg.extract, self.role.count), cfg.data.max_length)
        self.client.start()
        self._client_open = True
        return tokenizer, shape, target_stop_ids(cfg.target, tokenizer)

    def run(self, until_full: bool = False) -> bool:
        finished = super().run(until_full)
        if finished and self._client_open:
            self.client.close()
            self._client_open = False
        return finished

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "engine": "vllm", "servers": self.client.stats()}

    def _extract_batch(self, pass_index: int, batch: list[PreparedSample]) -> None:
        """Send the batch's requests as the spool has room, handing over the states that come meanwhile."""
        for sample in batch:
            self._wait_for_room(sample.num_tokens)
            self.client.submit(sample.sample_id, sample.input_ids.tolist(), (pass_index, sample))
            self._hand_over(wait=0)

    def _flush(self) -> None:
        """What is in flight is packed (or held by a refusing buffer) before a pass closes or the feed returns."""
        self._hand_over(wait=-1)

    def _wait_for_room(self, tokens: int) -> None:
        """Until the spool has room for one more request: hand over what comes in the meantime, and while
        nothing is out, wait for the sink to pack (and delete) files: a full store holds it back."""
        started = None
        while not self.client.room_for(tokens):
            if self.client.in_flight:
                self._hand_over(wait=1)
                continue
            started = started or time.perf_counter()
            if self._sink.error is not None:
                raise self._sink.error
            self.client.wait_for_room(tokens, timeout=0.5)
        if started is not None:
            self.backpressure_seconds += time.perf_counter() - started

    def _hand_over(self, wait: int) -> None:
        """Pass the states that came to the sink: at least `wait` of them (waiting for them), all in flight with
        -1, only those already here with 0."""
        taken = 0
        while self.client.in_flight:
            must = wait < 0 or taken < wait
            outcome = self.client.next(timeout=None if must else 0)
            if outcome is None:
                return
            taken += 1
            served = self._checked(outcome)
            pass_index, sample = served.payload
            self._to_sink(
                _Captured(pass_index, [sample], served.states.to(torch.bfloat16).unsqueeze(0), None, served.release))
            self._forwarded_tokens += sample.num_tokens
            self._advance(1)

    def _checked(self, outcome: Served | Failed) -> Served:
        if isinstance(outcome, Failed):
            sample = outcome.payload[1] if isinstance(outcome.payload, tuple) else outcome.payload
            raise DFlashError(
                f"sample {outcome.key} ({sample.origin}): no hidden states from the servers after {outcome.tries} "
                f"tries (extract.retries {self.cfg.extract.retries}), the last from {outcome.endpoint}: "
                f"{outcome.error}; run again to ask for what the store lacks")
        return outcome

    def _forward(self, batch: list[PreparedSample]) -> Iterator[tuple[list[PreparedSample], torch.Tensor, Any]]:
        """The states of `batch` one sample at a time (what extracting a quarantined segment again asks)."""
        if not self._client_open:
            self.client.start()
            self._client_open = True
        todo = list(batch)
        while todo or self.client.in_flight:
            while todo and self.client.room_for(todo[0].num_tokens):
                sample = todo.pop(0)
                self.client.submit(sample.sample_id, sample.input_ids.tolist(), sample)
            if not self.client.in_flight:  # room still held by files given up on
                self.client.wait_for_room(todo[0].num_tokens, timeout=0.5)
                continue
            served = self._checked(self.client.next())
            yield [served.payload], served.states.to(torch.bfloat16).unsqueeze(0), None
            served.release()
