"""`dflash-stream bench memory`: the memory model (`sizing/memory.py`) against measured peaks, and the chunked
LM-head loss against the unchunked one.

Every measurement runs in a fresh child process, which first warms up the same code at a tiny size (so that
lazy initialisation is not counted), takes its baseline, builds the role's objects (drafter, head, optimizer,
batch; or the target), resets the peak, and runs the real work: two trainer steps (dflash_loss forward,
backward, AdamW step, as the trainer builds them), or one capture forward (`LayerCapture` on a real transformers
model, random weights). The figure is the peak over the baseline:

- on CUDA, `torch.cuda.max_memory_allocated()` over `memory_allocated()` at the baseline;
- on CPU, the child's peak resident set (`VmHWM`, reset through `/proc/self/clear_refs`) over its resident set
  at the baseline, with glibc's mmap threshold pinned at 64 KiB so that every tensor is its own mapping and a
  freed one leaves the resident set at once (otherwise malloc's arenas keep freed memory and hide peaks).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from dflash_stream.errors import DFlashError
from dflash_stream.sizing.memory import (
    DrafterDims,
    TargetDims,
    extractor_memory,
    forward_shape,
    train_batch,
    trainer_memory,
)
from dflash_stream.units import fmt_bytes

TOLERANCE = 0.25  # estimates within +-25 % of measured
DRAFTER = {"hidden_size": 256, "intermediate_size": 768, "num_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "context_layers": 3, "vocab_size": 16384, "block_size": 16}
TRAIN_SIZES = [{"sequences": 2, "length": 256, "anchors": 64}, {"sequences": 4, "length": 512, "anchors": 128}]
CHUNK_ROWS = 1024
# SmolLM2-135M's shape (the demo target) with 8 of its 30 layers, so that activations weigh beside the weights.
TARGET = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 9,
          "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True, "head_dim": 64}
CAPTURED = [1, 2, 3, 4, 5]
EXTRACT_SIZES = [{"rows": 4, "length": 512}, {"rows": 8, "length": 1024}]
LOSS = {"dim": 256, "vocab": 8192, "chunk_rows": 512, "rows": [2048, 8192]}


def register_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("memory", help="memory model vs measured peaks (trainer step, extractor forward); "
                                          "chunked vs unchunked LM-head loss")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=bench_memory)


# ------------------------------------------------------------------------------------------- child process


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise DFlashError(f"bench memory: /proc/self/status has no {key} (CPU measurement needs Linux)")


class _Meter:
    """Peak memory above a baseline: the CUDA allocator's statistics on a GPU, the peak resident set on CPU."""

    def __init__(self, device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _status("VmRSS")

    def reset_peak(self) -> None:
        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current resident set

    def peak(self) -> int:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status("VmHWM") - self.base


def _drafter_parts(dims: dict[str, int], device):
    import torch

    from dflash_stream.drafter import DFlashDrafter, DrafterSpec, TargetHead

    spec = DrafterSpec(
        hidden_size=dims["hidden_size"], intermediate_size=dims["intermediate_size"], num_layers=dims["num_layers"],
        num_attention_heads=dims["num_attention_heads"], num_key_value_heads=dims["num_key_value_heads"],
        head_dim=dims["head_dim"], rope_theta=1e6, rms_norm_eps=1e-6, vocab_size=dims["vocab_size"],
        block_size=dims["block_size"], mask_token_id=dims["vocab_size"] - 1,
        target_layer_ids=list(range(dims["context_layers"])), num_target_layers=dims["context_layers"] + 1,
    )
    bf16 = device.type == "cuda"
    drafter = DFlashDrafter(spec).to(device)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(spec.vocab_size, spec.hidden_size, generator=g) * 0.02 for _ in range(2)]
    head = TargetHead(*(w.to(device, torch.bfloat16 if bf16 else torch.float32) for w in weights))
    decay = [p for p in drafter.parameters() if p.ndim >= 2]
    no_decay = [p for p in drafter.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-4)
    return drafter, head, optimizer, bf16


