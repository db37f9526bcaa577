"""The `store cores` section of `plan`: how many CPU cores the store's coding takes beside each extractor
(encode, checksum, write) and each trainer (read, check, decode), from per-core rates that were measured."""

from __future__ import annotations

import math
from typing import Any

from dflash_stream.store import codecs, sizes


def store_cores(codec: str, width: int, time_plan: dict[str, Any], tune: dict | None) -> dict[str, Any]:
    """Cores per extractor and per trainer at the planned token rates. The encode rate is tune's measurement
    of this target when there is one, else the codec's figure from `bench store`; decode always the latter."""
    c = codecs.get(codec)
    tuned = (tune or {}).get("encode_bytes_per_core_s", {}).get(codec)
    encode, encode_source = ((tuned, f"measured by tune ({tune.get('device', '?')})") if tuned else
                             (c.design_encode_bytes_per_core_s, c.design_rate_note))
    out: dict[str, Any] = {"codec": codec}
    for role, rate, per_core, source in (
        ("extract", "encode", encode, encode_source),
        ("train", "decode", c.design_decode_bytes_per_core_s, c.design_rate_note),
    ):
        phase = time_plan["phases"][role]
        raw_bytes_per_s = phase["tok_s_per_process"] * sizes.raw_bytes_per_token(width)
        out[role] = {
            "raw_bytes_per_s": raw_bytes_per_s, f"{rate}_bytes_per_core_s": per_core, "source": source,
            # Whole cores: a fraction of a core shared with the role's own work is still a core to set aside.
            "cores_per_process": math.ceil(raw_bytes_per_s / per_core), "load": raw_bytes_per_s / per_core,
        }
    return out


def render_store_cores(s: dict[str, Any]) -> list[str]:
    out = ["", f"store cores  (codec {s['codec']}; CPU cores the store's coding needs, per process)"]
    for role, rate, what in (("extract", "encode", "per extractor"), ("train", "decode", "per trainer")):
        r = s[role]
        out.append(f"  {what:<14}{r['cores_per_process']:>3}  ({r['raw_bytes_per_s'] / 1e9:.2f} GB/s of raw states "
                   f"at {r[f'{rate}_bytes_per_core_s'] / 1e9:.2f} GB/s per core {rate}: {r['load']:.2f} cores)  "
                   f"[{r['source']}]")
    return out
