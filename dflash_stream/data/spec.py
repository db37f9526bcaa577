"""Which samples a config makes: the data spec, and its digest (the store's, the response cache's and
`dflash-stream data`'s summary name their data with it)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dflash_stream.config import Config


def data_spec(cfg: Config) -> dict[str, Any]:
    """Everything that decides which samples exist and what their tokens are."""
    from dflash_stream.data.template import template_fingerprint

    return {
        "sources": [s.model_dump() for s in cfg.data.sources],
        "system_prompt": cfg.data.system_prompt,
        "regenerate": cfg.data.regenerate,
        "generation": generation_spec(cfg) if cfg.data.regenerate else None,
        "min_supervised_tokens": cfg.min_supervised_tokens,
        "seed": cfg.data.seed,
        # data.chat_template (its text's digest) and data.chat_template_kwargs, only when set: a run without
        # them keeps the digest it had before they existed.
        **template_fingerprint(cfg.data),
    }


def data_spec_digest(cfg: Config) -> str:
    """A short digest of the data spec."""
    return hashlib.sha256(json.dumps(data_spec(cfg), sort_keys=True).encode()).hexdigest()[:16]


def generation_spec(cfg: Config) -> dict[str, Any]:
    """The generation settings that decide the answers. Where they come from (endpoints, concurrency, timeouts)
    does not; engine hf keeps the settings it always had, batch size included (padding moves the numbers)."""
    gen = cfg.data.generation
    spec = {"max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature, "top_p": gen.top_p}
    if gen.engine == "hf":
        return {**spec, "batch_size": gen.batch_size}
    return {**spec, "engine": gen.engine, "model": gen.model, **({"seed": gen.seed} if gen.temperature > 0 else {})}
