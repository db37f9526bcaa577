"""Response regeneration: the target answers the prompts itself (DFlash trains on the target's own outputs).

Responses are cached in OUTPUT/data/responses-<data digest>-<shard>.jsonl, appended as they are made, so a
restart or a later re-extraction pass reuses them instead of generating again (and, when sampling, gets the
same response the first pass trained on).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from dflash_stream.config import GenerationConfig
from dflash_stream.rundir import RunDir
from dflash_stream.target_model.loading import stop_token_ids


class ResponseCache:
    def __init__(self, output_dir: str | Path, digest: str, shard_index: int) -> None:
        run = RunDir(output_dir)
        run.data.mkdir(parents=True, exist_ok=True)
        self.path = run.responses(digest, shard_index)
        self.responses: dict[int, list[int]] = {}
        # Every shard's file: the extractor count may differ from the run that generated them.
        for path in sorted(run.data.glob(run.responses(digest, "*").name)):
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line torn by a crash; that response is generated again
                    continue
                self.responses[int(record["sample_id"])] = record["tokens"]

    def get(self, sample_id: int) -> list[int] | None:
        return self.responses.get(sample_id)

    def add(self, responses: dict[int, list[int]]) -> None:
        with self.path.open("a") as f:
            for sample_id, tokens in responses.items():
                f.write(json.dumps({"sample_id": sample_id, "tokens": tokens}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.responses.update(responses)


@torch.inference_mode()
def generate_responses(model, tokenizer, prompts: list[np.ndarray], gen: GenerationConfig,
                       max_new_tokens: int) -> list[list[int]]:
    """One response per prompt (token ids up to and including the end-of-turn token), in one batched call."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    # Left padding: every prompt ends where generation starts.
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.from_numpy(prompt.astype(np.int64))
        mask[row, width - len(prompt):] = 1
    sampling = {"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p} if gen.temperature > 0 \
        else {"do_sample": False}
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id, **sampling,
    )[:, width:].tolist()
    eos = stop_token_ids(model, tokenizer)
    responses = []
    for tokens in out:
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        responses.append(tokens[:end])
    return responses