def _train_steps(dims: dict[str, int], size: dict[str, int], device, meter: _Meter | None) -> None:
    import torch

    from dflash_stream.drafter import dflash_loss

    if meter:
        meter.start()
    drafter, head, optimizer, bf16 = _drafter_parts(dims, device)
    n, s = size["sequences"], size["length"]
    g = torch.Generator().manual_seed(1)
    batch = {
        "hidden_states": torch.randn(n, s, dims["context_layers"] * dims["hidden_size"], generator=g)
        .to(torch.bfloat16).to(device),
        "input_ids": torch.randint(0, dims["vocab_size"], (n, s), generator=g).to(device),
        "loss_mask": torch.ones(n, s, dtype=torch.bool, device=device),
        "lengths": torch.full((n,), s, device=device),
    }
    if meter:
        meter.reset_peak()
    for _ in range(2):  # the second step runs with AdamW's states in place, as every later step does
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = dflash_loss(drafter, head, batch, num_anchors=size["anchors"], gamma=7.0, chunk_rows=CHUNK_ROWS)
        (out.loss * out.weight).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _llama(config: dict[str, int], device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**config, max_position_embeddings=4096))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # target_model.loading.resolve_dtype
    return model.to(device, dtype).eval().requires_grad_(False)


def _capture(config: dict[str, int], size: dict[str, int], device, meter: _Meter | None) -> None:
    import torch

    from dflash_stream.target_model.capture import LayerCapture

    if meter:
        meter.start()
    model = _llama(config, device)
    capture = LayerCapture(model, [i for i in CAPTURED if i < config["num_hidden_layers"]])
    rows, length = size["rows"], size["length"]
    ids = torch.randint(0, config["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[-1, length // 2:] = 0  # right padding in one row, as the extractor's batches have: a real 4-D mask
    ids, mask = ids.to(device), mask.to(device)
    if meter:
        meter.reset_peak()
    capture(ids, mask)


def _head_loss(rows: int, chunk_rows: int | None, device, meter: _Meter | None) -> Any:
    import torch

    from dflash_stream.drafter.loss import head_cross_entropy

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(rows, LOSS["dim"], generator=g).to(device).requires_grad_(True)
    weight = (torch.randn(LOSS["vocab"], LOSS["dim"], generator=g) * 0.05).to(device)
    target = torch.randint(0, LOSS["vocab"], (rows,), generator=g).to(device)
    w = torch.rand(rows, generator=g).to(device)
    if meter:
        meter.start()
        meter.reset_peak()
    total, _ = head_cross_entropy(hidden, weight, target, w, chunk_rows)
    total.backward()
    return total.detach(), hidden.grad


def child_main() -> None:
    """Entry point of a measuring child: a job as JSON on stdin, {"measured_bytes": N} on stdout."""
    import torch

    job = json.loads(sys.stdin.read())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meter = _Meter(device)
    if job["kind"] == "trainer":
        tiny = {"sequences": 1, "length": 32, "anchors": 4}
        _train_steps(job["dims"], tiny, device, None)
        _train_steps(job["dims"], job["size"], device, meter)
    elif job["kind"] == "extractor":
        _capture({**job["config"], "num_hidden_layers": 6}, {"rows": 1, "length": 32}, device, None)
        _capture(job["config"], job["size"], device, meter)
    else:
        _head_loss(64, job["chunk_rows"], device, None)
        _head_loss(job["rows"], job["chunk_rows"], device, meter)
    print(json.dumps({"measured_bytes": meter.peak(), "device": str(device)}))


def _measure(job: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    code = "from dflash_stream.bench.memory import child_main; child_main()"
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(job), capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode != 0:
        raise DFlashError(f"bench memory: the measuring child failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------- estimates


def _trainer_estimate(size: dict[str, int], cuda: bool) -> tuple[int, dict[str, int]]:
    dims = DrafterDims(**DRAFTER)
    batch = train_batch(size["sequences"], size["length"], size["anchors"], DRAFTER["block_size"])
    est = trainer_memory(dims, batch, bf16=cuda, flex=cuda, chunk_rows=CHUNK_ROWS, tied_head=False, foreach=cuda)
    # The bench steps AdamW directly; the trainer's flattened all-reduce copies are not part of this step.
    return est.phases["backward"], est.parts


def _extractor_estimate(size: dict[str, int], cuda: bool) -> tuple[int, dict[str, int]]:
    from dflash_stream.sizing.memory import target_dims
    from dflash_stream.target_model.shape import TargetShape

    t = TARGET
    dims: TargetDims = target_dims(TargetShape(
        "llama", t["num_hidden_layers"], t["hidden_size"], t["vocab_size"], t["intermediate_size"], "bench",
        t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"],
        tie_word_embeddings=t["tie_word_embeddings"],
    ))
    est = extractor_memory(dims, forward_shape(size["rows"], size["length"]), captured_layers=len(CAPTURED),
                           dtype_bytes=2 if cuda else 4)
    return est.total, est.parts


def bench_memory(args: argparse.Namespace) -> int:
    import torch

    cuda = torch.cuda.is_available()
    checks = []
    jobs = [("trainer", size, {"kind": "trainer", "dims": DRAFTER, "size": size}, _trainer_estimate)
            for size in TRAIN_SIZES]
    jobs += [("extractor", size, {"kind": "extractor", "config": TARGET, "size": size}, _extractor_estimate)
             for size in EXTRACT_SIZES]
    for role, size, job, estimate in jobs:
        estimated, parts = estimate(size, cuda)
        measured = _measure(job)["measured_bytes"]
        checks.append({"role": role, "size": size, "estimated_bytes": estimated, "measured_bytes": measured,
                       "ratio": round(estimated / measured, 3),
                       "within_target": abs(estimated / measured - 1) <= TOLERANCE, "parts": parts})

    by_rows = []
    for rows in LOSS["rows"]:
        peaks = {name: _measure({"kind": "loss", "rows": rows, "chunk_rows": chunk})["measured_bytes"]
                 for name, chunk in (("unchunked", None), ("chunked", LOSS["chunk_rows"]))}
        by_rows.append({"rows": rows, "peak_unchunked_bytes": peaks["unchunked"], "peak_chunked_bytes": peaks["chunked"]})
    rows = LOSS["rows"][-1]
    device = torch.device("cuda" if cuda else "cpu")
    loss_ref, grad_ref = _head_loss(rows, None, device, None)
    loss_chunked, grad_chunked = _head_loss(rows, LOSS["chunk_rows"], device, None)
    result = {
        "device": str(device),
        "method": "torch.cuda.max_memory_allocated over the baseline" if cuda else
                  "child process peak RSS (VmHWM, reset after warm-up and set-up) over its RSS at the baseline; "
                  "MALLOC_MMAP_THRESHOLD_=65536",
        "tolerance": TOLERANCE,
        "checks": checks,
        "loss_chunking": {
            "rows": rows, "chunk_rows": LOSS["chunk_rows"], "vocab": LOSS["vocab"], "dim": LOSS["dim"],
            "peak_unchunked_bytes": by_rows[-1]["peak_unchunked_bytes"],
            "peak_chunked_bytes": by_rows[-1]["peak_chunked_bytes"],
            # max |chunked - unchunked| over max |unchunked|: relative to the gradient's own scale
            "max_rel_grad_diff": float((grad_chunked - grad_ref).abs().max() / grad_ref.abs().max()),
            "rel_loss_diff": float(((loss_chunked - loss_ref).abs() / loss_ref.abs()).item()),
            "by_rows": by_rows,
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"memory model vs measured ({result['method']}; target +-{TOLERANCE:.0%})")
    print(f"  {'role':<10}{'size':<40}{'estimated':>12}{'measured':>12}{'ratio':>8}")
    for c in checks:
        size = ", ".join(f"{k} {v}" for k, v in c["size"].items())
        flag = "" if c["within_target"] else "  OUT OF TARGET"
        print(f"  {c['role']:<10}{size:<40}{fmt_bytes(c['estimated_bytes']):>12}{fmt_bytes(c['measured_bytes']):>12}"
              f"{c['ratio']:>8.2f}{flag}")
    lc = result["loss_chunking"]
    print(f"\nLM-head loss, {lc['dim']}-wide rows, vocab {lc['vocab']:,}, forward + backward (chunks of "
          f"{lc['chunk_rows']} rows)")
    for r in by_rows:
        print(f"  rows {r['rows']:>6,}: unchunked {fmt_bytes(r['peak_unchunked_bytes']):>10}   chunked "
              f"{fmt_bytes(r['peak_chunked_bytes']):>10}")
    print(f"  max relative gradient difference {lc['max_rel_grad_diff']:.2e}, loss {lc['rel_loss_diff']:.2e}")
    return 0
